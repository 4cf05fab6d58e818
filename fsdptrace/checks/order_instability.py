"""Check 7, order-instability: a rank's forward order changes between micro-steps.

Prefetch wired from one iteration's order will not hold for the others.
"""

from __future__ import annotations

import pandas as pd

from fsdptrace import schema
from fsdptrace.checks import findings, keys
from fsdptrace.checks.order import GROUP, drop_cut_off, first_difference, signatures, with_positions

NAME = "order-instability"
SEVERITY = findings.WARNING


def check(events: pd.DataFrame, markers: pd.DataFrame) -> pd.DataFrame:
    """Each rank's forward orders against its first recorded micro-step."""
    return check_positioned(with_positions(drop_cut_off(events, markers)))


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
