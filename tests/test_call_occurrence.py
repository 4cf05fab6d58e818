"""Which call of its source issued an all-gather row (``allgathers.call_occurrences``, on
arrays) against the definition walked row by row, on random tables.

Checks 8 and 9 name "the second call of layers.0 in forward" through it. The real-job tests see
what FSDP2 writes; these see what it might: a source with no entry before the row, a source
that is no unit, a missing source, several ranks, passes and phases, seqs out of row order,
categorical and plain text columns.
"""

from __future__ import annotations

import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptrace.reading.allgathers import call_occurrences

UNITS = ["a", "<root>", "layers.10", "layers.2"]
PHASES = ["forward", "backward"]


def reference(rows: pd.DataFrame, events: pd.DataFrame) -> list[tuple]:
    """(seq, occurrence, num_calls) of each row, in seq order: the source's entries in the
    row's pass counted one by one, up to the row (occurrence) and in all (num_calls)."""
    sources = set(rows["issuer_unit"].dropna().astype(str))
    out = []
    for row in rows.sort_values("seq").itertuples():
        source = "" if pd.isna(row.issuer_unit) else str(row.issuer_unit)
        calls = [e.seq for e in events.itertuples()
                 if str(e.unit) in sources and str(e.unit) == source and e.rank == row.rank
                 and e.step == row.step and e.micro_step == row.micro_step
                 and str(e.phase) == str(row.phase)]
        upto = sum(seq <= row.seq for seq in calls)
        out.append((row.seq, upto or None, len(calls) if upto else None))
    return out


def _frame(items: list[tuple], columns: list[str], seqs: list[int]) -> pd.DataFrame:
    frame = pd.DataFrame(items, columns=columns)
    frame["seq"] = seqs[:len(frame)]
    return frame


pass_ = st.tuples(st.integers(0, 1), st.integers(0, 1), st.integers(0, 1),
                  st.sampled_from(PHASES))
row = st.tuples(pass_, st.one_of(st.none(), st.sampled_from([*UNITS, "not-a-unit"])))
entry = st.tuples(pass_, st.sampled_from(UNITS))


@settings(max_examples=300, deadline=None)
@given(st.lists(row, max_size=12), st.lists(entry, max_size=30),
       st.randoms(use_true_random=False), st.booleans())
def test_each_row_is_the_call_of_its_source_that_came_last_before_it(
        rows: list[tuple], entries: list[tuple], shuffle, categorical: bool) -> None:
    seqs = list(range(len(rows) + len(entries)))
    shuffle.shuffle(seqs)  # rows and entries interleave, in no row order
    columns = ["rank", "step", "micro_step", "phase"]
    found = _frame([(*p, u) for p, u in rows], [*columns, "issuer_unit"], seqs)
    events = _frame([(*p, u) for p, u in entries], [*columns, "unit"], seqs[len(rows):])
    if categorical:
        events = events.astype({"unit": "category", "phase": "category"})
        found = found.astype({"phase": "category"})
    occurrence, num_calls = call_occurrences(
        events, *(found[c].to_numpy() for c in ("rank", "step", "micro_step", "phase",
                                                "issuer_unit", "seq")))
    got = sorted(zip(found["seq"], [o or None for o in occurrence.tolist()],
                     [n or None for n in num_calls.tolist()], strict=True))
    assert got == reference(found, events)
    assert occurrence.dtype == num_calls.dtype == "int64"
