"""Group numbers on one folded key (``reading.keys.group_ids``, ``first_rows``), held to the
pandas group-by they replace in the memory ledger and check 10: ``ngroup(sort=False)`` on
integer and categorical columns (unused categories, runs of equal rows and scattered ones,
values too wide to multiply into one int64), and each group's first row to ``np.unique``."""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptrace.reading.keys import first_rows, group_ids

_ROW = st.tuples(st.integers(0, 3), st.sampled_from(["a", "b", "c"]), st.integers(-2, 2))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_ROW, st.integers(1, 3)), max_size=40), st.booleans())
def test_group_ids_are_pandas_ngroup_in_order_of_appearance(
        runs: list[tuple[tuple, int]], wide: bool) -> None:
    rows = [row for row, repeat in runs for _ in range(repeat)]  # runs of equal rows
    frame = pd.DataFrame(rows, columns=["rank", "unit", "step"]).astype({"rank": "int32"})
    frame["unit"] = frame["unit"].astype(pd.CategoricalDtype(["z", "c", "b", "a"]))
    if wide:
        frame["step"] = frame["step"].astype("int64") * (2**40)
        frame["big"] = frame["step"] * 7
    on = ["rank", "unit", "step", *(["big"] if wide else [])]
    expected = frame.groupby(on, sort=False, observed=True).ngroup().to_numpy()
    ids = group_ids(frame, on)
    assert np.array_equal(ids, expected)
    assert np.array_equal(first_rows(ids), np.unique(ids, return_index=True)[1])
