"""Facts about units in a step, on code columns: roots, forward begins, gradients received.

Pairwise over rows of another table (a gradient row's rank, step and unit), so a check asks
"did this unit begin forward in that optimizer step?" for every row at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks.columns import fold

if TYPE_CHECKING:
    from fsdptrace.checks.tables import RankTables


def is_root(tables: RankTables, rank: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """Whether each (rank, unit) is a root unit of its rank."""
    units = tables.units
    roots = flag(units["is_root"]) if len(units) else np.zeros(0, dtype=bool)
    asked, known = fold([[rank, units["rank"][roots]], [unit, units["unit"][roots]]])
    return np.isin(asked, known)


def began_forward_in_step(tables: RankTables, rank: np.ndarray, step: np.ndarray,
                          unit: np.ndarray) -> np.ndarray:
    """Whether each unit began forward in some micro-step of that optimizer step on that rank."""
    events = tables.events
    forward = events["phase"] == tables.forward
    asked, ran = fold([[rank, events["rank"][forward]], [step, events["step"][forward]],
                       [unit, events["unit"][forward]]])
    return np.isin(asked, pd.unique(ran))


def received_gradient(tables: RankTables) -> np.ndarray:
    """Per gradients row, whether the parameter held a gradient at the optimizer boundary.

    Version 2 of the contract counts only gradients produced in the step; this is where the
    gradients-received table will answer that once the recorder writes it.
    """
    return flag(tables.gradients["has_grad"])


def flag(values: np.ndarray) -> np.ndarray:
    """A nullable boolean column as a mask (missing counts as False)."""
    if values.dtype == bool:
        return values
    return pd.Series(values).fillna(False).to_numpy(bool)
