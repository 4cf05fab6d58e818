"""Check 9's dead edges (found on arrays) against the contract's rule walked edge by edge, on
random all-gather tables.

docs/checks.md, check 9: a prefetch edge is redundant in a step when it did its work at no
call of the step and was a no-op (its target already pending or unsharded) at one call or
more. The real-job tests see what FSDP2 writes; these see edges mixing issues, no-ops, no-ops
of unknown cause, several ranks, steps, micro-steps and phases, categorical or plain columns.
"""

from __future__ import annotations

import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptrace.checks.redundant_prefetch import redundant

UNITS = ["a", "b", "layers.0"]
EDGE = ["rank", "step", "phase", "issuer_unit", "unit"]


def reference(rows: pd.DataFrame) -> set[tuple]:
    """Edges whose every prefetch call was a no-op, one or more of them for a known cause."""
    tried = rows[(rows["issuer_kind"] == "prefetch") & rows["event"].isin(["issue", "noop"])]
    dead = set()
    for edge, calls in tried.groupby(EDGE):
        noop = (calls["event"] == "noop") & calls["detail"].isin(["pending", "unsharded"])
        if noop.all():
            dead.add(tuple(edge))
    return dead


row = st.tuples(st.integers(0, 1), st.integers(0, 1), st.integers(0, 1),
                st.sampled_from(["forward", "backward"]), st.sampled_from(UNITS),
                st.sampled_from(UNITS), st.sampled_from(["prefetch", "prefetch", "own"]),
                st.sampled_from(["issue", "noop", "noop", "consume"]),
                st.sampled_from(["pending", "unsharded", "unsharded", "other"]))


@settings(max_examples=150, deadline=None)
@given(st.lists(row, min_size=1, max_size=30), st.booleans())
def test_an_edge_is_dead_when_no_call_did_work(rows: list[tuple], categorical: bool) -> None:
    frame = pd.DataFrame(rows, columns=["rank", "step", "micro_step", "phase", "issuer_unit",
                                        "unit", "issuer_kind", "event", "detail"])
    frame = frame.assign(seq=range(2, 2 * len(frame) + 2, 2), group=0, num_bytes=64,
                         t_ns=range(len(frame)))
    # Each row's issuing unit entered its pass just before (what call_occurrences counts).
    events = frame[["rank", "step", "micro_step", "phase"]].assign(
        unit=frame["issuer_unit"], seq=frame["seq"] - 1)
    if categorical:
        frame = frame.astype({c: "category" for c in ("phase", "unit", "issuer_unit",
                                                      "issuer_kind", "event", "detail")})
    found = redundant(frame, events)
    got = set(zip(found["rank"], found["step"], found["phase"], found["unit"], found["target"],
                  strict=True))
    assert got == reference(frame.astype({"detail": str, "event": str, "issuer_kind": str}))
    assert found["message"].str.contains(" did nothing in step ").all()


def test_calls_whose_entries_were_lost_still_count() -> None:
    """A dead edge whose source's entries are missing (a lost chunk of events): which call
    made each no-op is unknown, but each micro-step's no-op was a call. The first version of
    the message said "at 0 call(s) ... in 2 micro-step(s)" there."""
    rows = [(0, 0, micro, "backward", "layers.2", "layers.1", "prefetch", "noop", "pending")
            for micro in (0, 1)]
    frame = pd.DataFrame(rows, columns=["rank", "step", "micro_step", "phase", "issuer_unit",
                                        "unit", "issuer_kind", "event", "detail"])
    frame = frame.assign(seq=[10, 20], group=0, num_bytes=64, t_ns=[1, 2])
    no_events = pd.DataFrame({"rank": [], "step": [], "micro_step": [], "phase": [],
                              "unit": [], "seq": []}).astype({"seq": "int64"})
    found = redundant(frame, no_events)
    assert len(found) == 1
    assert "at 2 call(s) of layers.2 in 2 micro-step(s)" in found["message"][0]
