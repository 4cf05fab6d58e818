"""Which row ended each all-gather (``allgathers.ended_issues``, on arrays) against the
definition walked row by row, on random tables, and the order check 8 reports them in
(``lives_order``: by seq, then rank, unit name, group and row).

Check 8 reads every prefetch's fate through it; the real-job tests see what FSDP2 writes,
these see what it might: re-issues before a consume, drops, noops between, interleaved units
and groups, several ranks, seqs out of row order, categorical and plain text columns.
"""

from __future__ import annotations

import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptrace.reading.allgathers import ended_issues, lives_order

UNITS = ["b", "a", "<root>", "layers.10", "layers.2"]
EVENTS = ["issue", "issue", "consume", "drop", "noop"]


def reference(frame: pd.DataFrame) -> list[tuple[int, int]]:
    """Row labels (issue, its end), walking each (rank, unit, group)'s rows in seq order."""
    life = frame[frame["event"].astype(str).isin(["issue", "consume", "drop"])]
    out = []
    keys = [life["rank"], life["unit"].astype(str), life["group"]]
    for _, rows in sorted(life.groupby(keys), key=lambda item: item[0]):
        rows = rows.sort_values("seq")
        events = rows["event"].astype(str).tolist()
        for i in range(len(rows) - 1):
            if events[i] == "issue" and events[i + 1] in ("consume", "drop"):
                out.append((rows.index[i], rows.index[i + 1]))
    return out


row = st.tuples(st.integers(0, 2), st.sampled_from(UNITS), st.integers(0, 1),
                st.sampled_from(EVENTS))


@settings(max_examples=300, deadline=None)
@given(st.lists(row, min_size=0, max_size=40), st.randoms(use_true_random=False),
       st.booleans())
def test_each_issue_is_ended_by_the_next_row_of_its_group(rows: list[tuple], shuffle,
                                                          categorical: bool) -> None:
    frame = pd.DataFrame(rows, columns=["rank", "unit", "group", "event"])
    # Each rank numbers its own rows (ranks share seqs, as real ones do), not in row order.
    seqs = {r: list(range(n)) for r, n in frame["rank"].value_counts().items()}
    for numbers in seqs.values():
        shuffle.shuffle(numbers)
    frame["seq"] = [seqs[r].pop() for r in frame["rank"]]
    if categorical:
        frame = frame.astype({"unit": "category", "event": "category"})
    issues, ends = ended_issues(frame)
    expected = reference(frame)
    assert sorted(zip(frame.index[issues], frame.index[ends], strict=True)) == sorted(expected)
    reported = frame.index[issues[lives_order(frame, issues)]].tolist()
    assert reported == sorted((i for i, _ in expected), key=lambda i: (
        frame.at[i, "seq"], frame.at[i, "rank"], str(frame.at[i, "unit"]), frame.at[i, "group"], i))
