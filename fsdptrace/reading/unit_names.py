"""Unit names a person can read: ``3 (Block)`` where the name alone is a position.

Units are named by their fully qualified name, and the children of an ``nn.Sequential`` are
named by index: ``3`` prefetching ``2`` reads as positions, which every order and prefetch
edge also prints. Where a name is only digits (dotted, with or without a ``part[i].`` prefix),
outputs add the module's type the recorder keeps in the ``units`` table. The name itself
stays the key everywhere (findings, JSON, suggested calls): only what a person reads changes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import pandas as pd

_ONLY_DIGITS = re.compile(r"(part\[\d+\]\.)?\d+(\.\d+)*")

Label = Callable[[object], str]


def is_positional(unit: str) -> bool:
    """Whether a unit's name is only an index (``3``, ``1.0``, ``part[1].2``)."""
    return _ONLY_DIGITS.fullmatch(unit) is not None


def module_types(units: pd.DataFrame) -> dict[str, str]:
    """``{unit: module type}`` for the units whose names are only digits."""
    if not len(units) or "module_type" not in units:
        return {}
    pairs = units[["unit", "module_type"]].dropna().astype(str).drop_duplicates("unit")
    return {u: t for u, t in zip(pairs["unit"], pairs["module_type"], strict=True)
            if is_positional(u)}


def labeller(types: dict[str, str]) -> Label:
    """``label(unit)``: ``"3 (Block)"`` for a positional name with a known type, else the name
    (``None``/NA as an empty string)."""

    def label(unit: object) -> str:
        if unit is None or unit is pd.NA or (isinstance(unit, float) and pd.isna(unit)):
            return ""
        name = str(unit)
        kind = types.get(name)
        return f"{name} ({kind})" if kind else name

    return label


def label_all(label: Label, units: Iterable[object]) -> list[str]:
    return [label(u) for u in units]
