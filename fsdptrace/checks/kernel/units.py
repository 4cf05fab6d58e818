"""Facts about units in a step, on code columns: roots, forward begins, gradients received.

Pairwise over rows of another table (a gradient row's rank, step and unit), so a check asks
"did this unit begin forward in that optimizer step?" for every row at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks.kernel.columns import fold

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables


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


def received_gradient(tables: RankTables, rows: np.ndarray) -> np.ndarray:
    """For the gradients rows at positions ``rows``, whether the parameter received a gradient
    during its optimizer step.

    A gradient held at the boundary counts only if it was written in the step (``grads_written``):
    ``zero_grad(set_to_none=False)`` leaves zero-filled buffers that nothing of the step wrote.
    Where a (rank, step) has no ``grads_written`` rows (older run dirs, a step whose start was
    not recorded), holding a gradient is all there is to go on. Asked for a few rows (the
    candidates of a check), only the written rows of their (rank, step)s are compared.
    """
    grads, written = tables.gradients, tables.grads_written
    held = flag(grads["has_grad"][rows])
    if written is None or not len(written):
        return held
    rank, step = grads["rank"][rows], grads["step"][rows]
    asked, known = fold([[rank, written["rank"]], [step, written["step"]]])
    unknown_step = ~np.isin(asked, known)
    fresh = flag(written["written"]) & np.isin(known, asked)
    # Labels are plain text (not vocab codes): one hash pass codes both tables' at once.
    labels, _ = pd.factorize(np.concatenate([grads["param"][rows], written["param"][fresh]]))
    asked, wrote = fold([[rank, written["rank"][fresh]], [step, written["step"][fresh]],
                         [grads["unit"][rows], written["unit"][fresh]],
                         [labels[:len(rows)], labels[len(rows):]]])
    return held & (unknown_step | np.isin(asked, wrote))


def flag(values: np.ndarray) -> np.ndarray:
    """A nullable boolean column as a mask (missing counts as False)."""
    if values.dtype == bool:
        return values
    return pd.Series(values).fillna(False).to_numpy(bool)
