"""Check 2, bypassed-unit: a child unit whose forward never ran holds gradients."""

from __future__ import annotations

import pandas as pd

from fsdptrace import schema
from fsdptrace.checks import findings, keys

NAME = "bypassed-unit"
SEVERITY = findings.ERROR


def check(events: pd.DataFrame, units: pd.DataFrame, gradients: pd.DataFrame) -> pd.DataFrame:
    """Per rank and optimizer step: non-root units with gradients and no forward begin."""
    if not len(gradients):
        return findings.empty()
    with_grad = gradients[gradients["has_grad"].fillna(False).to_numpy(bool)]
    roots = units[units["is_root"].fillna(False).to_numpy(bool)]
    forward = events.loc[(events["phase"] == schema.FORWARD).to_numpy(bool),
                         ["rank", "step", "unit"]]
    bypassed = with_grad[~keys.isin(with_grad, roots, ["rank", "unit"])
                         & ~keys.isin(with_grad, forward, ["rank", "step", "unit"])]
    if not len(bypassed):
        return findings.empty()
    bypassed = bypassed.assign(rank=bypassed["rank"].astype("int64"),
                               unit=bypassed["unit"].astype(str))
    grouped = bypassed.groupby(["rank", "step", "unit"], sort=True).agg(
        micro_step=("micro_step", "max"), params=("param", lambda p: ", ".join(map(str, p))),
    ).reset_index()
    message = (grouped["unit"] + " did not run forward in any micro-step of the step"
               + ", yet its parameters hold gradients at the optimizer boundary (" +
               grouped["params"] + "): its weights were used without its forward, so FSDP "
               + "never gathered/reduced them through the unit; call the module itself "
               + "instead of reaching into its parameters, or do not shard it separately")
    return findings.make(NAME, SEVERITY, grouped, message)
