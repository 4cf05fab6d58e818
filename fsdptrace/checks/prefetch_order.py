"""Check 1, prefetch-order: a configured target that did not run, or ran before its source."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.columns import fold, lookup
from fsdptrace.checks.order import GROUP

if TYPE_CHECKING:
    from fsdptrace.checks.positions import Positions
    from fsdptrace.checks.tables import RankTables

NAME = "prefetch-order"
SEVERITY = findings.ERROR
_KEY_SCALE = 1_000_000


def check(events: pd.DataFrame, prefetch: pd.DataFrame, markers: pd.DataFrame) -> pd.DataFrame:
    """Every executed source's configured targets, against the order units began."""
    from fsdptrace.checks.tables import RankTables

    return check_tables(RankTables.from_frames(events=events, prefetch=prefetch,
                                               markers=markers))


def check_tables(tables: RankTables) -> pd.DataFrame:
    """``check`` on code columns: the live and offline path (pandas only for findings)."""
    prefetch = tables.prefetch
    has_target = prefetch["target"] >= 0 if len(prefetch) else np.zeros(0, dtype=bool)
    pos = tables.complete
    if not len(pos.rows) or not has_target.any():
        return findings.empty()
    sources = pos.rows[pos.first]
    group, position = pos.group[pos.first], pos.position[pos.first]
    source, edge = _pairs(tables, pos, sources, group, has_target)
    target = prefetch["target"][has_target][edge]
    have, want = fold([[group, group[source]], [tables.events["unit"][sources], target]])
    found = lookup(have, want)
    target_position = np.where(found >= 0, position[np.maximum(found, 0)], -1)
    missing = found < 0
    flagged = missing | (target_position <= position[source])
    if not flagged.any():
        return findings.empty()
    rows = tables.events.frame(sources[source[flagged]])[GROUP + ["unit"]].assign(
        position=position[source[flagged]], target=tables.vocab.decode(target[flagged]),
        target_position=target_position[flagged])
    rows = rows.assign(rank=rows["rank"].astype("int64"), unit=rows["unit"].astype(str),
                       phase=rows["phase"].astype(str), target=rows["target"].astype(str))
    is_missing = missing[flagged]
    return findings.combine([_missing(rows[is_missing]), _early(rows[~is_missing])])


def _pairs(tables: RankTables, pos: Positions, sources: np.ndarray, group: np.ndarray,
           has_target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, edge) index pairs: each executed source with its configured edges then.

    An order uses the latest snapshot taken at or before its (step, micro_step) on its rank;
    that is looked up once per order, not per source.
    """
    events, prefetch = tables.events, tables.prefetch
    rep = np.zeros(int(pos.group.max()) + 1, dtype=np.int64)
    rep[pos.group] = pos.rows
    snap_key, order_key = fold([
        [prefetch["rank"], events["rank"][rep]],
        [prefetch["step"] * _KEY_SCALE + prefetch["micro_step"],
         events["step"][rep] * _KEY_SCALE + events["micro_step"][rep]]])
    snaps, first = np.unique(snap_key, return_index=True)
    found = np.searchsorted(snaps, order_key, side="right") - 1
    same_rank = prefetch["rank"][first][np.maximum(found, 0)] == events["rank"][rep]
    order_snap = np.where((found >= 0) & same_rank, found, -1)
    edge_pass, order_pass = fold([[np.searchsorted(snaps, snap_key[has_target]), order_snap],
                                  [prefetch["phase"][has_target], events["phase"][rep]]])
    edge_key, source_key = fold([[edge_pass, order_pass[group]],
                                 [prefetch["unit"][has_target], events["unit"][sources]]])
    order, lo, counts = _ranges(edge_key, source_key)
    if not len(counts) or counts.max() <= 1:  # the usual case: at most one edge per source
        source = np.flatnonzero(counts)
        return source, order[lo[source]]
    source = np.repeat(np.arange(len(sources)), counts)
    within = np.arange(len(source)) - np.repeat(np.cumsum(counts) - counts, counts)
    return source, order[np.repeat(lo, counts) + within]


def _ranges(edge_key: np.ndarray, source_key: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Edges sorted by key, and per source the first sorted edge with its key and how many."""
    order = np.argsort(edge_key, kind="stable")
    size = max(int(edge_key.max()), int(source_key.max())) + 1 if len(source_key) else 0
    if size and size <= 4 * len(source_key) + 4096:
        per_key = np.bincount(edge_key, minlength=size)
        first = np.cumsum(per_key) - per_key
        return order, first[source_key], per_key[source_key]
    lo = np.searchsorted(edge_key[order], source_key, side="left")
    return order, lo, np.searchsorted(edge_key[order], source_key, side="right") - lo


def _missing(rows: pd.DataFrame) -> pd.DataFrame:
    if not len(rows):
        return findings.empty()
    message = (rows["unit"] + " prefetched " + rows["target"] + ", but " + rows["target"]
               + " did not execute in " + rows["phase"] + ": the all-gather is wasted and held; "
               + "remove " + rows["target"] + " from " + rows["unit"] + "'s " + rows["phase"]
               + " prefetch targets")
    return findings.make(NAME, SEVERITY, rows, message)


def _early(rows: pd.DataFrame) -> pd.DataFrame:
    if not len(rows):
        return findings.empty()
    position = rows["position"].astype("int64").astype(str)
    target_position = rows["target_position"].astype("int64").astype(str)
    message = (rows["unit"] + " prefetched " + rows["target"] + " at positions " + position
               + "->" + target_position + " in " + rows["phase"] + ": the target had already run, "
               + "so the prefetch is useless or gathers for the next pass; prefetch the unit "
               + "that runs after " + rows["unit"] + " instead (see fsdptrace suggest)")
    return findings.make(NAME, SEVERITY, rows, message)
