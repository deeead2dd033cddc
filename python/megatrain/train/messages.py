"""How ``megatrain train`` words what it tells the user: one-line warnings and error texts."""

from __future__ import annotations

import sys


def warn(message: str) -> None:
    """A one-line warning on stderr (``megatrain: warning: ...``)."""
    sys.stderr.write(f"megatrain: warning: {message}\n")
    sys.stderr.flush()


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, cut to ``limit`` characters (transformers' errors
    can hold a 12 KB list of model types on one line)."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."
