"""Byte counts in the unit that fits them: one rule for every output.

"peak 0.00 MiB" says nothing about a small model, and "8,448 bytes" is hard to compare with
"2.10 MiB". Bytes below 1 KiB stay bytes; above, the largest binary unit that keeps the
number at 1 or more, with three significant digits.
"""

from __future__ import annotations

_UNITS = ("KiB", "MiB", "GiB", "TiB")


def human_bytes(num_bytes: object) -> str:
    """``512 bytes``, ``8.25 KiB``, ``2.10 MiB``, ``1.50 GiB``."""
    value = float(num_bytes)  # type: ignore[arg-type]
    if abs(value) < 1024:
        return f"{int(value):,} byte{'' if int(value) == 1 else 's'}"
    for unit in _UNITS:
        value /= 1024
        if abs(value) < 1024 or unit == _UNITS[-1]:
            digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
            return f"{value:,.{digits}f} {unit}"
    raise AssertionError("unreachable")
