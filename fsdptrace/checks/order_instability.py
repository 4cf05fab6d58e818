"""Check 7, order-instability: a rank's forward order changes between micro-steps.

Prefetch wired from one iteration's order will not hold for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace import schema
from fsdptrace.checks import findings, keys
from fsdptrace.checks.columns import fold
from fsdptrace.checks.order import GROUP, first_difference, signatures

if TYPE_CHECKING:
    from fsdptrace.checks.tables import RankTables

NAME = "order-instability"
SEVERITY = findings.WARNING


def check(events: pd.DataFrame, markers: pd.DataFrame) -> pd.DataFrame:
    """Each rank's forward orders against its first recorded micro-step."""
    from fsdptrace.checks.tables import RankTables

    return check_tables(RankTables.from_frames(events=events, markers=markers))


def check_tables(tables: RankTables, sigs: pd.DataFrame | None = None) -> pd.DataFrame:
    """``check`` on code columns: signatures decide; only changed orders are rebuilt."""
    from fsdptrace.checks.positions import signatures

    pos = tables.complete
    if sigs is None:
        sigs = signatures(pos, tables.vocab.names)
    forward = sigs[sigs["phase"] == schema.FORWARD] if len(sigs) else sigs
    wanted = _changed(forward) if len(forward) else forward
    if not len(wanted):
        return findings.empty()
    (have, want) = fold([[pos.column(c), wanted[c].to_numpy()]
                         for c in ("rank", "step", "micro_step")])
    mask = np.isin(have, want) & (pos.column("phase") == tables.forward)
    return check_positioned(pos.frame(mask), sigs)


def _changed(sigs: pd.DataFrame) -> pd.DataFrame:
    """Forward orders that differ from their rank's first, and those first ones (rank, step,
    micro_step): the only orders the unit-by-unit comparison needs."""
    sigs = sigs.sort_values(["rank", "step", "micro_step"], kind="stable")
    rank = sigs["rank"].to_numpy()
    signature = sigs["signature"].to_numpy()
    starts = np.r_[True, rank[1:] != rank[:-1]]
    first = np.maximum.accumulate(np.where(starts, np.arange(len(rank)), 0))
    changed = signature != signature[first]
    if not changed.any():
        return sigs.iloc[:0]
    keep = np.zeros(len(rank), dtype=bool)
    keep[changed] = True
    keep[first[changed]] = True
    return sigs[keep]


def check_positioned(positioned: pd.DataFrame, sigs: pd.DataFrame | None = None
                     ) -> pd.DataFrame:
    """``check`` on positioned complete orders (positions are per phase, so forward's hold).

    ``sigs``: their ``signatures``, when the caller has them already.
    """
    positioned = positioned[positioned["phase"] == schema.FORWARD]
    if not len(positioned):
        return findings.empty()
    sigs = signatures(positioned) if sigs is None else sigs[sigs["phase"] == schema.FORWARD]
    sigs = sigs.sort_values(["rank", "step", "micro_step"], kind="stable")
    first = sigs.drop_duplicates("rank", keep="first")[["rank", "step", "micro_step", "signature"]]
    first = first.rename(columns={"step": "ref_step", "micro_step": "ref_micro",
                                  "signature": "ref_signature"})
    sigs = sigs.merge(first, on="rank")
    changed = sigs[sigs["signature"] != sigs["ref_signature"]]
    if not len(changed):
        return findings.empty()
    refs = changed[GROUP + ["ref_step", "ref_micro"]]
    # Only the changed orders and their references are compared unit by unit.
    ref_groups = refs.drop(columns=["step", "micro_step"]).rename(
        columns={"ref_step": "step", "ref_micro": "micro_step"})
    positioned = positioned[keys.isin(positioned, changed, GROUP)
                            | keys.isin(positioned, ref_groups, GROUP)]
    positioned = positioned.assign(
        rank=positioned["rank"].astype("int64"), phase=positioned["phase"].astype(str),
        unit=positioned["unit"].astype(str))
    changed = changed.assign(rank=changed["rank"].astype("int64"),
                             phase=changed["phase"].astype(str))
    refs = changed[GROUP + ["ref_step", "ref_micro"]]
    left = positioned.merge(changed[GROUP], on=GROUP)
    right = positioned.rename(columns={"step": "ref_step", "micro_step": "ref_micro"}).merge(
        refs, on=["rank", "ref_step", "ref_micro", "phase"])
    diff = first_difference(left, right, GROUP)
    rows = diff.merge(refs, on=GROUP)
    rows["unit"] = rows["left_unit"]
    rows["target"] = rows["right_unit"]
    message = ("forward order differs from the rank's first recorded micro-step (step "
               + rows["ref_step"].astype(str)
               + ", micro-step " + rows["ref_micro"].astype(str) + ") at index "
               + rows["index"].astype(str) + ": " + rows["left_unit"] + " instead of "
               + rows["right_unit"] + "; prefetch wired from one iteration's order will not "
               + "hold for the others")
    return findings.make(NAME, SEVERITY, rows, message)
