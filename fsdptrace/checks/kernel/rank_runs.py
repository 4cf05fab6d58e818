"""Rows held once per run of ranks, not once per rank: what the map step keeps for the reduce.

An across-ranks check compares, slot by slot (a step, micro-step and unit), a value each rank
holds, and neighbouring ranks nearly always hold the same one. A row per rank and slot made
the map step's summaries, and the reduce's temporaries, grow with ranks x slots: check 10 alone
kept 188 MiB at 10,240 ranks x 48 units x 24 micro-steps, and its comparison allocated several
times that, linear in the steps recorded. ``code`` keeps one row per run: consecutive ranks of
one unit set holding the same values in a slot, with the run's first and last rank and its
length. ``expand`` gives a row per rank back for the few slots a check must spell out.

Lossless: ``expand(code(rows))`` holds ``rows``' rows (whose ranks have a unit set) provided
every rank of a run's unit set between its first and last rank was in the coded rows' batch.
The map step's batches are contiguous ranges of the run's ranks (``analysis.map_step``), so it
is; ``expand`` checks each run's length against the ranks it finds.
"""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd

from fsdptrace.checks.kernel.columns import empty_frame, fold, text_storage
from fsdptrace.checks.kernel.order import unit_sets as unit_sets_of

RUN_COLUMNS = ["first_rank", "last_rank", "num_ranks"]
_RUN_DTYPES = {"first_rank": "int32", "last_rank": "int32", "num_ranks": "int32"}


def code(rows: pd.DataFrame, unit_sets: pd.DataFrame, keys: list[str], values: list[str]
         ) -> pd.DataFrame:
    """``rows`` (a ``rank`` column, at most one row per rank and ``keys``) as runs of ranks:
    ``unit_set``, ``keys``, ``values`` and ``RUN_COLUMNS``. A run breaks where the values
    change or a rank of the unit set has no row. Rows of ranks without a unit set (no units
    recorded) are dropped: no rank is compared with them."""
    columns = ["unit_set", *keys, *values]
    set_of, place_of, rank_at = _places(unit_sets)
    ranks = rows["rank"].to_numpy(dtype=np.int64)
    at = np.searchsorted(rank_at, ranks).clip(max=max(len(rank_at) - 1, 0))
    known = rank_at[at] == ranks if len(rank_at) else np.zeros(len(ranks), dtype=bool)
    if not known.all():
        rows, ranks, at = rows[known], ranks[known], at[known]
    if not len(rows):
        return pd.DataFrame({**{c: rows[c] for c in [*keys, *values]},
                             "unit_set": unit_sets["unit_set"].iloc[:0].reset_index(drop=True)}
                            )[columns].assign(
            **{c: pd.Series(dtype=d) for c, d in _RUN_DTYPES.items()})
    unit_set = set_of[at]
    # A rank's place among its unit set's ranks: a run's ranks are consecutive places.
    place = place_of[at]
    slot = fold([[value_codes(pd.Series(unit_set))], *([value_codes(rows[c])] for c in keys)])[0]
    order = np.lexsort([place, slot])
    slot, place = slot[order], place[order]
    held = fold([[value_codes(rows[c])[order]] for c in values])[0] if values else slot
    new_run = np.r_[True, (slot[1:] != slot[:-1]) | (held[1:] != held[:-1])
                    | (place[1:] != place[:-1] + 1)]
    starts = np.flatnonzero(new_run)
    ends = np.r_[starts[1:], len(order)] - 1
    picked, ranks = order[starts], ranks[order]
    return pd.DataFrame({"unit_set": unit_set[picked],
                         **{c: rows[c].array.take(picked) for c in [*keys, *values]},
                         "first_rank": ranks[starts].astype(np.int32),
                         "last_rank": ranks[ends].astype(np.int32),
                         "num_ranks": (ends - starts + 1).astype(np.int32)})


def no_runs(dtypes: dict[str, str], keys: list[str], values: list[str]) -> pd.DataFrame:
    """``code`` of no rows (``dtypes``: the rows' columns), as a check's summary of a rank
    without any: built once per shape and copied (building costs ~2 ms, a copy ~0.1)."""
    return _no_runs(tuple(dtypes.items()), tuple(keys), tuple(values), text_storage()).copy()


@functools.cache
def _no_runs(dtypes: tuple[tuple[str, str], ...], keys: tuple[str, ...],
             values: tuple[str, ...], storage: str) -> pd.DataFrame:
    return code(empty_frame(dict(dtypes)), unit_sets_of(pd.DataFrame()), list(keys), list(values))


def expand(runs: pd.DataFrame, unit_sets: pd.DataFrame) -> pd.DataFrame:
    """A row per rank of each run (``rank`` first, ``RUN_COLUMNS`` dropped), in the order of
    ``runs``; ``unit_sets`` names every rank's unit set, as in the runs' batches."""
    plain = runs.drop(columns=RUN_COLUMNS)
    if not len(runs):
        return plain.assign(rank=pd.Series(dtype="int64"))[["rank", *plain.columns]]
    rank, key, uniques, low, span = _rank_keys(unit_sets)
    of_run = pd.Index(uniques).get_indexer(runs["unit_set"]).astype(np.int64)
    first = of_run * span + (runs["first_rank"].to_numpy(dtype=np.int64) - low)
    last = of_run * span + (runs["last_rank"].to_numpy(dtype=np.int64) - low)
    begin = np.searchsorted(key, first, side="left")
    counts = np.searchsorted(key, last, side="right") - begin
    if (of_run < 0).any() or (counts != runs["num_ranks"].to_numpy()).any():
        raise ValueError("runs of ranks do not match the unit sets they were coded against "
                         "(a batch that was not a contiguous range of ranks)")
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    picked = rank[np.repeat(begin, counts) + offsets]
    out = plain.iloc[np.repeat(np.arange(len(runs)), counts)].reset_index(drop=True)
    out.insert(0, "rank", picked)
    return out


