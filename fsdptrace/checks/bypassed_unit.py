"""Check 2, bypassed-unit: a child unit whose forward never ran holds gradients."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks import findings, incomplete
from fsdptrace.checks.columns import fold
from fsdptrace.checks.contract import PER_RANK, Check

if TYPE_CHECKING:
    from fsdptrace.checks.tables import RankTables

NAME = "bypassed-unit"
SEVERITY = findings.ERROR


def check(tables: RankTables) -> pd.DataFrame:
    """Per rank and optimizer step: non-root units with gradients and no forward begin."""
    grads, units, events = tables.gradients, tables.units, tables.events
    if not len(grads):
        return findings.empty()
    with_grad = _flag(grads["has_grad"])
    roots = _flag(units["is_root"]) if len(units) else np.zeros(0, dtype=bool)
    forward = events["phase"] == tables.forward
    grad_unit, root_unit = fold([[grads["rank"], units["rank"][roots]],
                                 [grads["unit"], units["unit"][roots]]])
    grad_step, ran = fold([[grads["rank"], events["rank"][forward]],
                           [grads["step"], events["step"][forward]],
                           [grads["unit"], events["unit"][forward]]])
    bypassed = (with_grad & ~np.isin(grad_unit, root_unit)
                & ~np.isin(grad_step, pd.unique(ran)))
    # A forward begin or a gradient the writer lost would read as a bypass: skip such steps.
    bypassed &= ~incomplete.in_steps(tables.incomplete, ("events", "gradients"),
                                     grads["rank"], grads["step"])
    if not bypassed.any():
        return findings.empty()
    return _report(grads.frame(np.flatnonzero(bypassed)))


def _flag(values: np.ndarray) -> np.ndarray:
    """A nullable boolean column as a mask (missing counts as False)."""
    if values.dtype == bool:
        return values
    return pd.Series(values).fillna(False).to_numpy(bool)


def _report(bypassed: pd.DataFrame) -> pd.DataFrame:
    """One finding per (rank, step, unit), naming the parameters that hold gradients."""
    if not len(bypassed):
        return findings.empty()
    bypassed = bypassed.assign(rank=bypassed["rank"].astype("int64"),
                               unit=bypassed["unit"].astype(str))
    grouped = bypassed.groupby(["rank", "step", "unit"], sort=True).agg(
        micro_step=("micro_step", "max"),
        parameters=("param", lambda p: ", ".join(map(str, p))),
    ).reset_index()
    message = (grouped["unit"] + " did not run forward in any micro-step of the step"
               + ", yet its parameters hold gradients at the optimizer boundary (" +
               grouped["parameters"] + "): its weights were used without its forward, so FSDP "
               + "never gathered/reduced them through the unit; call the module itself "
               + "instead of reaching into its parameters, or do not shard it separately")
    return findings.make(NAME, SEVERITY, grouped, message)


# Version 2 counts only gradients produced in the step: that needs the gradients-received table
# the recorder does not write yet; until then a gradient is what the boundary snapshot holds.
CHECK = Check(2, NAME, SEVERITY, PER_RANK,
              "child unit bypassed, yet its parameters got gradients", check, live=True)
