"""``fsdptrace.diff``: what changed in FSDP's structure between a run that worked and one that
doesn't (after a torch upgrade, a wrapping refactor, a config change).

Each rank is compared with its counterpart at one micro-step (the first every rank completed,
or the first in ``steps``); when the world sizes differ, each run's most common view stands
for it. Sections come most consequential first: units, orders, prefetch edges, settings,
findings, bytes all-gathered.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import pandas as pd

from fsdptrace.errors import UsageError
from fsdptrace.reading.trace import Trace, load
from fsdptrace.store.steps import parse_steps
from fsdptrace.views.diff_parts import (
    MicroStep,
    RankView,
    UnitRow,
    choose_micro_step,
    most_common,
    rank_view,
    renamed,
)


@dataclass(frozen=True)
class UnitChange:
    """A unit ``added``, ``removed``, ``likely renamed`` (to ``new_name``) or ``changed``."""

    change: str
    unit: str
    new_name: str | None = None
    detail: str = ""
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class OrderChange:
    """The first position where a phase's order differs (``None``: that run's order ended)."""

    phase: str
    position: int
    unit_a: str | None
    unit_b: str | None
    num_units_a: int
    num_units_b: int
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class EdgeChange:
    """A prefetch edge ``unit -> target`` in ``phase``, ``added`` or ``removed`` in run B."""

    change: str
    unit: str
    phase: str
    target: str
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class SettingChange:
    """A unit's setting with a different value in effect (JSON text, ``None`` if unset)."""

    unit: str
    setting: str
    value_a: str | None
    value_b: str | None
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class FindingChange:
    """Findings of one (check, unit, target) that ``appeared`` or ``disappeared`` in run B."""

    change: str
    check: str
    severity: str
    unit: str
    target: str
    count_a: int
    count_b: int


@dataclass(frozen=True)
class BytesChange:
    """Bytes all-gathered in one phase of the compared micro-step, per rank."""

    phase: str
    bytes_a: int
    bytes_b: int
    ranks: tuple[int, ...] = ()


SECTIONS = ("units", "orders", "prefetch", "settings", "findings", "allgather_bytes")


@dataclass(frozen=True)
class RunDiff:
    """Two runs compared; ``same`` when no section has a change.

    ``ranks`` of a change are run A's ranks showing it; empty when the world sizes differ and
    each run's most common view was compared (``paired_by_rank`` false).
    """

    run_a: str
    run_b: str
    world_size_a: int
    world_size_b: int
    micro_step_a: MicroStep
    micro_step_b: MicroStep
    paired_by_rank: bool
    ranks: tuple[int, ...]  # run A's ranks compared with their counterparts
    units: tuple[UnitChange, ...]
    orders: tuple[OrderChange, ...]
    prefetch: tuple[EdgeChange, ...]
    settings: tuple[SettingChange, ...]
    findings: tuple[FindingChange, ...]
    allgather_bytes: tuple[BytesChange, ...]

    @property
    def same(self) -> bool:
        return not any(getattr(self, name) for name in SECTIONS)

    def sections(self) -> dict[str, list[dict[str, Any]]]:
        """Each section as a list of plain records (for JSON)."""
        return {name: [dataclasses.asdict(r) for r in getattr(self, name)] for name in SECTIONS}


Pair = tuple[int | None, RankView, RankView]


def diff(run_a: str | os.PathLike[str] | Trace, run_b: str | os.PathLike[str] | Trace,
         *, steps: str | None = None) -> RunDiff:
    """Compare run B with run A (run dirs or loaded traces of the same model)."""
    from fsdptrace.analysis.run import analyze

    try:
        window = parse_steps(steps)
    except ValueError as error:
        raise UsageError(str(error)) from None
    a = run_a if isinstance(run_a, Trace) else load(run_a)
    b = run_b if isinstance(run_b, Trace) else load(run_b)
    at_a, at_b = choose_micro_step(a, window), choose_micro_step(b, window)
    views_a = {r: rank_view(a, r, at_a) for r in a.ranks}
    views_b = {r: rank_view(b, r, at_b) for r in b.ranks}
    by_rank = a.world_size == b.world_size and bool(set(views_a) & set(views_b))
    pairs: list[Pair]
    if by_rank:
        pairs = [(r, views_a[r], views_b[r]) for r in sorted(set(views_a) & set(views_b))]
    else:
        pairs = [(None, most_common(list(views_a.values())),
                  most_common(list(views_b.values())))]
    changes = _merged([(rank, _pair_changes(va, vb)) for rank, va, vb in pairs])
    return RunDiff(
        run_a=str(a.run_dir), run_b=str(b.run_dir),
        world_size_a=a.world_size, world_size_b=b.world_size,
        micro_step_a=at_a, micro_step_b=at_b, paired_by_rank=by_rank,
        ranks=tuple(r for r, _, _ in pairs if r is not None),
        units=tuple(changes["units"]), orders=tuple(changes["orders"]),
        prefetch=tuple(changes["prefetch"]), settings=tuple(changes["settings"]),
        findings=finding_changes(analyze(a).findings, analyze(b).findings),
        allgather_bytes=tuple(changes["allgather_bytes"]),
    )


