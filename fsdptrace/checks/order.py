"""Order primitives the across-ranks checks share on pandas frames: first differences,
majorities, unit sets, how far a rank got.

An order is never materialized as a Python list per group; it is a
``(rank, step, micro_step, phase, position, unit)`` frame, and comparing two orders is a merge.
Positions themselves are computed on code columns (``checks.positions``).
"""

from __future__ import annotations

import pandas as pd

from fsdptrace import schema
from fsdptrace.checks import keys

GROUP = ["rank", "step", "micro_step", "phase"]
_PHASE_RANK = {schema.FORWARD: 0, schema.BACKWARD: 1}


def first_difference(left: pd.DataFrame, right: pd.DataFrame, on: list[str]) -> pd.DataFrame:
    """For each pair of orders keyed by ``on``, the first index where they differ.

    ``left``/``right`` hold ``on + [position, unit]``. Returns ``on + [index, left_unit,
    right_unit]``; a side that ended early shows ``<end>``.
    """
    merged = left[on + ["position", "unit"]].merge(
        right[on + ["position", "unit"]], on=on + ["position"], how="outer",
        suffixes=("_left", "_right"),
    )
    lu = merged["unit_left"].astype(object)
    ru = merged["unit_right"].astype(object)
    differs = lu.isna() | ru.isna() | (lu != ru)
    diff = merged[differs].sort_values(on + ["position"])
    first = diff.drop_duplicates(on, keep="first")
    return pd.DataFrame({
        **{c: first[c].to_numpy() for c in on},
        "index": first["position"].to_numpy(),
        "left_unit": first["unit_left"].astype(object).fillna("<end>").to_numpy(),
        "right_unit": first["unit_right"].astype(object).fillna("<end>").to_numpy(),
    })


def unit_sets(units: pd.DataFrame) -> pd.DataFrame:
    """Per rank, a hash of the set of unit names: ranks of different stages never compare."""
    if not len(units):
        return pd.DataFrame(columns=["rank", "unit_set"])
    distinct = units[["rank", "unit"]].drop_duplicates()
    hashed = pd.util.hash_array(distinct["unit"].astype(str).to_numpy())
    sets = pd.Series(hashed, index=distinct.index).groupby(distinct["rank"]).sum()
    return sets.rename("unit_set").reset_index()


def majority(groups: pd.DataFrame, keys: list[str], value: str) -> pd.DataFrame:
    """Per group, the most common ``value``; ties go to the value held by the lowest rank.

    Returns ``keys + [value, "reference_rank", "num_agree"]``.
    """
    counts = groups.groupby(keys + [value], observed=True, sort=False).agg(
        num_agree=("rank", "size"), reference_rank=("rank", "min")
    ).reset_index()
    counts = counts.sort_values(keys + ["num_agree", "reference_rank"],
                                ascending=[True] * len(keys) + [False, True])
    return counts.drop_duplicates(keys, keep="first")


def outside_majority(rows: pd.DataFrame, keys: list[str], value: str) -> pd.DataFrame:
    """Rows of groups that two or more ranks share whose ``value`` differs from the group's
    most common one (``majority``), which each keeps as ``reference``: the divergence checks'
    comparison."""
    rows = rows[rows.groupby(keys)["rank"].transform("size") >= 2]
    if not len(rows):
        return rows.assign(reference=pd.Series(dtype=object))
    best = majority(rows, keys, value).rename(columns={value: "reference"})
    rows = rows.merge(best, on=keys)
    return rows[rows[value] != rows["reference"]]


def progress_key(step: pd.Series, micro_step: pd.Series, phase: pd.Series,
                 position: pd.Series) -> pd.Series:
    """A sortable number for how far a rank got (step, micro-step, phase, position)."""
    phase_rank = phase.astype(object).map(_PHASE_RANK).fillna(0).astype("int64")
    return keys.progress_key(step, micro_step, phase_rank, position)
