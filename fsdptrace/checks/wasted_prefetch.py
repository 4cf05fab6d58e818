"""Check 8, wasted-prefetch: a prefetched all-gather its target did not use in that pass.

A prefetch exists to overlap the target's all-gather with the source's compute in the same
phase. When the target does not consume it in that phase of that micro-step, the gathered
parameters sit in memory (into backward, into the next micro-step) or FSDP2 drops them in
``finalize_backward``: memory held and bandwidth spent for nothing. Needs the ``allgathers``
table (all-gather provenance); without it the check finds nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import PER_RANK, Check
from fsdptrace.reading.allgathers import (
    call_label,
    call_occurrences,
    ended_issues,
    lives_order,
    repeated_call,
    row_codes,
)

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables

NAME = "wasted-prefetch"
SEVERITY = findings.WARNING
# Issuers that are prefetches: configured edges and FSDP2's implicit backward prefetch.
# Forward prefetches fired again by checkpoint recompute are ``recompute`` and not counted:
# docs/checks.md keeps recompute out of forward findings.
PREFETCH_KINDS = ("prefetch", "implicit")
_PASS = ["step", "micro_step", "phase"]
_KINDS = {"prefetch": "prefetched", "implicit": "implicitly prefetched (FSDP2 default)"}


def check(tables: RankTables) -> pd.DataFrame:
    """Wasted prefetches outside micro-steps the writer lost all-gather rows of."""
    if not tables.sizes["allgathers"]:
        return findings.empty()
    found = wasted(tables.frame("allgathers"), tables.frame("events"))
    return tables.drop_lost(found, "allgathers")


def wasted(allgathers: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """Every prefetched all-gather held past its pass or dropped, one finding per issue."""
    if not len(allgathers):
        return findings.empty()
    issue, end = ended_issues(allgathers)
    prefetch = allgathers["issuer_kind"].isin(PREFETCH_KINDS).to_numpy()[issue]
    issue, end = issue[prefetch], end[prefetch]
    # Only the issues a check reports become text: most of a run's are consumed in their pass.
    same_pass = np.ones(len(issue), dtype=bool)
    for column in _PASS:
        values = row_codes(allgathers[column])
        same_pass &= values[issue] == values[end]
    dropped = (allgathers["event"] == "drop").to_numpy()[end]
    keep = dropped | ~same_pass
    if not keep.any():
        return findings.empty()
    return _findings(allgathers, events, issue[keep], end[keep])


def _findings(allgathers: pd.DataFrame, events: pd.DataFrame, issue: np.ndarray,
              end: np.ndarray) -> pd.DataFrame:
    """One finding per wasted issue, from the positions of the issue rows and of the rows
    that ended them, in seq order (``lives_order``). In plain Python over the reported rows
    only."""
    order = lives_order(allgathers, issue)
    issue, end = issue[order], end[order]
    mine = {c: allgathers[c].to_numpy()[issue].tolist() for c in
            ("rank", "step", "micro_step", "phase", "unit", "issuer_unit", "issuer_kind",
             "num_bytes", "t_ns", "seq")}
    for c in ("phase", "unit", "issuer_unit", "issuer_kind"):
        mine[c] = [str(v) for v in mine[c]]
    ended = {c: allgathers[c].to_numpy()[end].tolist() for c in
             ("event", "step", "micro_step", "phase", "detail")}
    calls, num_calls = call_occurrences(events, *(
        np.asarray(mine[c], dtype=object if c in ("phase", "issuer_unit") else np.int64)
        for c in ("rank", "step", "micro_step", "phase", "issuer_unit", "seq")))
    # As a float subtraction, as the held time always was.
    t_ns = allgathers["t_ns"].to_numpy(dtype=np.int64)
    held_ms = ((t_ns[end].astype(np.float64) - t_ns[issue]) / 1e6).tolist()
    located = pd.DataFrame({
        "rank": mine["rank"], "step": mine["step"], "micro_step": mine["micro_step"],
        "phase": mine["phase"], "unit": mine["issuer_unit"], "target": mine["unit"],
        "bytes": mine["num_bytes"], "held_ms": held_ms,
        "call_index": pd.arrays.IntegerArray(calls, calls == 0)})
    messages = [
        _message({c: v[i] for c, v in mine.items()}, {c: v[i] for c, v in ended.items()},
                 int(calls[i]), int(num_calls[i]), held_ms[i])
        for i in range(len(issue))]
    return findings.make(NAME, SEVERITY, located, messages)


def _message(issue: dict, end: dict, call: int, num_calls: int, held_ms: float) -> str:
    """'second call of layers.0 in forward prefetched layers.2 (4,096 bytes), dropped unused
    by FSDP2 (...) after holding it 1.250 ms: ...' (``call`` 0: which call is unknown)."""
    if end["event"] == "consume":
        fate = (f"consumed only in step {int(end['step'])} micro-step "
                f"{int(end['micro_step'])} {end['phase']}")
    else:
        fate = f"dropped unused by FSDP2 ({end['detail']})"
    target = issue["unit"]
    label = call_label(call, num_calls, issue["issuer_unit"], issue["phase"])
    return (f"{label} {_KINDS[issue['issuer_kind']]} {target} "
            f"({int(issue['num_bytes']):,} bytes), {fate} after holding it {held_ms:.3f} ms: "
            f"the gather overlapped nothing; prefetch {target} only from the "
            f"{'call' if repeated_call(call, num_calls) else 'unit'} that runs right before it")


CHECK = Check(8, NAME, SEVERITY, PER_RANK,
              "prefetched all-gather not used by its target in that pass", check)
