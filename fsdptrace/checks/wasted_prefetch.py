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
    ended_issues,
    plain,
    repeated_call,
    row_codes,
    with_occurrence,
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
    wasted = _with_ends(plain(allgathers.iloc[issue[keep]]), plain(allgathers.iloc[end[keep]]))
    wasted = with_occurrence(wasted, events)
    return findings.make(NAME, SEVERITY, _located(wasted), _messages(wasted))


def _with_ends(issues: pd.DataFrame, ends: pd.DataFrame) -> pd.DataFrame:
    """The issue rows with their ending row's pass, time and detail as ``end_*`` columns
    (numbers as float, as a shift within the all-gather's rows gives them)."""
    out = issues.copy()
    for column in ("event", "step", "micro_step", "phase", "t_ns", "detail"):
        values = ends[column].to_numpy()
        out["end_" + column] = (values.astype("float64") if column in ("step", "micro_step", "t_ns")
                                else values)
    return out


def _located(rows: pd.DataFrame) -> pd.DataFrame:
    return rows.assign(target=rows["unit"], unit=rows["issuer_unit"], bytes=rows["num_bytes"],
                       held_ms=(rows["end_t_ns"] - rows["t_ns"]) / 1e6,
                       call_index=rows["occurrence"])


def _messages(rows: pd.DataFrame) -> pd.Series:
    held_ms = ((rows["end_t_ns"] - rows["t_ns"]) / 1e6).map("{:.3f}".format)
    size = rows["num_bytes"].astype("int64").map("{:,}".format)
    end_step = rows["end_step"].astype("int64").astype(str)
    end_micro = rows["end_micro_step"].astype("int64").astype(str)
    later = ("consumed only in step " + end_step + " micro-step " + end_micro + " "
             + rows["end_phase"].astype(str))
    dropped = "dropped unused by FSDP2 (" + rows["end_detail"].astype(str) + ")"
    fate = later.where(rows["end_event"] == "consume", dropped)
    kind = rows["issuer_kind"].map({"prefetch": "prefetched",
                                    "implicit": "implicitly prefetched (FSDP2 default)"})
    return (call_label(rows) + " " + kind + " " + rows["unit"] + " (" + size + " bytes), "
            + fate + " after holding it " + held_ms + " ms: the gather overlapped nothing; "
            + "prefetch " + rows["unit"] + " only from the "
            + pd.Series("call", index=rows.index).where(repeated_call(rows), "unit")
            + " that runs right before it")


CHECK = Check(8, NAME, SEVERITY, PER_RANK,
              "prefetched all-gather not used by its target in that pass", check)
