"""Check 2, bypassed-unit: a child unit whose forward never ran holds gradients."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import PER_RANK, Check
from fsdptrace.checks.kernel.units import began_forward_in_step, is_root, received_gradient
from fsdptrace.reading import incomplete

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables

NAME = "bypassed-unit"
SEVERITY = findings.ERROR


def check(tables: RankTables) -> pd.DataFrame:
    """Per rank and optimizer step: non-root units whose parameters received a gradient in the
    step (not a leftover buffer) though the unit began forward in none of its micro-steps."""
    grads = tables.gradients
    if not len(grads):
        return findings.empty()
    rank, step, unit = grads["rank"], grads["step"], grads["unit"]
    bypassed = ~is_root(tables, rank, unit) & ~began_forward_in_step(tables, rank, step, unit)
    if not bypassed.any():  # the usual step: every unit ran forward, no gradient to judge
        return findings.empty()
    candidates = np.flatnonzero(bypassed)
    bypassed[candidates] = received_gradient(tables, candidates)
    # A forward begin or a gradient the writer lost would read as a bypass: skip such steps.
    bypassed &= ~incomplete.in_steps(tables.incomplete, ("events", "gradients", "grads_written"),
                                     rank, step)
    if not bypassed.any():
        return findings.empty()
    return _report(grads.frame(np.flatnonzero(bypassed)))


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
               + ", yet its parameters received gradients during the step (" +
               grouped["parameters"] + "): its weights were used without its forward, so FSDP "
               + "never gathered/reduced them through the unit; call the module itself "
               + "instead of reaching into its parameters, or do not shard it separately")
    return findings.make(NAME, SEVERITY, grouped, message)


CHECK = Check(2, NAME, SEVERITY, PER_RANK,
              "child unit bypassed, yet its parameters got gradients", check, live=True)
