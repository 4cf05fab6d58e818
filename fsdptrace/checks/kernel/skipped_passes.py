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
from fsdptrace.reading import incomplete, keys
from fsdptrace.store import schema

_KEYS = ["unit_set", "step", "micro_step", "phase"]
_EVERY_PASS = np.iinfo(np.int64).max  # the place a rank that ended cleanly reached


@dataclass(frozen=True)
class SkippedPass:
    """The first pass (by place) some ranks of one unit set ran and others skipped."""

    step: int
    micro_step: int
    phase: str
    place: int  # the pass's first place (``keys.place_key``, position 0)
    ran: list[int]
    skipped: list[int]


def first_skipped(signatures: pd.DataFrame, unit_sets: pd.DataFrame, last: pd.DataFrame,
                  lost: pd.DataFrame, inside: pd.DataFrame, ended: set[int], until: int
                  ) -> SkippedPass | None:
    """The first pass beginning at or before place ``until`` that some rank skipped.

    ``signatures``: complete orders as runs of ranks (``Kept.signatures``); ``last``: every
    rank's last record (``stops.stop_points``); ``lost``: incomplete ranges; ``inside``: the
    ranks stopped inside a pass (``rank, step, micro_step, phase``), which ran it too;
    ``ended``: the ranks that ended cleanly, which reached every pass. Counted in numpy per
    unit set: a verdict pays ~1 ms for it where nothing was skipped.
    """
    set_of = dict(zip(unit_sets["rank"].astype("int64").tolist(), unit_sets["unit_set"],
                      strict=True))
    runs = _ran_runs(signatures, set_of, inside)
    runs = runs[runs["start"].to_numpy() <= until]
    if not len(runs):
        return None
    known = last[last["place"].notna().to_numpy()]
    rank = known["rank"].to_numpy(dtype=np.int64)
    place = np.where(np.isin(rank, list(ended)), _EVERY_PASS,
                     known["place"].to_numpy(dtype=np.int64))
    reached = pd.DataFrame({"rank": rank, "place": place,
                            "unit_set": [set_of.get(r) for r in rank.tolist()]})
    candidates = []
    for unit_set, mine in runs.groupby("unit_set", sort=False):
        starts, first = np.unique(mine["start"].to_numpy(), return_index=True)
        ran = np.bincount(np.searchsorted(starts, mine["start"].to_numpy()),
                          weights=mine["num_ranks"].to_numpy(), minlength=len(starts))
        ordered = np.sort(reached["place"].to_numpy()[(reached["unit_set"] == unit_set)
                                                       .to_numpy()])
        count = len(ordered) - np.searchsorted(ordered, starts)
        if (count > ran).any():
            candidates.append(mine.iloc[first[count > ran]])
    if not candidates:
        return None
    # A lost or aborted micro-step makes a rank look as if it skipped: each candidate is
    # spelled out, and the first with a rank that really skipped it is the answer.
    sets = unit_sets.assign(rank=unit_sets["rank"].astype("int64"))
    for candidate in pd.concat(candidates).sort_values("start").itertuples(index=False):
        found = _spelled_out(candidate, runs, reached, sets, lost)
        if found is not None:
            return found
    return None


def _ran_runs(signatures: pd.DataFrame, set_of: dict[int, object], inside: pd.DataFrame
              ) -> pd.DataFrame:
    """Runs of ranks that ran each pass (``_KEYS``, ``first_rank``, ``last_rank``,
    ``num_ranks``) and the pass's first place, ``start``: the signatures' runs, and a run of
    one rank for each rank stopped inside a pass (of ranks with a unit set)."""
    names = [*_KEYS, "first_rank", "last_rank", "num_ranks"]
    columns = {c: (signatures[c].to_numpy() if len(signatures) else np.zeros(0, dtype=object))
               for c in names}
    columns["phase"] = columns["phase"].astype(str)
    mine = inside[inside["rank"].astype("int64").isin(list(set_of)).to_numpy()]
    if len(mine):
        rank = mine["rank"].to_numpy(dtype=np.int64)
        more = {"unit_set": np.array([set_of[r] for r in rank.tolist()]),
                "step": mine["step"].to_numpy(), "micro_step": mine["micro_step"].to_numpy(),
                "phase": mine["phase"].astype(str).to_numpy(), "first_rank": rank,
                "last_rank": rank, "num_ranks": np.ones(len(rank), dtype=np.int64)}
        columns = {c: np.concatenate([columns[c].astype(object) if c == "unit_set"
                                      else columns[c], more[c]]) for c in columns}
    for c in ("step", "micro_step", "first_rank", "last_rank", "num_ranks"):
        columns[c] = columns[c].astype(np.int64)
    columns["start"] = keys.place_key(
        np.full(len(columns["step"]), stops.PASS, dtype=object), columns["step"],
        columns["micro_step"], (columns["phase"] == schema.BACKWARD).astype(np.int64),
        np.zeros(len(columns["step"]), dtype=np.int64))
    return pd.DataFrame(columns)


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
    return SkippedPass(step, micro, phase, int(candidate.start), ran.tolist(), skipped.tolist())
