"""Check 9, redundant-prefetch: a configured prefetch of a unit already gathered or pending.

FSDP2's ``unshard()`` returns early when the group is unsharded or its all-gather is pending,
so such an edge costs nothing but does nothing either: dead configuration that hides which
edge really gathers the target. Only configured edges count (``issuer_kind == 'prefetch'``);
FSDP2's implicit prefetch is not configuration. Needs the ``allgathers`` table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import PER_RANK, Check
from fsdptrace.checks.wasted_prefetch import call_label, issuer_text, plain, with_occurrence

if TYPE_CHECKING:
    from fsdptrace.checks.tables import RankTables

NAME = "redundant-prefetch"
SEVERITY = findings.WARNING
_STATES = {"pending": "its all-gather was already pending", "unsharded": "it was already unsharded"}


def check(tables: RankTables) -> pd.DataFrame:
    """No-op prefetches outside micro-steps the writer lost all-gather rows of."""
    if not tables.sizes["allgathers"]:
        return findings.empty()
    found = redundant(tables.frame("allgathers"), tables.frame("events"))
    return tables.drop_lost(found, "allgathers")


def redundant(allgathers: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """Every no-op prefetch by a configured edge, one finding per execution of the source."""
    if not len(allgathers):
        return findings.empty()
    rows = plain(allgathers)
    noops = rows[(rows["event"] == "noop") & (rows["issuer_kind"] == "prefetch")
                 & rows["detail"].isin(list(_STATES))]
    if not len(noops):
        return findings.empty()
    noops = with_occurrence(_with_gatherer(noops, rows), events)
    gatherer = noops[["gatherer_kind", "gatherer_unit"]].set_axis(
        ["issuer_kind", "issuer_unit"], axis=1)
    by = " (gathered by " + issuer_text(gatherer) + ")"
    message = (call_label(noops) + " prefetched " + noops["unit"] + ", but "
               + noops["detail"].map(_STATES) + by + ": FSDP2 made it a no-op; remove "
               + noops["unit"] + " from " + noops["issuer_unit"] + "'s " + noops["phase"]
               + " prefetch targets, or fix the edge that gathers it")
    located = noops.assign(target=noops["unit"], unit=noops["issuer_unit"],
                           call_index=noops["occurrence"])
    return findings.make(NAME, SEVERITY, located, message)


def _with_gatherer(noops: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
    """Who issued the all-gather that made this prefetch redundant (the latest issue before)."""
    issues = rows[rows["event"] == "issue"][["rank", "unit", "group", "seq", "issuer_kind",
                                             "issuer_unit"]]
    issues = issues.rename(columns={"seq": "gather_seq", "issuer_kind": "gatherer_kind",
                                    "issuer_unit": "gatherer_unit"}).sort_values("gather_seq")
    merged = pd.merge_asof(noops.sort_values("seq"), issues, left_on="seq",
                           right_on="gather_seq", by=["rank", "unit", "group"],
                           direction="backward")
    return merged.drop(columns="gather_seq")


# Version 2 reports an edge only when it was dead at every call in every micro-step of the
# step; until the settings table exists (reshard_after_* by design) each no-op is reported.
CHECK = Check(9, NAME, SEVERITY, PER_RANK,
              "prefetch of a unit already gathered or pending (no-op)", check)
