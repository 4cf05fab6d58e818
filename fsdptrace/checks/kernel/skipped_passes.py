"""Passes some ranks ran and others went past without recording any of: a hang's cause.

A rank that leaves a backward out (it found its loss bad and went on to the next batch), or
runs one micro-step more or fewer in an optimizer step (uneven data under gradient
accumulation), issues FSDP collectives the other ranks do not: they pair with the wrong
partners, and the job hangs or aborts. No order differs (the skipped pass has no order on the
rank that skipped it), so check 4 sees nothing; what differs is which passes each rank ran.

A rank *reached* a pass when its last record (its stop point) is at or after the pass's first
place (``keys.place_key``), or when it ended cleanly: it runs no pass after that, so one the
others ran after its end is one it left out (a rank that stops training early, one whose data
ran out). It *ran* the pass when it recorded any of it: a complete order (the map step's
signatures) or its own stop inside it. A rank that reached a pass without running it skipped
it, unless its writer lost that micro-step or ``reset_iter_state()`` aborted it
(``reading.incomplete``: then nothing is known). Counted from the signatures' runs of ranks,
so nothing grows with ranks x passes; only a pass with a skip is spelled out rank by rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from fsdptrace.checks.kernel import stops
from fsdptrace.reading import incomplete

_KEYS = ["unit_set", "step", "micro_step", "phase"]
_EVERY_PASS = np.iinfo(np.int64).max  # the place a rank that ended cleanly reached


@dataclass(frozen=True)
class SkippedPass:
    """The first pass (by place) some ranks of one unit set ran and others skipped."""

    step: int
    micro_step: int
    phase: str
    ran: list[int]
    skipped: list[int]


def first_skipped(signatures: pd.DataFrame, unit_sets: pd.DataFrame, last: pd.DataFrame,
                  lost: pd.DataFrame, inside: pd.DataFrame, ended: set[int], until: int
                  ) -> SkippedPass | None:
    """The first pass beginning at or before place ``until`` that some rank skipped.

    ``signatures``: complete orders as runs of ranks (``Kept.signatures``); ``last``: every
    rank's last record (``stops.stop_points``); ``lost``: incomplete ranges; ``inside``: the
    ranks stopped inside a pass (``rank, step, micro_step, phase``), which ran it too;
    ``ended``: the ranks that ended cleanly, which reached every pass.
    """
    sets = unit_sets.assign(rank=unit_sets["rank"].astype("int64"))
    runs = _ran_runs(signatures, sets, inside)
    if not len(runs):
        return None
    runs = runs[runs["start"] <= until]
    reached = last.dropna(subset=["place"])[["rank", "place"]]
    rank = reached["rank"].astype("int64")
    reached = reached.assign(rank=rank, place=reached["place"].astype("int64").where(
        ~rank.isin(list(ended)), _EVERY_PASS)).merge(sets, on="rank")
    passes = runs.groupby(_KEYS, sort=False).agg(ran=("num_ranks", "sum"),
                                                 start=("start", "first")).reset_index()
    passes = passes.assign(reached=_count_reached(passes, reached)).sort_values("start")
    # A lost or aborted micro-step makes a rank look as if it skipped: each candidate is
    # spelled out, and the first with a rank that really skipped it is the answer.
    for candidate in passes[passes["reached"] > passes["ran"]].itertuples(index=False):
        found = _spelled_out(candidate, runs, reached, sets, lost)
        if found is not None:
            return found
    return None


def _ran_runs(signatures: pd.DataFrame, sets: pd.DataFrame, inside: pd.DataFrame
              ) -> pd.DataFrame:
    """Runs of ranks that ran each pass (``_KEYS``, ``first_rank``, ``last_rank``,
    ``num_ranks``) and the pass's first place, ``start``."""
    columns = [*_KEYS, "first_rank", "last_rank", "num_ranks"]
    parts = [signatures[columns]] if len(signatures) else []
    if len(inside):
        mine = inside.assign(rank=inside["rank"].astype("int64")).merge(sets, on="rank")
        parts.append(pd.DataFrame({
            "unit_set": mine["unit_set"], "step": mine["step"].astype("int64"),
            "micro_step": mine["micro_step"].astype("int64"), "phase": mine["phase"].astype(str),
            "first_rank": mine["rank"], "last_rank": mine["rank"], "num_ranks": 1}))
    if not parts:
        return pd.DataFrame(columns=[*columns, "start"])
    runs = pd.concat(parts, ignore_index=True)
    runs = runs.assign(phase=runs["phase"].astype(str), step=runs["step"].astype("int64"),
                       micro_step=runs["micro_step"].astype("int64"),
                       num_ranks=runs["num_ranks"].astype("int64"))
    return runs.assign(start=_place(runs, 0))


def _place(rows: pd.DataFrame, position: int) -> pd.Series:
    return stops.place(rows.assign(kind=stops.PASS, position=position))


def _count_reached(passes: pd.DataFrame, reached: pd.DataFrame) -> np.ndarray:
    """Per pass, the ranks of its unit set whose last record is at or after its start."""
    counts = np.zeros(len(passes), dtype=np.int64)
    for unit_set, places in reached.groupby("unit_set", sort=False)["place"]:
        mine = (passes["unit_set"] == unit_set).to_numpy()
        ordered = np.sort(places.to_numpy())
        counts[mine] = len(ordered) - np.searchsorted(ordered, passes["start"].to_numpy()[mine])
    return counts


def _spelled_out(candidate: Any, runs: pd.DataFrame, reached: pd.DataFrame,
                 sets: pd.DataFrame, lost: pd.DataFrame) -> SkippedPass | None:
    step, micro, phase = int(candidate.step), int(candidate.micro_step), str(candidate.phase)
    mine = reached[(reached["unit_set"] == candidate.unit_set)
                   & (reached["place"] >= candidate.start)]
    ranks = mine["rank"].to_numpy(dtype=np.int64)
    known = ~incomplete.in_micro_steps(lost, ("events",), ranks, np.full(len(ranks), step),
                                       np.full(len(ranks), micro))
    of_pass = runs[(runs["unit_set"] == candidate.unit_set) & (runs["step"] == step)
                   & (runs["micro_step"] == micro) & (runs["phase"] == phase)]
    # A run holds the unit set's ranks from its first to its last (``rank_runs``).
    all_ranks = np.sort(sets.loc[sets["unit_set"] == candidate.unit_set, "rank"]
                        .to_numpy(dtype=np.int64))
    ran = np.unique(np.concatenate([
        all_ranks[(all_ranks >= first) & (all_ranks <= last)]
        for first, last in zip(of_pass["first_rank"], of_pass["last_rank"], strict=True)]))
    skipped = np.setdiff1d(ranks[known], ran)
    if not len(skipped):
        return None
    return SkippedPass(step, micro, phase, ran.tolist(), skipped.tolist())
