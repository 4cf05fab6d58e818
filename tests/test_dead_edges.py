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
    # Each row's issuing unit entered its pass just before (what with_occurrence counts).
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
