"""``format_bytes``: the one way megatrain prints a byte count (tables, logs, error messages)."""

from __future__ import annotations

from typing import Optional

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
