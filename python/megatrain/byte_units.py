"""``format_bytes``: the one way megatrain prints a byte count (tables, logs, error messages);
``parse_bytes``: the one way it reads one ("120GiB", "1.5TiB", "141GB", 128000000000)."""

from __future__ import annotations

import re
from typing import Any, Optional

MAX_BYTES = 2**63 - 1  # the largest byte count the C++ core (int64) takes
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def format_bytes(n: Optional[float], decimals: int = 2, largest: str = "GiB", smallest: str = "B",
                 none: str = "n/a") -> str:
    """A byte count in binary units: ``"1.50 GiB"``, ``"512 B"``.

    The unit is the largest of ``smallest`` .. ``largest`` (``"B"``, ``"KiB"``, ``"MiB"``, ``"GiB"``,
    ``"TiB"``) not above ``abs(n)`` (``smallest`` when none is); a count in bytes prints as an integer.

    Args:
        n: bytes (int or float), or None.
        decimals: digits after the point for KiB and larger.
        largest: the largest unit used (``"GiB"``: 3 TiB prints as ``"3072.00 GiB"``).
        smallest: the smallest unit used (``"MiB"``: 512 KiB prints as ``"0.50 MiB"``).
        none: the text for ``n is None``.

    Raises:
        ValueError: ``largest`` or ``smallest`` is not one of the units above, or ``smallest`` is
            larger than ``largest``.
    """
    names = [u for u, _ in _UNITS]
    if largest not in names or smallest not in names or names.index(smallest) < names.index(largest):
        raise ValueError(f"megatrain.format_bytes: largest={largest!r} and smallest={smallest!r} must be units of "
                         f"{names} with smallest <= largest")
    if n is None:
        return none
    n = float(n)
    for unit, scale in _UNITS[names.index(largest):]:
        if abs(n) >= scale or unit == smallest:
            return f"{int(n)} B" if unit == "B" else f"{n / scale:.{decimals}f} {unit}"
    raise AssertionError("unreachable: the loop ends at smallest")


def parse_bytes(value: Any, saturate: bool = False) -> int:
    """A byte count > 0 from an int, an integral float or a string with an optional unit.

    Units (case-insensitive): ``B``, ``KB``/``MB``/``GB``/``TB`` (powers of 1000),
    ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024); ``"1.5TiB"`` is 1649267441664 and
    ``"141GB"`` 141000000000. A fraction of a byte is refused (``"0.5"``), a fraction of a unit
    rounds down to whole bytes. At most ``MAX_BYTES`` (2**63 - 1: what the C++ core's byte counts hold).

    Args:
        value: the count (int, float or string).
        saturate: a count above ``MAX_BYTES`` (``1e30``, ``float("inf")``, the string ``"inf"``) reads as
            ``MAX_BYTES`` instead of being refused: for a limit, where that much means no limit beyond the machine's.

    Raises:
        ValueError: a bool, a number <= 0 or (unless ``saturate``) > ``MAX_BYTES``, a non-integral float, or a
            string that is not a size (the message names the value; callers put their own name in front).
    """
    if isinstance(value, bool):
        raise ValueError(f"not a number of bytes: {value!r}")
    if saturate and (value == float("inf") if isinstance(value, float) else
                     isinstance(value, str) and value.strip().lower() in ("inf", "infinity")):
        return MAX_BYTES
    n = _parse(value)
    if n is not None and n > MAX_BYTES and saturate:
        return MAX_BYTES
    if n is None or n > MAX_BYTES:
        raise ValueError(f"not a number of bytes > 0 and <= 2**63 - 1: {value!r}")
    return n


def _parse(value: Any):
    """``parse_bytes``'s reading of ``value`` (no upper bound), or None."""
    if isinstance(value, int) and value > 0:
        return value
    if isinstance(value, float) and value.is_integer() and value > 0:
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _BYTE_UNITS:
            n = float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
            if n >= 1 and (n.is_integer() or _BYTE_UNITS[m.group(2).lower()] > 1):  # no fraction of a byte
                return int(n)
    return None
