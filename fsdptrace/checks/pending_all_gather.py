"""Check 3, pending-all-gather: an all-gather issued and not consumed before optimizer.step()."""

from __future__ import annotations

import pandas as pd

from fsdptrace.checks import findings

NAME = "pending-all-gather"
SEVERITY = findings.ERROR


def check(pending: pd.DataFrame) -> pd.DataFrame:
    """Every pending all-gather the recorder saw right before an optimizer step."""
    if not len(pending):
        return findings.empty()
    rows = pending.assign(unit=pending["unit"].astype(str), target=pending["bucket"].astype(str))
    message = (rows["unit"] + ": " + rows["kind"].astype(str) + " " + rows["bucket"].astype(str)
               + " " + rows["state"].astype(str) + " at the optimizer boundary: the next forward will consume the pre-step "
               + "gather and run on stale parameters; fix the prefetch edge that issued it, "
               + "or let the last micro-step's backward be the last (set_is_last_backward)")
    return findings.make(NAME, SEVERITY, rows, message)
