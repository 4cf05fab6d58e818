"""``reading.text_columns.as_text`` held to the ``Series.astype(str)`` it replaces in the
report's spans and memory ledger: values, dtype, index and name, on the columns the tables hold
(categoricals of names, with unused categories and nulls) and on those it must leave to pandas
(numbers, plain text)."""

from __future__ import annotations

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptrace.reading.text_columns import as_text

NAMES = ["<root>", "layers.0", "layers.1", "", "ünï", None]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(NAMES), max_size=30), st.lists(st.sampled_from(NAMES[:-1]),
                                                               unique=True),
       st.sampled_from(["str", "object"]))
def test_a_categorical_of_names_reads_as_astype_str(values: list[str | None],
                                                    unused: list[str], kind: str) -> None:
    categories = pd.Index(list(dict.fromkeys([v for v in values if v is not None] + unused)),
                          dtype=kind)
    column = pd.Series(pd.Categorical(values, categories=categories),
                       index=range(100, 100 + len(values)), name="unit")
    pd.testing.assert_series_equal(as_text(column), column.astype(str))


@pytest.mark.parametrize("column", [
    pd.Series(pd.Categorical([1, 2, None])),  # pandas spells these through floats: '1.0'
    pd.Series(["a", None, "b"]),
    pd.Series([3, 4], dtype="int64"),
], ids=["numbers-categorical", "text", "numbers"])
def test_other_columns_are_left_to_pandas(column: pd.Series) -> None:
    pd.testing.assert_series_equal(as_text(column), column.astype(str))
