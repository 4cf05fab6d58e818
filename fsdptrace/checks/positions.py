"""Orders on code columns: positions, first positions, signatures, where each rank stopped.

The numpy counterparts of ``order.with_positions``/``first_positions``/``signatures``, on
``RankTables``: the same results, without a DataFrame per step. Rows are events in (rank,
seq) order; an order is the rows sharing a ``group`` id (rank, step, micro_step, phase).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks.columns import Columns, fold
from fsdptrace.checks.order import GROUP

if TYPE_CHECKING:
    from fsdptrace.checks.tables import RankTables

_MIX = np.uint64(0x9E3779B97F4A7C15)


@dataclass
class Positions:
    """Events of complete orders: ``rows`` index ``events``, in (rank, seq) order."""

    events: Columns
    rows: np.ndarray
    group: np.ndarray
    position: np.ndarray

    def column(self, name: str) -> np.ndarray:
        return self.events[name][self.rows]

    @cached_property
    def first(self) -> np.ndarray:
        """Mask of each unit's first row in its order (a unit's position is its first)."""
        (key,) = fold([[self.group], [self.column("unit")]])
        return ~pd.Index(key).duplicated()

    def frame(self, mask: np.ndarray | None = None) -> pd.DataFrame:
        """Positioned events as ``order.with_positions`` returns them (for findings only)."""
        rows = self.rows if mask is None else self.rows[mask]
        out = self.events.frame(rows)
        out["position"] = self.position if mask is None else self.position[mask]
        return out


def complete_positions(tables: RankTables) -> Positions:
    """Drop stalled ranks' last micro-step (cut off, not run that way), then position."""
    events = tables.events
    rank, step, micro = events["rank"], events["step"], events["micro_step"]
    keep = np.ones(len(events), dtype=bool)
    stalled = set(np.unique(rank).tolist()) - tables.closed
    for r in stalled:  # a handful of ranks at most
        mine = rank == r
        key = step * 1_000_000 + micro
        keep &= ~(mine & (key == key[mine].max()))
    rows = np.flatnonzero(keep)
    seq = events["seq"][rows]
    ranks = rank[rows]
    if len(rows) > 1 and not bool(((ranks[1:] > ranks[:-1])
                                   | ((ranks[1:] == ranks[:-1]) & (seq[1:] > seq[:-1]))).all()):
        rows = rows[np.lexsort((seq, ranks))]
    (key,) = fold([[events[c][rows]] for c in GROUP])
    group = pd.factorize(key)[0].astype(np.int64)
    return Positions(events, rows, group, _cumcount(group))


def _cumcount(group: np.ndarray) -> np.ndarray:
    """Rank of each row within its group; one pass when every group is one contiguous run."""
    n = len(group)
    starts = np.ones(n, dtype=bool)
    starts[1:] = group[1:] != group[:-1]
    if n == 0 or int(starts.sum()) == int(group.max()) + 1:
        index = np.arange(n, dtype=np.int64)
        return index - np.maximum.accumulate(np.where(starts, index, 0))
    order = np.argsort(group, kind="stable")
    out = np.empty(n, dtype=np.int64)
    out[order] = _cumcount(group[order])
    return out


def signatures(positions: Positions, vocab_names: list[str]) -> pd.DataFrame:
    """``order.signatures`` of the positioned rows: one hash per order, and its length."""
    if not len(positions.rows):
        return pd.DataFrame(columns=GROUP + ["signature", "length"])
    names = np.array(vocab_names + ["nan"], dtype=object)
    per_name = pd.util.hash_array(names)
    unit = positions.column("unit")
    unit_hash = per_name[np.where(unit < 0, len(vocab_names), unit)]
    mixed = pd.util.hash_array(unit_hash ^ (positions.position.astype(np.uint64) * _MIX))
    (key,) = fold([[positions.column(c)] for c in GROUP])
    codes, uniques = pd.factorize(key, sort=True)
    order = np.argsort(codes, kind="stable")
    starts = np.flatnonzero(np.r_[True, codes[order][1:] != codes[order][:-1]])
    sums = np.add.reduceat(mixed.astype(np.uint64)[order], starts)
    first = order[starts]
    out = positions.events.frame(positions.rows[first])[GROUP]
    out["signature"] = sums.astype(np.uint64)
    out["length"] = np.diff(np.r_[starts, len(codes)]).astype(np.int64)
    return out


def last_positions(events: Columns) -> pd.DataFrame:
    """``stalled_rank.last_positions``: per rank, the last unit entered and its position."""
    if not len(events):
        return pd.DataFrame(columns=GROUP + ["unit", "position", "t_ns"])
    rank, seq = events["rank"], events["seq"]
    ranks = np.unique(rank)
    last = np.array([np.flatnonzero(rank == r)[np.argmax(seq[rank == r])] for r in ranks])
    (key, last_key) = fold([[events[c], events[c][last]] for c in GROUP])
    counts = np.array([int((key == k).sum()) for k in last_key])
    out = events.frame(last)[GROUP + ["unit", "t_ns"]]
    out["rank"] = out["rank"].astype("int64")
    out["phase"] = out["phase"].astype(str)
    out["unit"] = out["unit"].astype(str)
    out["position"] = counts - 1
    return out[GROUP + ["unit", "position", "t_ns"]].reset_index(drop=True)
