"""Order primitives shared by the checks: positions, order signatures, first differences.

All vectorized: an order is never materialized as a Python list per group; it is a
``(rank, step, micro_step, phase, position, unit)`` frame, and comparing two orders is a merge.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from fsdptrace import schema
from fsdptrace.checks import keys

GROUP = ["rank", "step", "micro_step", "phase"]
_PHASE_RANK = {schema.FORWARD: 0, schema.BACKWARD: 1}


def with_positions(events: pd.DataFrame) -> pd.DataFrame:
    """Events sorted by rank and seq, with each one's ``position`` in its order."""
    rank, seq = events["rank"].to_numpy(), events["seq"].to_numpy()
    in_order = len(events) < 2 or bool(
        ((rank[1:] > rank[:-1]) | ((rank[1:] == rank[:-1]) & (seq[1:] > seq[:-1]))).all())
    ordered = events if in_order else events.sort_values(["rank", "seq"], kind="stable")
    (group,) = keys.row_keys([ordered], GROUP)
    return ordered.assign(position=_cumcount(group))


def _cumcount(group: np.ndarray) -> np.ndarray:
    """Per row, how many earlier rows share its group key (groupby().cumcount(), in numpy)."""
    order = np.argsort(group, kind="stable")
    grouped = group[order]
    index = np.arange(len(group), dtype=np.int64)
    starts = np.ones(len(group), dtype=bool)
    starts[1:] = grouped[1:] != grouped[:-1]
    within = index - np.maximum.accumulate(np.where(starts, index, 0))
    position = np.empty(len(group), dtype=np.int64)
    position[order] = within
    return position


def first_positions(positioned: pd.DataFrame) -> pd.DataFrame:
    """A unit's position in an order is its first: repeated calls keep their data only."""
    (key,) = keys.row_keys([positioned], GROUP + ["unit"])
    return positioned[~pd.Series(key).duplicated().to_numpy()]


def stalled_ranks(markers: pd.DataFrame, ranks: pd.Series | list[int]) -> set[int]:
    """Ranks whose recording did not end clean (``fsdptrace.endings``)."""
    from fsdptrace.endings import clean_ranks

    ranks = {int(r) for r in ranks}
    return ranks - clean_ranks(markers, ranks)


def drop_cut_off(events: pd.DataFrame, markers: pd.DataFrame) -> pd.DataFrame:
    """Drop each stalled rank's last micro-step: it was cut off, not run that way."""
    if not len(events):
        return events
    stalled = stalled_ranks(markers, events["rank"].unique())
    if not stalled:
        return events
    key = keys.step_key(events["step"], events["micro_step"])
    last = key.groupby(events["rank"]).transform("max")
    cut = events["rank"].isin(stalled) & (key == last)
    return events[~cut]


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


def progress_key(step: pd.Series, micro_step: pd.Series, phase: pd.Series,
                 position: pd.Series) -> pd.Series:
    """A sortable number for how far a rank got (step, micro-step, phase, position)."""
    phase_rank = phase.astype(object).map(_PHASE_RANK).fillna(0).astype("int64")
    return keys.progress_key(step, micro_step, phase_rank, position)
