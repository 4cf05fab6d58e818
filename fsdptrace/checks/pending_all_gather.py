"""Check 3, pending-all-gather: an all-gather issued and not consumed before optimizer.step()."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import PER_RANK, Check

if TYPE_CHECKING:
    from fsdptrace.checks.tables import RankTables

NAME = "pending-all-gather"
SEVERITY = findings.ERROR


def check(tables: RankTables) -> pd.DataFrame:
    """The boundary snapshots of pending all-gathers, outside steps the writer lost rows of."""
    if not tables.sizes["pending"]:
        return findings.empty()
    found = pending_findings(tables.frame("pending"), tables.frame("allgathers"))
    return tables.drop_lost(found, "pending", whole_steps=True)


def pending_findings(pending: pd.DataFrame, allgathers: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every pending all-gather the recorder saw right before an optimizer step.

    With all-gather provenance recorded, each finding also says who issued the gather.
    """
    if not len(pending):
        return findings.empty()
    rows = pending.assign(unit=pending["unit"].astype(str), target=pending["bucket"].astype(str))
    issued = _issued_by(rows, allgathers)
    message = (rows["unit"] + ": " + rows["kind"].astype(str) + " " + rows["bucket"].astype(str)
               + " " + rows["state"].astype(str) + issued + " at the optimizer boundary: the next "
               + "forward will consume the pre-step gather and run on stale parameters; fix the "
               + "prefetch edge that issued it, "
               + "or let the last micro-step's backward be the last (set_is_last_backward)")
    return findings.make(NAME, SEVERITY, rows, message)


def _issued_by(rows: pd.DataFrame, allgathers: pd.DataFrame | None) -> pd.Series:
    """' (issued by manual unshard() in step 0)' per row: the unit's last issue by then."""
    none = pd.Series("", index=rows.index)
    if allgathers is None or not len(allgathers):
        return none
    from fsdptrace.checks.wasted_prefetch import issuer_text, plain

    issues = plain(allgathers)
    issues = issues[issues["event"] == "issue"].sort_values(["step", "seq"])
    issues = issues.assign(by=" (issued by " + issuer_text(issues) + " in step "
                           + issues["step"].astype(str) + " micro-step "
                           + issues["micro_step"].astype(str) + ")")
    left = rows.assign(
        _row=range(len(rows)), rank=rows["rank"].astype("int64"),
        step=rows["step"].astype("int64"),
        group=rows["bucket"].astype(str).str.extract(r"group\[(\d+)\]")[0].fillna(-1)
        .astype("int64"),
    ).sort_values("step")
    joined = pd.merge_asof(left, issues[["rank", "unit", "group", "step", "by"]], on="step",
                           by=["rank", "unit", "group"], direction="backward")
    by = joined.sort_values("_row")["by"].fillna("")
    return pd.Series(by.to_numpy(), index=rows.index)


# Version 2 names the cause (prefetch edge, manual unshard(), eval forward, reshard setting)
# and parameters left unsharded: that needs the eval-forward and settings tables to come.
CHECK = Check(3, NAME, SEVERITY, PER_RANK, "all-gather still pending at the optimizer boundary",
              check, live=True)