def join(runs: pd.DataFrame, unit_sets: pd.DataFrame) -> pd.DataFrame:
    """Runs coded batch by batch (concatenated, categories shared) as the fewest runs: two runs
    holding the same row join when no rank of their unit set lies between them in
    ``unit_sets``, which must name every rank between the batches' (contiguous ranges of
    ranks, as a piece of the map step's is, and the whole run at the reduce). A slot where
    every rank agrees is then one row, however many batches the ranks were read in."""
    if len(runs) < 2:
        return runs
    rank, key, uniques, low, span = _rank_keys(unit_sets)
    of_run = pd.Index(uniques).get_indexer(runs["unit_set"]).astype(np.int64)
    if (of_run < 0).any():
        raise ValueError("runs of ranks of a unit set the unit sets do not name")
    first = np.searchsorted(key, of_run * span + (runs["first_rank"].to_numpy(np.int64) - low))
    last = np.searchsorted(key, of_run * span + (runs["last_rank"].to_numpy(np.int64) - low))
    held = fold([[value_codes(runs[c])] for c in runs.columns if c not in RUN_COLUMNS])[0]
    order = np.lexsort([first, held])
    held, first, last = held[order], first[order], last[order]
    starts = np.flatnonzero(np.r_[True, (held[1:] != held[:-1]) | (first[1:] != last[:-1] + 1)])
    ends = np.r_[starts[1:], len(order)] - 1
    out = runs.iloc[order[starts]].reset_index(drop=True)
    return out.assign(first_rank=runs["first_rank"].to_numpy()[order[starts]],
                      last_rank=runs["last_rank"].to_numpy()[order[ends]],
                      num_ranks=np.add.reduceat(runs["num_ranks"].to_numpy()[order],
                                                starts)).astype(_RUN_DTYPES)


def is_runs(frame: pd.DataFrame) -> bool:
    """Whether ``frame`` holds runs of ranks (``code``'s output)."""
    return all(c in frame.columns for c in RUN_COLUMNS)


def disagreeing(runs: pd.DataFrame, keys: list[str], values: list[str]) -> pd.DataFrame:
    """The runs of the groups (``unit_set`` and ``keys``) whose ranks do not all hold the same
    value in one of ``values``: the only groups where a rank can differ from the majority.

    Whole groups are kept, so a group's majority and reference rank stay what they were; the
    groups where every rank agrees (nearly all of them) are never spelled out rank by rank.
    Worked on integer codes, one array at a time.
    """
    ids, distinct = pd.factorize(fold([[value_codes(runs[c])] for c in ["unit_set", *keys]])[0])
    split = np.zeros(len(distinct), dtype=bool)
    for value in values:
        codes = value_codes(runs[value])
        low = np.full(len(split), np.iinfo(np.int64).max)
        high = np.full(len(split), np.iinfo(np.int64).min)
        np.minimum.at(low, ids, codes)
        np.maximum.at(high, ids, codes)
        split |= low != high
    return runs[split[ids]]


def _rank_keys(unit_sets: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, pd.Index, int, int]:
    """The ranks of ``unit_sets`` sorted by unit set, then rank; a sorted int64 key for each
    (unit set's number x ``span`` + rank - ``low``), the unit sets in number order, ``low``
    and ``span``: where a (unit set, rank) pair lies is one ``searchsorted``."""
    sets = _sorted_sets(unit_sets)
    set_code, uniques = pd.factorize(sets["unit_set"], sort=False)
    rank = sets["rank"].to_numpy(dtype=np.int64)
    low = int(rank.min()) if len(rank) else 0
    span = int(rank.max()) - low + 1 if len(rank) else 1
    return rank, set_code.astype(np.int64) * span + (rank - low), pd.Index(uniques), low, span


def _sorted_sets(unit_sets: pd.DataFrame) -> pd.DataFrame:
    """``unit_sets`` (``order.unit_sets``) with int64 ranks, sorted by unit set, then rank."""
    sets = unit_sets.assign(rank=unit_sets["rank"].astype("int64"))
    return sets.sort_values(["unit_set", "rank"], kind="stable").reset_index(drop=True)


def _places(unit_sets: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """By rank, in rank order: each rank's unit set, its place among that set's ranks (ranks
    sorted), and the rank itself (one row per rank, as ``order.unit_sets`` gives them)."""
    rank = unit_sets["rank"].to_numpy(dtype=np.int64)
    unit_set = unit_sets["unit_set"].to_numpy()
    by_set = np.lexsort([rank, unit_set]) if len(rank) else np.zeros(0, dtype=np.intp)
    in_order = unit_set[by_set]
    first = np.r_[True, in_order[1:] != in_order[:-1]] if len(rank) else np.zeros(0, bool)
    index = np.arange(len(rank))
    place = np.empty(len(rank), dtype=np.int64)
    place[by_set] = index - np.maximum.accumulate(np.where(first, index, 0))
    by_rank = np.argsort(rank, kind="stable")
    return unit_set[by_rank], place[by_rank], rank[by_rank]


def value_codes(values: pd.Series) -> np.ndarray:
    """Equal values, equal integers (a categorical's codes, -1 for a null; signed integers
    and booleans as they are; factorized otherwise): comparable within one column only."""
    if isinstance(values.dtype, pd.CategoricalDtype):
        return values.cat.codes.to_numpy(dtype=np.int64)
    if values.dtype.kind in "ib":
        return values.to_numpy(dtype=np.int64)
    return pd.factorize(values, use_na_sentinel=True)[0].astype(np.int64)
