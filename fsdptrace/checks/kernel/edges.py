"""Prefetch edges in effect at each call: which targets a unit was configured to prefetch.

The recorder snapshots the edges when they change; an order uses the latest snapshot of its
rank taken at or before its (step, micro_step). On code columns, since the offline analyzer
pairs millions of calls with their edges and the live option does it before every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fsdptrace.checks.kernel.columns import fold
from fsdptrace.reading.keys import step_key

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.positions import Positions
    from fsdptrace.checks.kernel.tables import RankTables


def edges_in_effect(tables: RankTables, calls: Positions, picked: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Each picked call (an index into ``calls``) paired with every target its unit was
    configured to prefetch in that phase then: ``(call, target)``, target as a vocab code.

    A call whose unit had no edges in effect appears in no pair; one with several, in several.
    """
    prefetch = tables.prefetch
    if not len(prefetch) or not len(picked):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    has_target = prefetch["target"] >= 0
    snapshot = _snapshot_of_pass(tables, calls)
    edge_pass, order_pass = fold([[snapshot.edge[has_target], snapshot.order],
                                  [prefetch["phase"][has_target], snapshot.phase]])
    edge_key, call_key = fold([[edge_pass, order_pass[calls.group[picked]]],
                               [prefetch["unit"][has_target], calls.column("unit")[picked]]])
    call, edge = _matches(edge_key, call_key)
    return picked[call], prefetch["target"][has_target][edge]


class _Snapshots:
    """Per prefetch row its snapshot id; per pass of ``calls``, the id in effect and phase."""

    def __init__(self, edge: np.ndarray, order: np.ndarray, phase: np.ndarray) -> None:
        self.edge, self.order, self.phase = edge, order, phase


def _snapshot_of_pass(tables: RankTables, calls: Positions) -> _Snapshots:
    """Looked up once per pass (not per call): the rank's latest snapshot at or before it."""
    prefetch = tables.prefetch
    first_call = np.zeros(int(calls.group.max()) + 1, dtype=np.int64)
    first_call[calls.group] = np.arange(len(calls.group))
    rank = calls.column("rank")[first_call]
    when = step_key(calls.column("step")[first_call], calls.column("micro_step")[first_call])
    snap_key, pass_key = fold([[prefetch["rank"], rank],
                               [step_key(prefetch["step"], prefetch["micro_step"]), when]])
    snaps, first = np.unique(snap_key, return_index=True)
    found = np.searchsorted(snaps, pass_key, side="right") - 1
    same_rank = prefetch["rank"][first][np.maximum(found, 0)] == rank
    in_effect = np.where((found >= 0) & same_rank, found, -1)
    return _Snapshots(np.searchsorted(snaps, snap_key), in_effect,
                      calls.column("phase")[first_call])


def _matches(edge_key: np.ndarray, call_key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (call, edge) index pair with equal keys."""
    order = np.argsort(edge_key, kind="stable")
    sorted_keys = edge_key[order]
    lo = np.searchsorted(sorted_keys, call_key, side="left")
    counts = np.searchsorted(sorted_keys, call_key, side="right") - lo
    if not len(counts) or counts.max() <= 1:  # the usual case: at most one edge per call
        call = np.flatnonzero(counts)
        return call, order[lo[call]]
    call = np.repeat(np.arange(len(call_key)), counts)
    within = np.arange(len(call)) - np.repeat(np.cumsum(counts) - counts, counts)
    return call, order[np.repeat(lo, counts) + within]
