"""Check 10's summary finds distinct keys without sorting every row (``_distinct``): held to
``np.unique`` on random slots, through both ways it takes (the bitmap and the sort).
Its comparison keeps only the groups where ranks disagree (``rank_runs.disagreeing``, on runs
of ranks): held to a pandas group-by, with narrow keys and keys too wide to multiply into one
int64.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptrace.checks import gradient_divergence as check10
from fsdptrace.checks.kernel import rank_runs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=200), st.integers(1, 8),
       st.booleans())
def test_distinct_keys_are_np_unique(keys: list[int], num_params: int, small: bool) -> None:
    keys_arr = np.array(keys, dtype=np.int64) * num_params
    size = int(keys_arr.max()) + 1 if small else check10._BITMAP_LIMIT + 1
    assert np.array_equal(check10._distinct(keys_arr, size), np.unique(keys_arr))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2), st.integers(0, 1),
                          st.sampled_from("ab"), st.sampled_from(["", "w", "w, b"]),
                          st.sampled_from(["", "w"])), min_size=1, max_size=40),
       st.lists(st.integers(0, 1), min_size=5, max_size=5), st.booleans())
def test_split_groups_are_the_groups_whose_ranks_disagree(
        rows: list[tuple], sets: list[int], wide: bool) -> None:
    slots = pd.DataFrame(rows, columns=["rank", "step", "micro_step", "unit", "reduced",
                                        "received"]).drop_duplicates(check10.SLOT)
    if wide:  # keys whose ranges multiplied do not fit one int64 (``fold`` compresses)
        slots["step"] += 2**31 - 4
        slots["micro_step"] += 2**31 - 4
    slots = slots.assign(told_unused=False).astype(check10._DTYPES)
    unit_sets = pd.DataFrame({"rank": range(5), "unit_set": sets})  # rank 5 has none
    merged = slots.merge(unit_sets, on="rank")
    lists = merged.groupby(["unit_set", "step", "micro_step", "unit"], observed=True)[
        ["reduced", "received"]].transform("nunique")
    expected = merged.loc[lists.max(axis=1) > 1, ["rank", "step", "micro_step", "unit"]]
    runs = rank_runs.code(slots, unit_sets, check10.SLOT[1:], check10._VALUES)
    split = rank_runs.expand(rank_runs.disagreeing(runs, check10.SLOT[1:], ["reduced", "received"]),
                             unit_sets)
    assert _sorted(split[["rank", "step", "micro_step", "unit"]]) == _sorted(expected)


def _sorted(frame: pd.DataFrame) -> list[tuple]:
    return sorted(frame.astype({"rank": "int64", "step": "int64", "micro_step": "int64",
                                "unit": str}).itertuples(index=False, name=None))