def _pair_changes(a: RankView, b: RankView) -> dict[str, list[Any]]:
    """One rank against its counterpart; B's likely-renamed units take A's names first, so a
    rename is reported once, not again as changed orders, edges and settings."""
    units = _unit_changes(a, b)
    b = renamed(b, {c.new_name: c.unit for c in units if c.new_name is not None})
    # Settings of an added or removed unit are that unit's change, not one of their own.
    common = {u[0] for u in a.units} & {u[0] for u in b.units}
    return {"units": units, "orders": _order_changes(a, b), "prefetch": _edge_changes(a, b),
            "settings": _setting_changes(a, b, common), "allgather_bytes": _bytes_changes(a, b)}


def _merged(pairs: list[tuple[int | None, dict[str, list[Any]]]]) -> dict[str, list[Any]]:
    """One record per change and section, naming every rank that shows it, first seen first."""
    merged: dict[str, list[Any]] = {}
    for name in SECTIONS:
        ranks: dict[Any, list[int]] = {}
        for rank, changes in pairs:
            for change in changes.get(name, []):
                ranks.setdefault(change, []).extend([] if rank is None else [rank])
        merged[name] = [dataclasses.replace(c, ranks=tuple(r)) for c, r in ranks.items()]
    return merged


def _unit_changes(a: RankView, b: RankView) -> list[UnitChange]:
    names_a, names_b = {u[0]: u for u in a.units}, {u[0]: u for u in b.units}
    position_a = {u[0]: i for i, u in enumerate(a.units)}
    position_b = {u[0]: i for i, u in enumerate(b.units)}
    removed = [n for n in names_a if n not in names_b]
    added = [n for n in names_b if n not in names_a]
    changes: list[UnitChange] = []
    for name in removed:
        # Conservative: same place among the units and the same parameters under it.
        twin = next((n for n in added if position_b[n] == position_a[name]
                     and names_b[n][1:] == names_a[name][1:]), None)
        if twin is not None:
            added.remove(twin)
            changes.append(UnitChange("likely renamed", name, twin,
                                      f"same position {position_a[name]} and parameters"))
        else:
            changes.append(UnitChange("removed", name, detail=_describe(names_a[name])))
    changes += [UnitChange("added", n, detail=_describe(names_b[n])) for n in added]
    for name in names_a.keys() & names_b.keys():
        if names_a[name][1:] != names_b[name][1:]:
            changes.append(UnitChange("changed", name, detail=f"{_describe(names_a[name])} -> "
                                      f"{_describe(names_b[name])}"))
    return changes


def _describe(unit: UnitRow) -> str:
    return f"{unit[1]}, {unit[2]} parameters, {unit[3]} elements"


def _order_changes(a: RankView, b: RankView) -> list[OrderChange]:
    if a.orders is None or b.orders is None:
        return []
    orders_b = dict(b.orders)
    changes = []
    for phase, order_a in a.orders:
        order_b = orders_b.get(phase, ())
        if order_a == order_b:
            continue
        pairs = zip(order_a, order_b, strict=False)  # the shorter order ends the comparison
        position = next((i for i, (x, y) in enumerate(pairs) if x != y),
                        min(len(order_a), len(order_b)))
        changes.append(OrderChange(
            phase, position,
            order_a[position] if position < len(order_a) else None,
            order_b[position] if position < len(order_b) else None,
            len(order_a), len(order_b)))
    return changes


def _edge_changes(a: RankView, b: RankView) -> list[EdgeChange]:
    if a.edges is None or b.edges is None:
        return []
    return ([EdgeChange("removed", *e) for e in sorted(a.edges - b.edges)]
            + [EdgeChange("added", *e) for e in sorted(b.edges - a.edges)])


def _setting_changes(a: RankView, b: RankView, units: set[str]) -> list[SettingChange]:
    if a.settings is None or b.settings is None:
        return []
    values_a, values_b = dict(a.settings), dict(b.settings)
    return [SettingChange(unit, setting, values_a.get((unit, setting)),
                          values_b.get((unit, setting)))
            for unit, setting in sorted(values_a.keys() | values_b.keys())
            if unit in units and values_a.get((unit, setting)) != values_b.get((unit, setting))]


def _bytes_changes(a: RankView, b: RankView) -> list[BytesChange]:
    if a.gathered is None or b.gathered is None:
        return []
    bytes_b = dict(b.gathered)
    return [BytesChange(phase, num, bytes_b.get(phase, 0)) for phase, num in a.gathered
            if num != bytes_b.get(phase, 0)]


FINDING_KEY = ["check", "severity", "unit", "target"]


def _finding_counts(findings: pd.DataFrame) -> pd.Series:
    keys = findings[FINDING_KEY].astype("object").fillna("").astype(str)
    return keys.groupby(FINDING_KEY).size()


def finding_changes(findings_a: pd.DataFrame, findings_b: pd.DataFrame
                    ) -> tuple[FindingChange, ...]:
    """Findings by (check, unit, target), ignoring rank and step: those present in one run."""
    counts = pd.concat({"a": _finding_counts(findings_a), "b": _finding_counts(findings_b)},
                       axis=1).fillna(0).astype(int)
    counts = counts[(counts["a"] == 0) != (counts["b"] == 0)]
    changes = [
        FindingChange("appeared" if count_a == 0 else "disappeared", check=key[0],
                      severity=key[1], unit=key[2], target=key[3], count_a=int(count_a),
                      count_b=int(count_b))
        for key, count_a, count_b in zip(counts.index, counts["a"], counts["b"], strict=True)
    ]
    # Errors that appeared are what a CI gate is for; they come first.
    return tuple(sorted(changes, key=lambda c: (c.change != "appeared",
                                                _SEVERITY_RANK.get(c.severity, 9))))


_SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}
