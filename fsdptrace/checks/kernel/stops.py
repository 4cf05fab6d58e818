"""Where each rank stopped, exactly: the one definition of a stop point and of the cut-off pass.

docs/checks.md's *stop point* is the last thing a rank recorded: a unit's forward or backward
(step, micro_step, phase, unit, position, call), an eval forward (its eval interval, unit and
index in the interval), or a boundary ("after optimizer step N"). One ``seq`` counter numbers
a rank's events, eval forwards and markers, so the highest ``seq`` among them says which.
The cut-off pass is the pass holding a stop point of a rank whose ending is not clean (or its
stopped eval interval); the passes it completed before are checked like any other.

Stop points are ordered by ``place``: an optimizer step's passes, then its boundary, then
the eval interval after it, then the next step's passes (``keys.place_key``); an eval forward
a rank ran after passes of the next step (before its ``optimizer.step()``) comes after them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks.kernel.last_entered import last_positions
from fsdptrace.reading import keys
from fsdptrace.store import schema

if TYPE_CHECKING:
    # What these functions read of checks.tables.RankTables (which imports this module).
    from fsdptrace.checks.kernel.rank_view import RankView as RankTables

PASS = "pass"
EVAL = "eval"
BOUNDARY = "boundary"
COLUMNS = ["rank", "kind", "step", "micro_step", "phase", "unit", "position", "call", "place",
           "t_ns"]
_PHASE = {schema.FORWARD: 0, schema.BACKWARD: 1}
_AFTER_PASSES = 2  # a micro-step's slot after its backward, before the boundary's (keys.place_key)


def stop_points(tables: RankTables) -> pd.DataFrame:
    """Per rank with anything recorded: its last recorded place (``COLUMNS``).

    ``kind`` pass: ``step, micro_step, phase, unit, position`` (index in the pass) and
    ``call`` (1-based, of that unit in the pass). eval: ``step`` is the eval interval,
    ``position`` the index in it. boundary: ``step`` is the optimizer step just closed.
    """
    passes = _pass_stops(tables)
    candidates = [passes, _eval_stops(tables), _boundary_stops(tables)]
    found = pd.concat([c for c in candidates if len(c)], ignore_index=True) if any(
        len(c) for c in candidates) else pd.DataFrame(columns=[*COLUMNS, "seq"])
    if not len(found):
        return found[COLUMNS]
    found = found.sort_values(["rank", "seq"]).drop_duplicates("rank", keep="last")
    found["place"] = place(found)
    _place_evals_inside_steps(found, passes)
    return found[COLUMNS].reset_index(drop=True)


def _place_evals_inside_steps(found: pd.DataFrame, passes: pd.DataFrame) -> None:
    """Eval interval k follows boundary k - 1, so its place comes before step k's passes; but a
    rank that ran passes of step k and then an eval forward (an eval before
    ``optimizer.step()``) stopped after those passes: its place is after its last pass (after
    its micro-step's backward, before the next micro-step and the boundary), so a divergence in
    those passes counts as before the stop (docs/checks.md 6.1)."""
    evals = found[found["kind"] == EVAL]
    if not len(evals) or not len(passes):
        return
    last_pass = passes.drop_duplicates("rank", keep="last").set_index("rank")
    rank = evals["rank"].astype("int64")
    inside = rank.isin(last_pass.index).to_numpy().copy()
    inside[inside] = (last_pass.loc[rank[inside], "step"].astype("int64").to_numpy()
                      == evals["step"].astype("int64").to_numpy()[inside])
    if not inside.any():
        return
    after = evals[inside]
    micro = last_pass.loc[after["rank"].astype("int64"), "micro_step"].astype("int64")
    found.loc[after.index, "place"] = keys.place_key(
        np.full(len(after), PASS, dtype=object), after["step"].astype("int64").to_numpy(),
        micro.to_numpy(), np.full(len(after), _AFTER_PASSES),
        after["position"].astype("int64").to_numpy())


def place(rows: pd.DataFrame) -> pd.Series:
    """``keys.place_key`` of stop points (or of findings located by kind, step, micro_step,
    phase and position)."""
    kind = rows["kind"].astype(object)
    phase = rows["phase"].astype(object).map(_PHASE).fillna(0).astype("int64")
    return pd.Series(keys.place_key(
        kind.to_numpy(), rows["step"].fillna(0).astype("int64").to_numpy(),
        rows["micro_step"].fillna(0).astype("int64").to_numpy(), phase.to_numpy(),
        rows["position"].fillna(0).astype("int64").to_numpy()), index=rows.index)


def _pass_stops(tables: RankTables) -> pd.DataFrame:
    last = last_positions(tables.events)
    if not len(last):
        return pd.DataFrame(columns=[*COLUMNS, "seq"])
    return last.assign(kind=PASS)


def _eval_stops(tables: RankTables) -> pd.DataFrame:
    if not tables.sizes.get("eval_forwards"):
        return pd.DataFrame(columns=[*COLUMNS, "seq"])
    evals = tables.frame("eval_forwards").sort_values(["rank", "seq"])
    rank = evals["rank"].astype("int64")
    index = evals.groupby([rank, evals["step"].astype("int64")]).cumcount()
    last = evals.assign(rank=rank, position=index).drop_duplicates("rank", keep="last")
    return pd.DataFrame({"rank": last["rank"], "kind": EVAL,
                         "step": last["step"].astype("int64"), "micro_step": None,
                         "phase": None, "unit": last["unit"].astype(str),
                         "position": last["position"].astype("int64"), "call": None,
                         "t_ns": last["t_ns"], "seq": last["seq"]})


def _boundary_stops(tables: RankTables) -> pd.DataFrame:
    markers = tables.frame("markers")
    if not len(markers) or "kind" not in markers:
        return pd.DataFrame(columns=[*COLUMNS, "seq"])
    steps = markers[(markers["kind"] == schema.MARKER_OPTIMIZER_STEP).to_numpy()]
    rank = steps["rank"].to_numpy(dtype=np.int64)
    order = np.lexsort((steps["seq"].to_numpy(), rank))  # stable, as a sort by rank, seq
    rank = rank[order]
    is_last = np.r_[rank[1:] != rank[:-1], True] if len(rank) else np.zeros(0, dtype=bool)
    last = steps.iloc[order[is_last]]  # each rank's last
    return pd.DataFrame({"rank": last["rank"].astype("int64"), "kind": BOUNDARY,
                         "step": last["step"].astype("int64"), "micro_step": None,
                         "phase": None, "unit": None, "position": None, "call": None,
                         "t_ns": last["t_ns"], "seq": last["seq"]})


def stopped(stops: pd.DataFrame, clean: set[int]) -> pd.DataFrame:
    """The stop points of ranks whose ending is not clean."""
    return stops[~stops["rank"].isin(list(clean))]


def cut_off_passes(tables: RankTables) -> pd.DataFrame:
    """``rank, step, micro_step, phase`` of each cut-off pass a stop point holds."""
    stops = stopped(tables.stops, tables.closed)
    stops = stops[stops["kind"] == PASS]
    return pd.DataFrame({"rank": stops["rank"].astype("int64"),
                         "step": stops["step"].astype("int64"),
                         "micro_step": stops["micro_step"].astype("int64"),
                         "phase": stops["phase"].astype(str)}).reset_index(drop=True)


def cut_off_intervals(tables: RankTables) -> pd.DataFrame:
    """``rank, step`` of each eval interval a stop point holds (``step``: the interval): the
    one it stopped in, or the one it was about to begin when it stopped at a boundary."""
    stops = stopped(tables.stops, tables.closed)
    stops = stops[stops["kind"].isin([EVAL, BOUNDARY])]
    interval = stops["step"].astype("int64") + (stops["kind"] == BOUNDARY).astype("int64")
    return pd.DataFrame({"rank": stops["rank"].astype("int64"),
                         "step": interval}).reset_index(drop=True)


def describe(stops: pd.DataFrame) -> pd.Series:
    """Each stop point in words, for messages."""
    step = stops["step"].astype("Int64").astype(str)
    at_pass = ("step " + step + ", micro-step " + stops["micro_step"].astype("Int64").astype(str)
               + ", " + stops["phase"].astype(str) + ", last unit entered "
               + stops["unit"].astype(str)
               + " (position " + stops["position"].astype("Int64").astype(str) + ", call "
               + stops["call"].astype("Int64").astype(str) + ")")
    at_eval = ("eval forward " + stops["position"].astype("Int64").astype(str) + " of eval "
               + "interval " + step + " (after optimizer step "
               + (stops["step"].astype("Int64") - 1).astype(str) + "), "
               + stops["unit"].astype(str))
    at_boundary = "the boundary after optimizer step " + step
    kind = stops["kind"].astype(object)
    text = at_pass.where(kind == PASS, at_eval.where(kind == EVAL, at_boundary))
    return text.where(kind.notna(), "before its first recorded unit")

