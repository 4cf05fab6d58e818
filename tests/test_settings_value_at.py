"""The setting in effect at a micro-step (``checks.kernel.settings.value_at``, read by checks
7, 10 and 11), held to its definition row by row in plain Python: of the rank's and unit's
changes of that setting at or before the row's (step, micro_step), the last; of several in
one micro-step, the last in the table; None where there is none or the value is null. Names
as categoricals with different categories on each side, and keys re-coded densely (the path
a run too wide for one int64 key takes)."""

from __future__ import annotations

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptrace.checks.kernel import settings as kernel_settings

_CHANGE = st.tuples(st.integers(0, 2), st.sampled_from("abc"), st.integers(0, 3),
                    st.integers(0, 2), st.sampled_from(["told", "other"]),
                    st.sampled_from(["true", "false", None]))
_ROW = st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 2), st.sampled_from("abd"))


def _expected(changes: list[tuple], row: tuple) -> str | None:
    rank, step, micro, unit = row
    value = None
    for c_rank, c_unit, c_step, c_micro, name, c_value in sorted(
            changes, key=lambda c: (c[2], c[3])):  # stable: table order within a micro-step
        if (c_rank, c_unit, name) == (rank, unit, "told") and (c_step, c_micro) <= (step, micro):
            value = c_value
    return value


@pytest.mark.parametrize("dense", [False, True])
@settings(max_examples=150, deadline=None)
@given(st.lists(_CHANGE, max_size=25), st.lists(_ROW, min_size=1, max_size=20))
def test_value_at_is_the_last_change_at_or_before(dense: bool, changes: list[tuple],
                                                  rows: list[tuple]) -> None:
    table = pd.DataFrame(changes, columns=["rank", "unit", "step", "micro_step", "setting",
                                           "value"])
    table = table.astype({"rank": "int32", "unit": pd.CategoricalDtype(["c", "b", "a"]),
                          "setting": "category", "value": object})
    frame = pd.DataFrame(rows, columns=["rank", "step", "micro_step", "unit"])
    frame["unit"] = frame["unit"].astype("category")
    frame.index = frame.index * 3 + 7  # the result keeps the rows' index
    limit = 1 if dense else kernel_settings.KEY_LIMIT
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel_settings, "KEY_LIMIT", limit)
        got = kernel_settings.value_at(table, frame, "told")
    assert list(got.index) == list(frame.index) and got.dtype == object
    assert got.tolist() == [_expected(changes, row) for row in rows]
