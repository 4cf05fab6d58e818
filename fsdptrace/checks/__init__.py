"""The checks of docs/checks.md: pure functions from recorded tables to a findings table.

``REGISTRY`` lists every check (``contract.Check``) in the contract's order. Per-rank checks see
one rank's tables at a time (the map step, and the live option); across-ranks checks see what
the map step kept of every rank (the reduce step).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from fsdptrace.checks import (
    bypassed_unit,
    eval_divergence,
    findings,
    gradient_divergence,
    order_instability,
    pending_all_gather,
    prefetch_config_divergence,
    prefetch_order,
    rank_divergence,
    redundant_prefetch,
    setting_divergence,
    stalled_rank,
    unsharded_excess,
    wasted_prefetch,
)
from fsdptrace.checks.contract import ACROSS_RANKS, PER_RANK, Check
from fsdptrace.checks.kernel.tables import RankTables
from fsdptrace.errors import UsageError

if TYPE_CHECKING:
    import pandas as pd

    from fsdptrace.reading.trace import Trace

REGISTRY: tuple[Check, ...] = (
    prefetch_order.CHECK,
    bypassed_unit.CHECK,
    pending_all_gather.CHECK,
    rank_divergence.CHECK,
    prefetch_config_divergence.CHECK,
    stalled_rank.CHECK,
    order_instability.CHECK,
    wasted_prefetch.CHECK,
    redundant_prefetch.CHECK,
    gradient_divergence.CHECK,
    eval_divergence.CHECK,
    setting_divergence.CHECK,
    unsharded_excess.CHECK,
)
assert [c.number for c in REGISTRY] == sorted(c.number for c in REGISTRY)

CHECKS: dict[str, Check] = {c.name: c for c in REGISTRY}
LIVE_CHECKS = tuple(c.name for c in REGISTRY if c.live)


def resolve(names: list[str] | tuple[str, ...] | None) -> list[str]:
    """Validate check names (or take them all), keeping docs/checks.md's order."""
    if names is None:
        return list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise UsageError(
            f"unknown check {', '.join(unknown)}; known checks: {', '.join(CHECKS)}"
        )
    return [n for n in CHECKS if n in names]


def selected(names: list[str] | tuple[str, ...] | set[str], scope: str) -> list[Check]:
    """The checks named, of one scope (``PER_RANK`` or ``ACROSS_RANKS``), in contract order."""
    return [c for c in REGISTRY if c.name in names and c.scope == scope]


def per_rank_findings(source: Trace | RankTables, names: Iterable[str]) -> pd.DataFrame:
    """The per-rank checks named, on the tables of one or more ranks (also the live path)."""
    tables = source if isinstance(source, RankTables) else RankTables.from_trace(source)
    return findings.combine(check.run_per_rank(tables)
                            for check in selected(set(names), PER_RANK))


__all__ = ["ACROSS_RANKS", "CHECKS", "LIVE_CHECKS", "PER_RANK", "REGISTRY", "Check",
           "per_rank_findings", "resolve", "selected"]
