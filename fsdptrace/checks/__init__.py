"""The checks of CHECKS.md: pure functions from recorded tables to a findings table.

Per-rank checks (1, 2, 3, 7, 8, 9) see one rank's tables at a time; cross-rank checks (4, 5, 6) see
the small per-rank summaries the map step produces. The same functions serve the offline
analyzer and the live option.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdptrace.checks import (
    bypassed_unit,
    order_instability,
    pending_all_gather,
    prefetch_config_divergence,
    prefetch_order,
    rank_divergence,
    redundant_prefetch,
    stalled_rank,
    wasted_prefetch,
)
from fsdptrace.errors import UsageError


@dataclass(frozen=True)
class CheckInfo:
    number: int
    name: str
    severity: str
    per_rank: bool
    summary: str


CHECKS: dict[str, CheckInfo] = {
    info.name: info
    for info in (
        CheckInfo(1, prefetch_order.NAME, prefetch_order.SEVERITY, True,
                  "prefetch target missing or out of order"),
        CheckInfo(2, bypassed_unit.NAME, bypassed_unit.SEVERITY, True,
                  "child unit bypassed, yet its parameters got gradients"),
        CheckInfo(3, pending_all_gather.NAME, pending_all_gather.SEVERITY, True,
                  "all-gather still pending at the optimizer boundary"),
        CheckInfo(4, rank_divergence.NAME, rank_divergence.SEVERITY, False,
                  "ranks ran units in different orders"),
        CheckInfo(5, prefetch_config_divergence.NAME, prefetch_config_divergence.SEVERITY,
                  False, "ranks configured different prefetch edges"),
        CheckInfo(6, stalled_rank.NAME, stalled_rank.SEVERITY, False,
                  "rank stopped without a clean close, or missing"),
        CheckInfo(7, order_instability.NAME, order_instability.SEVERITY, True,
                  "forward order changes between micro-steps"),
        CheckInfo(8, wasted_prefetch.NAME, wasted_prefetch.SEVERITY, True,
                  "prefetched all-gather not used by its target in that pass"),
        CheckInfo(9, redundant_prefetch.NAME, redundant_prefetch.SEVERITY, True,
                  "prefetch of a unit already gathered or pending (no-op)"),
    )
}

LIVE_CHECKS = (prefetch_order.NAME, bypassed_unit.NAME, pending_all_gather.NAME)


def resolve(names: list[str] | tuple[str, ...] | None) -> list[str]:
    """Validate check names (or take them all), keeping CHECKS.md's order."""
    if names is None:
        return list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise UsageError(
            f"unknown check {', '.join(unknown)}; known checks: {', '.join(CHECKS)}"
        )
    return [n for n in CHECKS if n in names]
