"""How ``megatrain train`` words what it tells the user: one-line warnings and error texts."""

from __future__ import annotations

import sys


def warn(message: str) -> None:
    """A one-line warning on stderr (``megatrain: warning: ...``)."""
    sys.stderr.write(f"megatrain: warning: {message}\n")
    sys.stderr.flush()
