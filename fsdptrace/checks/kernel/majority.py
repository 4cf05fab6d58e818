"""The majority of a cross-rank comparison, and what to say when there is none.

Every cross-rank check (4, 5, 10, 11, 12) and the hang verdict compare each rank with the most
common value among the ranks compared. With no strict majority (two ranks, or sides of equal
size) no side is the outlier: a rank's number says nothing about who is right, so every rank
is reported against another side and the message says that the ranks disagree. One function,
so every check draws that line the same way.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from fsdptrace.checks.kernel.columns import fold
from fsdptrace.checks.kernel.rank_runs import value_codes

# Added to each row returned by ``against_majority``.
COLUMNS = ["reference", "reference_rank", "num_agree", "num_ranks", "tied", "reference_ranks",
           "sides"]
NO_MAJORITY = "no majority"  # in every message of a tie: the verdict reads it back
_MAX_RUNS = 8  # rank runs spelled out in a message before the rest is counted


def against_majority(rows: pd.DataFrame, keys: list[str], value: str, *,
                     every_row: bool = False) -> pd.DataFrame:
    """Rows of groups (``keys``) of two or more ranks whose ``value`` is not the majority's.

    Each row keeps ``reference``: the majority's value, or with no strict majority (``tied``)
    the value of another side (the one holding the lowest rank outside the row's own side), so
    with a tie every rank is reported. ``reference_rank``: the lowest rank holding
    ``reference``; ``num_agree``: how many ranks hold it; ``num_ranks``: ranks compared;
    ``reference_ranks`` and ``sides``: those ranks, and every side's, as text for messages.
    ``every_row``: also return the rows that agree with the majority (reference = own value).
    A row with a null key is in no group; a null value is on no side and differs from all.

    Counted on integer codes with numpy, not pandas group-bys: in most analyses the groups are
    a few ranks each, where each group-by or merge costs a millisecond whatever its size.
    """
    sides = _Sides(rows, keys, value)
    if not len(sides.rows):
        return _none_differs(rows)
    at, against = sides.compared()
    out = sides.frame(at, against)
    agrees = sides.side[at] == against
    if agrees.all():
        if not every_row:
            return _none_differs(rows)
        return _with_columns(out, {"reference_ranks": pd.Series(dtype=object),
                                   "sides": pd.Series(dtype=object)})
    reference_ranks, group_sides = sides.texts(at[~agrees], against[~agrees])
    differs = _with_columns(out[~agrees], {"reference_ranks": reference_ranks,
                                           "sides": group_sides})
    return pd.concat([out[agrees], differs]) if every_row else differs


def _none_differs(rows: pd.DataFrame) -> pd.DataFrame:
    """No row, with the columns a row would have."""
    return _with_columns(rows.iloc[:0], {c: pd.Series(dtype=object) for c in COLUMNS})


def _with_columns(frame: pd.DataFrame, columns: dict[str, object]) -> pd.DataFrame:
    """``frame`` with ``columns`` added: one concat, where ``assign`` inserts them one by one
    (each insert rebuilds the column index, a millisecond apiece on a frame of a few rows)."""
    added = pd.DataFrame(columns, index=frame.index)
    return pd.concat([frame, added], axis=1)


class _Sides:
    """The groups of two or more rows of ``rows`` and their sides: each distinct value the
    group's ranks hold, with how many rows hold it and the lowest rank that does.

    ``rows`` keeps the rows compared; per row, ``group`` and ``side`` (-1 for a null value)
    number them; per side, ``first`` (its first row: sides are ordered as they first appear),
    ``count``, ``lowest``, ``side_group`` and ``is_top``; per group, ``tied``.
    """

    def __init__(self, rows: pd.DataFrame, keys: list[str], value: str) -> None:
        self.value = value
        group = _codes(rows, keys)
        sizes = np.bincount(group[group >= 0], minlength=1)
        compared = group >= 0
        compared[compared] = sizes[group[compared]] >= 2
        self.rows = rows[compared]
        self.group = pd.factorize(group[compared])[0].astype(np.int64)
        self.rank = self.rows["rank"].to_numpy()
        code = _codes(self.rows, [value])
        held = np.flatnonzero(code >= 0)
        pairs = self.group[held] * (int(code.max(initial=0)) + 1) + code[held]
        _, first, side, self.count = np.unique(pairs, return_index=True, return_inverse=True,
                                               return_counts=True)
        self.side = np.full(len(self.rows), -1)
        self.side[held] = side.reshape(-1)
        self.first = held[first]
        self.lowest = np.full(len(self.count), np.iinfo(np.int64).max)
        np.minimum.at(self.lowest, self.side[held], self.rank[held].astype(np.int64))
        self.side_group = self.group[self.first]
        self.num_groups = int(self.group.max(initial=-1)) + 1
        top = np.zeros(self.num_groups, dtype=np.int64)
        np.maximum.at(top, self.side_group, self.count)
        self.is_top = self.count == top[self.side_group]  # a side no other side outnumbers
        self.tied = np.bincount(self.side_group[self.is_top], minlength=self.num_groups) > 1

    def compared(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows of groups with a side, in ``rows``' order, and the side each is set
        against: the majority's, or with a tie, for the rows of the side picked, the one
        holding the lowest other rank (those rows come last, ordered by its lowest rank, one
        per group and rank)."""
        best = self._lowest_side(self.is_top)
        other = self._lowest_side(np.ones(len(self.count), dtype=bool), besides=best)
        with_best = best[self.group] >= 0
        picked = with_best & self.tied[self.group] & (self.side == best[self.group])
        plain = np.flatnonzero(with_best & ~picked)
        moved = np.flatnonzero(picked)
        moved = moved[_first_of_each(self.group[moved], self.rank[moved])]
        moved = moved[np.argsort(self.lowest[other[self.group[moved]]], kind="stable")]
        return (np.concatenate([plain, moved]),
                np.concatenate([best[self.group[plain]], other[self.group[moved]]]))

    def _lowest_side(self, allowed: np.ndarray, besides: np.ndarray | None = None
                     ) -> np.ndarray:
        """Per group, the ``allowed`` side (other than ``besides``'s) holding the lowest rank,
        the first to appear on a tie; -1 for a group with none."""
        candidates = np.flatnonzero(allowed)
        if besides is not None:
            candidates = candidates[candidates != besides[self.side_group[candidates]]]
        groups = self.side_group[candidates]
        candidates = candidates[np.lexsort((self.first[candidates], self.lowest[candidates],
                                            groups))]
        groups = self.side_group[candidates]
        lead = np.r_[True, groups[1:] != groups[:-1]][:len(groups)]
        chosen = np.full(self.num_groups, -1)
        chosen[groups[lead]] = candidates[lead]
        return chosen

    def frame(self, at: np.ndarray, against: np.ndarray) -> pd.DataFrame:
        """Rows ``at`` with the columns of the side each is set ``against``."""
        group = self.group[at]
        num_ranks = np.bincount(self.side_group, weights=self.count, minlength=self.num_groups)
        return _with_columns(self.rows.iloc[at].reset_index(drop=True), {
            "reference": self.rows[self.value].iloc[self.first[against]].reset_index(drop=True),
            "reference_rank": self.lowest[against].astype(self.rank.dtype),
            "num_agree": self.count[against].astype(np.int64),
            "num_ranks": num_ranks[group].astype(np.int64), "tied": self.tied[group]})

    def texts(self, at: np.ndarray, against: np.ndarray) -> tuple[list[str], list[str]]:
        """Per row ``at``: the ranks of the side it is set ``against``, and every side of its
        group, as text (for the few groups that are reported)."""
        reported = np.flatnonzero(np.isin(self.group, self.group[at]) & (self.side >= 0))
        reported = reported[np.lexsort((self.rank[reported], self.side[reported]))]
        by_side: dict[int, str] = {}
        by_group: dict[int, list[tuple[int, str]]] = {}
        for side, part in _runs(self.side[reported], self.rank[reported]):
            ranks = [int(r) for r in part]
            by_side[side] = ranks_text(ranks)
            by_group.setdefault(int(self.side_group[side]), []).append(
                (ranks[0], by_side[side]))
        sides = {g: " | ".join(t for _, t in sorted(texts)) for g, texts in by_group.items()}
        return ([by_side[int(s)] for s in against],
                [sides[int(g)] for g in self.group[at]])


def _codes(rows: pd.DataFrame, columns: list[str]) -> np.ndarray:
    """One integer per distinct combination of ``columns``' values, numbered from 0 in the
    order they first appear; -1 where one is null."""
    codes = [value_codes(rows[c]) for c in columns]
    (key,) = fold([[c] for c in codes])
    combined = pd.factorize(key)[0].astype(np.int64)
    for column, code in zip(columns, codes, strict=True):
        if rows[column].dtype.kind not in "ib":  # a signed integer's -1 is a value
            combined[code < 0] = -1
    return combined


def _first_of_each(group: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Positions, in order, of the first row of each (group, rank) pair."""
    if not len(group):
        return np.zeros(0, dtype=np.int64)
    pairs = np.stack([group, rank.astype(np.int64)])
    return np.sort(np.unique(pairs, axis=1, return_index=True)[1])


def _runs(keys: np.ndarray, values: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``values`` split where the sorted ``keys`` change: (key, its values) per run."""
    if not len(keys):
        return []
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    return [(int(keys[s]), part) for s, part in zip(starts, np.split(values, starts[1:]),
                                                     strict=True)]


def ranks_text(ranks: list[int]) -> str:
    """"rank 3", "ranks 0, 2", "ranks 0-7, 9": consecutive runs joined, long lists counted."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    values = np.array(ranks)
    starts = np.flatnonzero(np.r_[True, np.diff(values) != 1])
    ends = np.r_[starts[1:], len(values)] - 1
    runs = [str(values[a]) if a == b else f"{values[a]}-{values[b]}"
            for a, b in zip(starts, ends, strict=True)]
    text = ", ".join(runs[:_MAX_RUNS])
    if len(runs) > _MAX_RUNS:
        text += f", ... ({len(ranks)} ranks)"
    return "ranks " + text


def compared_with(rows: pd.DataFrame) -> pd.Series:
    """Who a reported rank is compared with, in words: "3 of 4 ranks (e.g. rank 0)", or with
    a tie "rank 1 (no majority: the 2 ranks disagree, rank 0 | rank 1)"."""
    if not len(rows):
        return pd.Series([], dtype=object)
    majority = (rows["num_agree"].astype(str) + " of " + rows["num_ranks"].astype(str)
                + " ranks (e.g. rank " + rows["reference_rank"].astype(str) + ")")
    tie = (rows["reference_ranks"].astype(str) + " (" + NO_MAJORITY + ": the "
           + rows["num_ranks"].astype(str) + " ranks disagree, " + rows["sides"].astype(str)
           + "; neither side is the outlier by its rank number)")
    return tie.where(rows["tied"].astype(bool), majority)
