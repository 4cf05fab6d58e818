"""What a check is: a number and name from docs/checks.md, a severity, a scope, a function.

A per-rank check reads one rank's tables (``RankTables``: the map step, and the live option
before ``optimizer.step()``); an across-ranks check reads what the map step kept of every rank
(``Merged``: the reduce step). Adding a check is one module exporting ``CHECK`` plus its line in
the registry (``fsdptrace.checks.REGISTRY``); an across-ranks check that needs its own part of
each rank names a ``summarize`` function, which the map step runs for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables

PER_RANK = "per-rank"
ACROSS_RANKS = "across-ranks"


@dataclass(frozen=True, kw_only=True)
class Kept:
    """What the map step keeps of ranks for the across-ranks checks: of one batch of ranks in
    the map step's ``RankSummary``, of every rank, concatenated, in ``Merged``."""

    signatures: pd.DataFrame  # order signatures as runs of ranks (``kernel.rank_runs``)
    config_signatures: pd.DataFrame
    unit_sets: pd.DataFrame
    # Per rank, its parameter names hashed and its unit names (``kernel.order.param_sets``):
    # a model wrapped in other units on some ranks (the hang verdict's cause).
    param_sets: pd.DataFrame
    last: pd.DataFrame
    ends: pd.DataFrame
    meta: pd.DataFrame
    # Where each rank's writer lost rows (``reading.incomplete.COLUMNS``): what no check
    # looked at, and what the hang verdict must not read as a rank skipping a pass.
    incomplete: pd.DataFrame
    ranks: list[int]
    # Per across-ranks check with a ``summarize``: what it keeps of each rank.
    summaries: dict[str, pd.DataFrame] = field(default_factory=dict)


# The frames of ``Kept``: what the reduce step concatenates rank after rank.
KEPT_FRAMES = tuple(f.name for f in fields(Kept) if f.name not in ("ranks", "summaries"))


@dataclass(frozen=True, kw_only=True)
class Merged(Kept):
    """Every rank's map-step summaries, concatenated, for the across-ranks checks.

    ``fetch_orders(ranks, wanted)`` re-reads the positioned orders of the ``wanted`` passes;
    ``fetch_prefetch(ranks)`` the prefetch edges of ``ranks``: only what a finding spells out.
    """

    fetch_orders: Callable[[list[int], pd.DataFrame], pd.DataFrame]
    fetch_prefetch: Callable[[list[int]], pd.DataFrame]
    # The errors of the cross-rank checks the hang verdict reads as causes (check 6), when the
    # reduce step ran them already; None: the verdict runs them itself.
    divergences: pd.DataFrame | None = None


@dataclass(frozen=True)
class Check:
    """One check of docs/checks.md. ``run`` takes ``RankTables`` (per-rank) or ``Merged``
    (across-ranks) and returns a findings table (``fsdptrace.checks.findings``)."""

    number: int
    name: str
    severity: str
    scope: str
    summary: str
    run: Callable[[Any], pd.DataFrame]
    live: bool = False  # also run before optimizer.step() when raising is enabled
    # Across-ranks checks that read more than ``Merged``'s shared summaries: what the map step
    # keeps of one rank for this check (``Merged.summaries[name]`` in the reduce step).
    summarize: Callable[[RankTables], pd.DataFrame] | None = None

    def run_per_rank(self, tables: RankTables) -> pd.DataFrame:
        assert self.scope == PER_RANK, self.name
        return self.run(tables)

    def run_across_ranks(self, merged: Merged) -> pd.DataFrame:
        assert self.scope == ACROSS_RANKS, self.name
        return self.run(merged)
