"""Check 7, order-instability: a rank's forward order changes between micro-steps.

Prefetch wired from one iteration's order will not hold for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import PER_RANK, Check
from fsdptrace.checks.kernel.order import END
from fsdptrace.checks.kernel.positions import ENDED, first_differences
from fsdptrace.store import schema

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables

NAME = "order-instability"
SEVERITY = findings.WARNING


def check(tables: RankTables) -> pd.DataFrame:
    """Each rank's forward orders against its first recorded micro-step: order signatures
    decide, and only the orders that changed are compared call by call."""
    pos = tables.complete
    sigs = tables.signatures
    forward = sigs[sigs["phase"] == schema.FORWARD] if len(sigs) else sigs
    rows = _changed(forward) if len(forward) else forward
    if not len(rows):
        return findings.empty()
    rank = rows["rank"].to_numpy()
    index, left, right = first_differences(
        pos, [rank, rows["step"].to_numpy(), rows["micro_step"].to_numpy()],
        [rank, rows["ref_step"].to_numpy(), rows["ref_micro"].to_numpy()], tables.forward)
    differs = index >= 0
    rows = rows[differs].assign(rank=rank[differs].astype(np.int64), phase=schema.FORWARD,
                                position=index[differs], unit=_names(tables, left[differs]),
                                target=_names(tables, right[differs]))
    message = ("forward order differs from the rank's first recorded micro-step (step "
               + rows["ref_step"].astype(str)
               + ", micro-step " + rows["ref_micro"].astype(str) + ") at index "
               + rows["position"].astype(str) + ": " + rows["unit"] + " instead of "
               + rows["target"] + "; prefetch wired from one iteration's order will not "
               + "hold for the others")
    return findings.make(NAME, SEVERITY, rows, message)


def _names(tables: RankTables, codes: np.ndarray) -> np.ndarray:
    """Unit names; ``<end>`` where an order had already ended."""
    names = tables.vocab.decode(np.maximum(codes, 0)).astype(str)
    return np.where(codes == ENDED, END, names).astype(object)


def _changed(sigs: pd.DataFrame) -> pd.DataFrame:
    """Forward orders that differ from their rank's first (``rank, step, micro_step``), with
    that first one (``ref_step, ref_micro``): the only orders compared unit by unit."""
    sigs = sigs.sort_values(["rank", "step", "micro_step"], kind="stable")
    rank = sigs["rank"].to_numpy()
    signature = sigs["signature"].to_numpy()
    starts = np.r_[True, rank[1:] != rank[:-1]]
    first = np.maximum.accumulate(np.where(starts, np.arange(len(rank)), 0))
    changed = signature != signature[first]
    return pd.DataFrame({
        "rank": rank[changed], "step": sigs["step"].to_numpy()[changed],
        "micro_step": sigs["micro_step"].to_numpy()[changed],
        "ref_step": sigs["step"].to_numpy()[first[changed]],
        "ref_micro": sigs["micro_step"].to_numpy()[first[changed]]})


CHECK = Check(7, NAME, SEVERITY, PER_RANK, "forward order changes between micro-steps", check)
