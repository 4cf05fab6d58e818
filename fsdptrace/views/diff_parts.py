"""What ``fsdptrace diff`` compares of one rank: its FSDP structure at one micro-step.

Each view is a small hashable value (units, per-phase order, prefetch edges, settings,
bytes all-gathered), so two runs compare rank by rank, or by their most common view when
their world sizes differ.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TypeVar

import pandas as pd

from fsdptrace.errors import RunDirError
from fsdptrace.reading import unsharded
from fsdptrace.reading.keys import step_key
from fsdptrace.reading.trace import Trace
from fsdptrace.store import schema
from fsdptrace.store.steps import StepWindow

MicroStep = tuple[int, int]
# (name, module_type, num_params, num_param_elements, parameter names relative to the unit)
UnitRow = tuple[str, str, int, int, tuple[str, ...]]
Edge = tuple[str, str, str]  # (unit, phase, target)
Orders = tuple[tuple[str, tuple[str, ...]], ...]  # (phase, units in order)
Settings = tuple[tuple[tuple[str, str], str], ...]  # ((unit, setting), JSON value)
# (phase, bytes all-gathered), then ("<phase> peak unsharded", bytes held at the pass's peak)
Gathered = tuple[tuple[str, int], ...]

V = TypeVar("V", bound=Hashable)


@dataclass(frozen=True)
class RankView:
    """One rank's structure; ``None`` where the rank recorded nothing at that micro-step."""

    units: tuple[UnitRow, ...]
    orders: Orders | None
    edges: frozenset[Edge] | None
    settings: Settings | None
    gathered: Gathered | None


def _relative(fqn: str, names: object) -> tuple[str, ...]:
    """Parameter names without the unit's own prefix, so a renamed unit keeps its signature."""
    prefix = f"{fqn}." if fqn else ""
    return tuple(n[len(prefix):] if prefix and n.startswith(prefix) else n
                 for n in list(names if names is not None else []))  # type: ignore[call-overload]


def unit_rows(units: pd.DataFrame) -> tuple[UnitRow, ...]:
    """A rank's units in registration order, deduplicated across model parts' snapshots."""
    rows = units.drop_duplicates(subset=["unit"])
    return tuple(
        (str(r.unit), str(r.module_type), int(r.num_params), int(r.num_param_elements),
         _relative(str(r.fqn), r.param_names))
        for r in rows.itertuples(index=False)
    )


def complete_micro_steps(markers: pd.DataFrame) -> set[MicroStep]:
    """Micro-steps a rank finished: another micro-step began after it, or the optimizer ran."""
    begun = markers[markers["kind"] == schema.MARKER_MICRO_STEP]
    starts = sorted({(int(s), int(m)) for s, m in zip(begun["step"], begun["micro_step"],
                                                      strict=True)})
    done = set(starts[:-1])
    stepped = markers[markers["kind"] == schema.MARKER_OPTIMIZER_STEP]
    done.update((int(s), int(m)) for s, m in zip(stepped["step"], stepped["micro_step"],
                                                 strict=True))
    return done & set(starts)


def choose_micro_step(trace: Trace, window: StepWindow) -> MicroStep:
    """The first micro-step in ``window`` every rank completed (else the first any rank did)."""
    per_rank = [{ms for ms in complete_micro_steps(trace.markers[trace.markers["rank"] == r])
                 if window.contains(ms[0])} for r in trace.ranks]
    per_rank = [s for s in per_rank if s]
    if not per_rank:
        within = f" within steps {window.spec}" if window.spec else ""
        raise RunDirError(f"{trace.run_dir} has no complete micro-step{within}: nothing to "
                          "compare (record at least one whole step, or pick other --steps)")
    on_all = set.intersection(*per_rank)
    return min(on_all) if on_all else min(set.union(*per_rank))


def _at(frame: pd.DataFrame, at: MicroStep) -> pd.DataFrame:
    return frame[(frame["step"] == at[0]) & (frame["micro_step"] == at[1])]


