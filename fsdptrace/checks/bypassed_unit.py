"""Check 2, bypassed-unit: a child unit whose forward never ran holds gradients."""

from __future__ import annotations

import pandas as pd

from fsdptrace import schema
from fsdptrace.checks import findings

NAME = "bypassed-unit"
SEVERITY = findings.ERROR


def check(events: pd.DataFrame, units: pd.DataFrame, gradients: pd.DataFrame) -> pd.DataFrame:
    """Per rank and optimizer step: non-root units with gradients and no forward begin."""
    if not len(gradients):
        return findings.empty()
    with_grad = gradients[gradients["has_grad"]].assign(
        rank=lambda f: f["rank"].astype("int64"), unit=lambda f: f["unit"].astype(str))
    roots = units[units["is_root"]].assign(rank=lambda f: f["rank"].astype("int64"),
                                           unit=lambda f: f["unit"].astype(str))
    with_grad = with_grad.merge(roots[["rank", "unit"]].assign(_root=True),
                                on=["rank", "unit"], how="left")
    with_grad = with_grad[with_grad["_root"].isna()]
    forward = events[events["phase"] == schema.FORWARD]
    ran = forward[["rank", "step", "unit"]].drop_duplicates().assign(
        rank=lambda f: f["rank"].astype("int64"), unit=lambda f: f["unit"].astype(str),
        _ran=True)
    merged = with_grad.merge(ran, on=["rank", "step", "unit"], how="left")
    bypassed = merged[merged["_ran"].isna()]
    if not len(bypassed):
        return findings.empty()
    grouped = bypassed.groupby(["rank", "step", "unit"], sort=True).agg(
        micro_step=("micro_step", "max"), params=("param", lambda p: ", ".join(map(str, p))),
    ).reset_index()
    message = (grouped["unit"] + " did not run forward in any micro-step of the step"
               + ", yet its parameters hold gradients at the optimizer boundary (" +
               grouped["params"] + "): its weights were used without its forward, so FSDP "
               + "never gathered/reduced them through the unit; call the module itself "
               + "instead of reaching into its parameters, or do not shard it separately")
    return findings.make(NAME, SEVERITY, grouped, message)
