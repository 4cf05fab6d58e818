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
    """
    if not every_row and _all_agree(rows, keys, value):
        # The usual answer, for a fraction of the cost of the groupbys (a group of one rank
        # agrees with itself, so no group of two or more can differ either).
        rows = rows[np.zeros(len(rows), dtype=bool)]
    else:
        rows = rows[rows.groupby(keys, observed=True)["rank"].transform("size") >= 2]
    if not len(rows):
        return rows.assign(**{c: pd.Series(dtype=object) for c in COLUMNS})
    sides = rows.groupby(keys + [value], observed=True, sort=False).agg(
        num_agree=("rank", "size"), reference_rank=("rank", "min")).reset_index()
    sides["num_ranks"] = sides.groupby(keys, observed=True)["num_agree"].transform("sum")
    top = sides.groupby(keys, observed=True)["num_agree"].transform("max")
    sides["tied"] = (sides["num_agree"] == top).groupby(
        [sides[k] for k in keys], observed=True).transform("sum") > 1
    best = sides[sides["num_agree"] == top].sort_values("reference_rank")
    best = best.drop_duplicates(keys).rename(columns={value: "reference"})
    out = rows.merge(best[keys + ["reference", "reference_rank", "num_agree", "num_ranks",
                                  "tied"]], on=keys)
    picked = out["tied"].astype(bool) & (out[value] == out["reference"])
    if picked.any():
        out = pd.concat([out[~picked], _against_another_side(out[picked], sides, keys, value)])
    differs = out[out[value] != out["reference"]]
    if not len(differs):
        return (out if every_row else differs).assign(
            reference_ranks=pd.Series(dtype=object), sides=pd.Series(dtype=object))
    differs = _with_texts(differs, rows, keys, value)
    if not every_row:
        return differs
    return pd.concat([out[out[value] == out["reference"]], differs])


def _all_agree(rows: pd.DataFrame, keys: list[str], value: str) -> bool:
    """Every group holds one value (a null counted as one): no rank differs from another."""
    return not rows.drop_duplicates(keys + [value]).duplicated(keys).any()


def _against_another_side(tied: pd.DataFrame, sides: pd.DataFrame, keys: list[str],
                          value: str) -> pd.DataFrame:
    """Rows holding the value the tie-break picked: set against the next side instead."""
    own = tied.drop(columns=["reference", "reference_rank", "num_agree"])
    others = sides.rename(columns={value: "reference"})[
        keys + ["reference", "reference_rank", "num_agree"]]
    paired = own.merge(others, on=keys)
    paired = paired[paired[value] != paired["reference"]]
    paired = paired.sort_values("reference_rank", kind="stable")
    return paired.drop_duplicates(keys + ["rank"])[list(tied.columns)]


def _with_texts(differs: pd.DataFrame, rows: pd.DataFrame, keys: list[str], value: str
                ) -> pd.DataFrame:
    """``reference_ranks`` and ``sides`` for the few groups that are reported."""
    reported = rows.merge(differs[keys].drop_duplicates(), on=keys)
    by_side = {k: sorted(int(r) for r in g["rank"]) for k, g in reported.groupby(
        keys + [value], observed=True, sort=False)}
    texts: dict[tuple, list[tuple[int, str]]] = {}
    for key, ranks in by_side.items():
        texts.setdefault(key[:-1], []).append((ranks[0], ranks_text(ranks)))
    group = differs[keys].itertuples(index=False, name=None)
    differs = differs.assign(
        reference_ranks=[ranks_text(by_side[(*g, ref)]) for g, ref in zip(
            group, differs["reference"], strict=True)])
    group = differs[keys].itertuples(index=False, name=None)
    differs["sides"] = [" | ".join(t for _, t in sorted(texts[g])) for g in group]
    return differs


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