def _last_at_or_before(frame: pd.DataFrame, at: MicroStep) -> pd.DataFrame:
    return frame[step_key(frame["step"], frame["micro_step"]) <= step_key(*at)]


def _orders(events: pd.DataFrame, at: MicroStep) -> Orders | None:
    rows = _at(events, at).sort_values("seq")
    if not len(rows):
        return None
    return tuple((phase, tuple(str(u) for u in rows.loc[rows["phase"] == phase, "unit"]))
                 for phase in schema.PHASES)


def _edges(prefetch: pd.DataFrame, at: MicroStep) -> frozenset[Edge] | None:
    taken = _last_at_or_before(prefetch, at)
    if not len(taken):
        return None
    latest = taken[["step", "micro_step"]].apply(tuple, axis=1).max()
    snap = _at(taken, latest).dropna(subset=["target"])
    return frozenset((str(u), str(p), str(t))
                     for u, p, t in zip(snap["unit"], snap["phase"], snap["target"], strict=True))


def _settings(settings: pd.DataFrame, at: MicroStep) -> Settings | None:
    taken = _last_at_or_before(settings, at)
    if not len(taken):
        return None
    last = taken.sort_values(["step", "micro_step"]).groupby(["unit", "setting"], observed=True,
                                                            sort=True).tail(1)
    return tuple(((str(u), str(s)), "null" if pd.isna(v) else str(v))
                 for u, s, v in zip(last["unit"], last["setting"], last["value"], strict=True))


def _gathered(allgathers: pd.DataFrame, at: MicroStep) -> Gathered | None:
    rows = _at(allgathers, at)
    if not len(rows):
        return None
    issued = rows[rows["event"] == "issue"]
    sums = issued.groupby("phase", observed=True)["num_bytes"].sum()
    # The ledger replays the rank's whole history: a pass inherits what earlier ones held.
    peaks = _at(unsharded.peaks(allgathers), at).set_index("phase")["peak_bytes"]
    return (tuple((phase, int(sums.get(phase, 0))) for phase in schema.PHASES)
            + tuple((f"{phase} peak unsharded", int(peaks.get(phase, 0)))
                    for phase in schema.PHASES))


def _of_rank(frame: pd.DataFrame, rank: int) -> pd.DataFrame:
    return frame[frame["rank"] == rank] if "rank" in frame else frame


def rank_view(trace: Trace, rank: int, at: MicroStep) -> RankView:
    """The structure of ``rank`` at micro-step ``at``."""
    return RankView(
        units=unit_rows(_of_rank(trace.units, rank)),
        orders=_orders(_of_rank(trace.events, rank), at),
        edges=_edges(_of_rank(trace.prefetch, rank), at) if len(trace.prefetch) else None,
        settings=_settings(_of_rank(trace.settings, rank), at) if len(trace.settings) else None,
        gathered=(_gathered(_of_rank(trace.allgathers, rank), at)
                  if len(trace.allgathers) else None),
    )


def renamed(view: RankView, names: dict[str, str]) -> RankView:
    """``view`` with units renamed by ``names`` (new name -> old) wherever they appear."""
    if not names:
        return view

    def name(unit: str) -> str:
        return names.get(unit, unit)

    return dataclasses.replace(
        view,
        units=tuple((name(u[0]), *u[1:]) for u in view.units),
        orders=None if view.orders is None else tuple(
            (phase, tuple(name(u) for u in order)) for phase, order in view.orders),
        edges=None if view.edges is None else frozenset(
            (name(u), p, name(t)) for u, p, t in view.edges),
        settings=None if view.settings is None else tuple(
            ((name(u), s), v) for (u, s), v in view.settings),
    )


def most_common(values: list[V]) -> V:
    """The value most ranks share (the first such, on a tie): a run's typical rank."""
    return Counter(values).most_common(1)[0][0]
