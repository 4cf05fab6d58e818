"""Check 7, order-instability: a rank's forward order changes between micro-steps.

Prefetch wired from one iteration's order will not hold for the others.
"""

from __future__ import annotations

import pandas as pd

from fsdptrace import schema
from fsdptrace.checks import findings
from fsdptrace.checks.order import GROUP, drop_cut_off, first_difference, signatures, with_positions

NAME = "order-instability"
SEVERITY = findings.WARNING


def check(events: pd.DataFrame, markers: pd.DataFrame) -> pd.DataFrame:
    """Each rank's forward orders against its first recorded micro-step."""
    forward = drop_cut_off(events, markers)
    forward = forward[forward["phase"] == schema.FORWARD]
    if not len(forward):
        return findings.empty()
    positioned = with_positions(forward).assign(
        rank=lambda f: f["rank"].astype("int64"), phase=lambda f: f["phase"].astype(str),
        unit=lambda f: f["unit"].astype(str))
    sigs = signatures(positioned).sort_values(["rank", "step", "micro_step"])
    first = sigs.drop_duplicates("rank", keep="first")[["rank", "step", "micro_step", "signature"]]
    first = first.rename(columns={"step": "ref_step", "micro_step": "ref_micro",
                                  "signature": "ref_signature"})
    sigs = sigs.merge(first, on="rank")
    changed = sigs[sigs["signature"] != sigs["ref_signature"]]
    if not len(changed):
        return findings.empty()
    left = positioned.merge(changed[GROUP], on=GROUP)
    refs = changed[GROUP + ["ref_step", "ref_micro"]]
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
