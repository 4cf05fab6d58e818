"""Check 1, prefetch-order: a configured target that did not run, or ran only before its source.

docs/checks.md: for each pass and each unit S that ran in it, for each target T S was
configured to prefetch in that phase: T made no call in the pass -> "did not execute"; every
call of T came before S's first call -> out of order. A target that runs again after a call of
S (a block reused at two depths) is not out of order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import PER_RANK, Check
from fsdptrace.checks.kernel.edges import edges_in_effect
from fsdptrace.checks.kernel.order import GROUP

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables

NAME = "prefetch-order"
SEVERITY = findings.ERROR


def check(tables: RankTables) -> pd.DataFrame:
    """Every executed source's configured targets, against the calls of the pass."""
    calls = tables.complete
    source, target = edges_in_effect(tables, calls, calls.first_calls())
    source_position = calls.position[source]
    target_position = calls.last_call_positions(calls.group[source], target)
    missing = target_position < 0
    early = ~missing & (target_position < source_position)
    flagged = missing | early
    if not flagged.any():
        return findings.empty()
    rows = calls.events.frame(calls.rows[source[flagged]])[GROUP + ["unit"]].assign(
        position=source_position[flagged], target=tables.vocab.decode(target[flagged]),
        target_position=pd.array(target_position[flagged], dtype="Int64"))
    rows = rows.assign(rank=rows["rank"].astype("int64"), unit=rows["unit"].astype(str),
                       phase=rows["phase"].astype(str), target=rows["target"].astype(str))
    rows.loc[missing[flagged], "target_position"] = None
    named = rows.assign(unit=rows["unit"].map(tables.label),
                        target=rows["target"].map(tables.label))
    message = _ran_before(named).where(~missing[flagged], _did_not_execute(named))
    return findings.make(NAME, SEVERITY, rows, message)


def _did_not_execute(rows: pd.DataFrame) -> pd.Series:
    return (rows["unit"] + " prefetched " + rows["target"] + ", but " + rows["target"]
            + " did not execute in " + rows["phase"] + ": the all-gather is wasted and held; "
            + "remove " + rows["target"] + " from " + rows["unit"] + "'s " + rows["phase"]
            + " prefetch targets")


def _ran_before(rows: pd.DataFrame) -> pd.Series:
    return (rows["unit"] + " prefetched " + rows["target"] + " at positions "
            + rows["position"].astype(str) + "->" + rows["target_position"].astype(str) + " in "
            + rows["phase"] + ": the target had already run, so the prefetch is useless or "
            + "gathers for the next pass; prefetch the unit that runs after " + rows["unit"]
            + " instead (see fsdptrace suggest)")


CHECK = Check(1, NAME, SEVERITY, PER_RANK, "prefetch target missing or out of order", check,
              live=True)
