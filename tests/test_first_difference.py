"""The first difference of two orders has one definition, ``order.first_difference_of`` (two
lists); the checks that compare thousands of orders at once use a vectorized form
(``order.first_difference``, a merge of frames). Here the vectorized form must agree with the
definition on any pair of orders, including one that ends early or orders that are equal."""

from __future__ import annotations

import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptrace.checks.kernel.order import first_difference, first_difference_of

ORDERS = st.lists(st.lists(st.sampled_from(["a", "b", "c"]), max_size=6), min_size=2,
                  max_size=8)


def _frame(orders: list[list[str]]) -> pd.DataFrame:
    return pd.DataFrame([(k, position, unit) for k, order in enumerate(orders)
                         for position, unit in enumerate(order)],
                        columns=["k", "position", "unit"]).astype({"unit": object})


@settings(max_examples=200, deadline=None)
@given(left=ORDERS, right=ORDERS)
def test_the_vectorized_first_difference_is_the_definition(left: list[list[str]],
                                                           right: list[list[str]]) -> None:
    pairs = list(zip(left, right, strict=False))  # the shorter list decides: a pair per key k
    left, right = [a for a, _ in pairs], [b for _, b in pairs]
    found = first_difference(_frame(left), _frame(right), ["k"])
    expected = {k: first_difference_of(a, b) for k, (a, b) in enumerate(pairs) if a != b}
    assert {int(k): (int(i), lu, ru) for k, i, lu, ru in zip(
        found["k"], found["index"], found["left_unit"], found["right_unit"], strict=True)
    } == expected
