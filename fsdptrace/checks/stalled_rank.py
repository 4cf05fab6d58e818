"""Check 6, stalled-rank: ranks whose recording did not end clean, or is missing.

After a hang this is what a person needs first: where each rank stopped, and which rank is
furthest behind (the likely culprit).
"""

from __future__ import annotations

import pandas as pd

from fsdptrace import endings
from fsdptrace.checks import findings
from fsdptrace.checks.contract import ACROSS_RANKS, Check, Merged
from fsdptrace.checks.order import progress_key

NAME = "stalled-rank"
SEVERITY = findings.ERROR


def check(merged: Merged) -> pd.DataFrame:
    """Every rank's ending (``fsdptrace.endings``) with where it stopped."""
    return stalled_findings(merged.meta, merged.ends, merged.last, merged.ranks)


def stalled_findings(meta: pd.DataFrame, markers: pd.DataFrame, last: pd.DataFrame,
            ranks: list[int]) -> pd.DataFrame:
    """``ranks``: ranks with any data on disk; ``last``: ``positions.last_positions`` of all
    ranks; ``markers``: at least their ending markers."""
    world_size = int(meta["world_size"].max()) if len(meta) else len(ranks)
    ends = endings.rank_endings(markers, ranks)[["rank", "ending", "detail"]]
    status = ends.merge(last, on="rank", how="left")
    stalled = status[status["ending"] != endings.CLEAN].copy()
    rows = []
    if len(stalled):
        rows.append(_stalled(stalled, status))
    missing = sorted(set(range(world_size)) - set(ranks))
    if missing:
        frame = pd.DataFrame({"rank": missing})
        message = ["rank " + str(r) + " of world size " + str(world_size) + " has no data on "
                   "disk: it never started recording, or its files were lost" for r in missing]
        rows.append(findings.make(NAME, SEVERITY, frame, message))
    return findings.combine(rows)


def _stalled(stalled: pd.DataFrame, status: pd.DataFrame) -> pd.DataFrame:
    known = status.dropna(subset=["step"])
    keys = progress_key(known["step"], known["micro_step"], known["phase"], known["position"])
    stalled_keys = progress_key(stalled["step"].fillna(-1), stalled["micro_step"].fillna(0),
                                stalled["phase"].fillna(""), stalled["position"].fillna(0))
    lowest = stalled_keys.min()
    behind = sorted(int(r) for r in stalled.loc[stalled_keys == lowest, "rank"])
    furthest = known.loc[keys.idxmax()] if len(known) else None
    where = _where(stalled)
    how = "ended without a clean close: " + endings.describe(stalled)
    same = _same_stop(stalled)
    if same is not None:
        message = ("rank " + stalled["rank"].astype(str) + " " + how + "; stopped at " + where
                   + "; every rank that did not end cleanly stopped here: no rank diverged "
                   f"before the stop, so the stall is inside {same}'s collective or below it "
                   "(device, network, a slow host)")
        return findings.make(NAME, SEVERITY, stalled, message)
    behind_text = ("rank " if len(behind) == 1 else "ranks ") + ", ".join(map(str, behind))
    verdict = pd.Series(
        ["it is furthest behind (likely culprit of a hang)" if int(r) in behind
         else behind_text + (" is" if len(behind) == 1 else " are") + " further behind"
         for r in stalled["rank"]], index=stalled.index)
    ahead = ""
    if furthest is not None:
        ahead = (f"; the furthest rank ({int(furthest['rank'])}) reached step "
                 f"{int(furthest['step'])}, micro-step {int(furthest['micro_step'])}, "
                 f"{furthest['phase']} {furthest['unit']}")
    message = ("rank " + stalled["rank"].astype(str) + " " + how + "; stopped at " + where
               + "; " + verdict + ahead)
    return findings.make(NAME, SEVERITY, stalled.assign(unit=stalled["unit"]), message)


def _same_stop(stalled: pd.DataFrame) -> str | None:
    """The unit where every stalled rank stopped, when they all stopped in one pass there."""
    if len(stalled) < 2 or stalled["step"].isna().any():
        return None
    where = stalled[["step", "micro_step", "phase", "unit"]].astype(str).drop_duplicates()
    return str(where["unit"].iloc[0]) if len(where) == 1 else None


def _where(rows: pd.DataFrame) -> pd.Series:
    known = rows["step"].notna()
    text = ("step " + rows["step"].astype("Int64").astype(str) + ", micro-step "
            + rows["micro_step"].astype("Int64").astype(str) + ", " + rows["phase"].astype(str)
            + ", last unit entered " + rows["unit"].astype(str) + " (position "
            + rows["position"].astype("Int64").astype(str) + ")")
    return text.where(known, "before its first recorded unit")


# Version 2 classifies hangs by how far each rank got (done here from the last unit entered).
CHECK = Check(6, NAME, SEVERITY, ACROSS_RANKS, "rank stopped without a clean close, or missing",
              check)
