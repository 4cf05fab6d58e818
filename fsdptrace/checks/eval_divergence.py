"""Check 11, eval-divergence: ranks ran different eval forwards between the same boundaries.

Every eval forward (validation, generation) all-gathers, so ranks that run different numbers of
eval batches, or their units in another order, pair up the wrong collectives and hang. Reads
``eval_forwards``; an eval interval ``k`` lies between optimizer boundaries ``k-1`` and ``k``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import ACROSS_RANKS, Check, Merged
from fsdptrace.checks.kernel.columns import distinct_ranks
from fsdptrace.checks.kernel.majority import against_majority, compared_with
from fsdptrace.checks.kernel.order import first_difference_of
from fsdptrace.checks.kernel.stops import cut_off_intervals
from fsdptrace.reading import incomplete, keys

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables

NAME = "eval-divergence"
SEVERITY = findings.ERROR
_SEP = "\x1f"  # between unit names in an interval's text (never in a name)
_SUMMARY = ["rank", "step", "interval"]


def summarize(tables: RankTables) -> pd.DataFrame:
    """Per rank and eval interval it reached: its eval forwards' units, in order, as one text.

    An interval the rank reached without eval forwards is kept as an empty text: against a
    rank that validated there, that is the difference.
    """
    reached = _intervals_reached(tables)
    cut = cut_off_intervals(tables)
    if not tables.sizes["eval_forwards"]:
        return _recorded(_outside(pd.DataFrame({"rank": reached[0], "step": reached[1],
                                                "interval": ""}), cut), tables)
    evals = tables.frame("eval_forwards").sort_values(["rank", "seq"])
    texts = evals.assign(unit=evals["unit"].astype(str)).groupby(
        [evals["rank"].astype("int64"), evals["step"].astype("int64")],
        sort=True)["unit"].agg(_SEP.join).rename("interval").reset_index()
    grid = pd.DataFrame({"rank": reached[0], "step": reached[1]})
    out = grid.merge(texts, on=["rank", "step"], how="outer")
    out["interval"] = out["interval"].fillna("")
    return _recorded(_outside(out[_SUMMARY], cut), tables)


def _outside(intervals: pd.DataFrame, cut: pd.DataFrame) -> pd.DataFrame:
    """Intervals but those a rank stopped in (cut off: the rest was never recorded)."""
    if not len(cut) or not len(intervals):
        return intervals
    return intervals[~keys.isin(intervals, cut, ["rank", "step"])].reset_index(drop=True)


def _recorded(intervals: pd.DataFrame, tables: RankTables) -> pd.DataFrame:
    """Intervals but those whose eval forwards were lost (a recording that stopped in them)."""
    if not len(tables.incomplete) or not len(intervals):
        return intervals
    lost = incomplete.in_steps(tables.incomplete, ("eval_forwards",),
                               intervals["rank"].to_numpy(), intervals["step"].to_numpy())
    return intervals[~lost].reset_index(drop=True)


def _intervals_reached(tables: RankTables) -> tuple[np.ndarray, np.ndarray]:
    """(rank, interval) pairs a rank reached: from its first recorded optimizer step to the
    interval after the last boundary it snapshotted (interval ``k`` spans training step ``k``).

    From minima and maxima only: this runs on every rank of every run, eval or not.
    """
    events, grads = tables.events, tables.gradients
    ranks, steps = [], []
    known = [events["rank"], *([grads["rank"]] if len(grads) else [])]
    for rank in distinct_ranks(np.concatenate(known)):
        mine = events["step"][events["rank"] == rank] if len(events) else events["step"]
        done = grads["step"][grads["rank"] == rank] + 1 if len(grads) else mine[:0]
        both = [a for a in (mine, done) if len(a)]
        low = min(int(a.min()) for a in both)
        high = max(int(a.max()) for a in both)
        ranks.append(np.full(high - low + 1, rank, dtype=np.int64))
        steps.append(np.arange(low, high + 1, dtype=np.int64))
    if not ranks:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(ranks), np.concatenate(steps)


def check(merged: Merged) -> pd.DataFrame:
    """Ranks outside the most common eval interval, per interval and set of units."""
    return compare(merged.summaries.get(NAME, pd.DataFrame(columns=_SUMMARY)), merged.unit_sets)


def compare(intervals: pd.DataFrame, unit_sets: pd.DataFrame) -> pd.DataFrame:
    """``intervals``: every rank's ``summarize``; ``unit_sets``: ``order.unit_sets``."""
    if not len(intervals) or not len(unit_sets):
        return findings.empty()
    group = ["unit_set", "step"]
    rows = intervals.merge(unit_sets.assign(rank=unit_sets["rank"].astype("int64")), on="rank")
    if not rows["interval"].str.len().any():
        return findings.empty()
    differs = against_majority(rows, group, "interval")
    if not len(differs):
        return findings.empty()
    return _report(differs.sort_values(["step", "rank"]).reset_index(drop=True))


def _units(text: str) -> list[str]:
    return text.split(_SEP) if text else []


def _counts(units: list[str]) -> str:
    counts = Counter(units)
    return ", ".join(f"{u} x{n}" for u, n in counts.items()) if counts else "none"


def _report(rows: pd.DataFrame) -> pd.DataFrame:
    mine = [_units(t) for t in rows["interval"]]
    theirs = [_units(t) for t in rows["reference"]]
    first = [first_difference_of(a, b) for a, b in zip(mine, theirs, strict=True)]
    located = rows.assign(position=[f[0] for f in first], unit=[f[1] for f in first],
                          target=[f[2] for f in first])
    step = rows["step"].astype("int64")
    between = ("between optimizer steps " + (step - 1).astype(str) + " and "
               + step.astype(str)).where(step > 0, "before the first optimizer step")
    message = ("rank " + rows["rank"].astype(str) + " ran " + pd.Series(
        [str(len(m)) for m in mine], index=rows.index) + " eval forwards in eval interval "
        + step.astype(str) + " (" + between + "): " + pd.Series(
            [_counts(m) for m in mine], index=rows.index) + "; " + compared_with(rows)
        + " ran " + pd.Series(
            [str(len(t)) for t in theirs], index=rows.index) + ": " + pd.Series(
            [_counts(t) for t in theirs], index=rows.index) + "; they first differ at eval "
        + "forward " + located["position"].astype(str) + " (" + located["unit"] + " against "
        + located["target"] + "): each eval forward all-gathers, so ranks that run different "
        + "numbers of validation or generation batches pair up the wrong collectives and "
        + "hang; run the same eval batches on every rank (shard the eval set evenly, pad it, "
        + "or drop the remainder)")
    return findings.make(NAME, SEVERITY, located, message)


CHECK = Check(11, NAME, SEVERITY, ACROSS_RANKS,
              "ranks ran different eval forwards between the same optimizer steps", check,
              summarize=summarize)
