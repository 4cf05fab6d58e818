"""Orders on code columns: positions, first positions, signatures.

Every call kept, in order, per pass (a unit's first and last call are masks), and the order
signatures the cross-rank comparison starts from. Rows are
events in (rank, seq) order; an order is the rows sharing a ``group`` id (rank, step,
micro_step, phase).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks.kernel.columns import Columns, distinct_ranks, first_mask, fold, lookup
from fsdptrace.checks.kernel.order import GROUP
from fsdptrace.reading import incomplete
from fsdptrace.reading.keys import step_key

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.rank_view import RankView

_MIX = np.uint64(0x9E3779B97F4A7C15)

# The unit code ``first_differences`` gives past an order's end (``order.END`` by name).
ENDED = -2
# The tables ``complete_positions`` reads: the events, and where a rank did not close, where
# it stopped (``stops.stop_points``: its last pass, eval forward or optimizer step). A reader
# that hands it fewer cuts off passes that ran whole (a rank hung in an eval forward).
COMPLETE_READS = ("events", "markers", "eval_forwards")


@dataclass
class Positions:
    """Events of complete orders: ``rows`` index ``events``, in (rank, seq) order."""

    events: Columns
    rows: np.ndarray
    group: np.ndarray
    position: np.ndarray
    identity: bool = False  # rows is every event in stored order: columns need no copy

    def column(self, name: str) -> np.ndarray:
        return self.events[name] if self.identity else self.events[name][self.rows]

    @cached_property
    def _call_key(self) -> np.ndarray:
        (key,) = fold([[self.group], [self.column("unit")]])
        return key

    @cached_property
    def first(self) -> np.ndarray:
        """Mask of each unit's first call in its pass."""
        return first_mask(self._call_key)

    @cached_property
    def last(self) -> np.ndarray:
        """Mask of each unit's last call in its pass."""
        return first_mask(self._call_key[::-1])[::-1]

    def first_calls(self) -> np.ndarray:
        """Indices of each unit's first call in each pass."""
        return np.flatnonzero(self.first)

    def last_call_positions(self, group: np.ndarray, unit: np.ndarray) -> np.ndarray:
        """Position of ``unit``'s last call in pass ``group`` (pairwise), or -1 if it made none."""
        last = np.flatnonzero(self.last)
        have, want = fold([[self.group[last], group], [self.column("unit")[last], unit]])
        found = lookup(have, want)
        return np.where(found >= 0, self.position[last][np.maximum(found, 0)], -1)

    def frame(self, mask: np.ndarray | None = None) -> pd.DataFrame:
        """Positioned events as a frame, names decoded (for findings and suggestions only)."""
        rows = self.rows if mask is None else self.rows[mask]
        out = self.events.frame(rows)
        out["position"] = self.position if mask is None else self.position[mask]
        return out


def complete_positions(tables: RankView) -> Positions:
    """Position the complete orders only: the pass each stalled rank stopped in is cut off,
    and micro-steps the writer lost events from are gaps, not orders the job ran."""
    events = tables.events
    keep = _complete_rows(tables)
    rows = np.arange(len(events)) if keep is None else np.flatnonzero(keep)
    seq, ranks = events["seq"][rows], events["rank"][rows]
    one_rank = len(distinct_ranks(ranks)) <= 1
    in_order = len(rows) < 2 or bool(
        (seq[1:] > seq[:-1]).all() if one_rank
        else ((ranks[1:] > ranks[:-1]) | ((ranks[1:] == ranks[:-1]) & (seq[1:] > seq[:-1]))).all())
    if not in_order:
        rows = rows[np.lexsort((seq, ranks))]
    positions = Positions(events, rows, np.zeros(0, np.int64), np.zeros(0, np.int64),
                          identity=in_order and keep is None)
    (key,) = fold([[positions.column(c)] for c in GROUP])
    positions.group, positions.position = _group_positions(key)
    return positions


def _complete_rows(tables: RankView) -> np.ndarray | None:
    """Mask of events in complete orders, or None when every event is (the usual case)."""
    from fsdptrace.checks.kernel.stops import cut_off_passes

    events = tables.events
    rank, step, micro = events["rank"], events["step"], events["micro_step"]
    stalled = set(distinct_ranks(rank)) - tables.closed
    if not stalled and not len(tables.incomplete):
        return None
    keep = ~incomplete.in_micro_steps(tables.incomplete, ("events",), rank, step, micro)
    key = step_key(step, micro)
    for cut in cut_off_passes(tables).itertuples(index=False):  # a handful of ranks at most
        phase = tables.vocab.code(cut.phase)
        keep &= ~((rank == cut.rank) & (key == step_key(cut.step, cut.micro_step))
                  & (events["phase"] == phase))
    return None if keep.all() else keep


def _group_positions(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense group ids and each row's rank within its group.

    An order is normally one contiguous run of rows: then the run is the group and one pass
    does; otherwise (interleaved orders) fall back to hashing and a stable sort.
    """
    n = len(key)
    starts = np.ones(n, dtype=bool)
    starts[1:] = key[1:] != key[:-1]
    run_starts = np.flatnonzero(starts)
    index = np.arange(n, dtype=np.int64)
    if len(pd.unique(key[run_starts])) == len(run_starts):
        run = np.cumsum(starts) - 1
        return run, index - run_starts[run]
    group = pd.factorize(key)[0].astype(np.int64)
    order = np.argsort(group, kind="stable")
    return group, _group_positions(group[order])[1][np.argsort(order)]


def signatures(positions: Positions, vocab_names: list[str]) -> pd.DataFrame:
    """One order-sensitive 64-bit hash per (rank, step, micro_step, phase), and its length.

    Hashes the unit *names* (not codes), so ranks whose vocabularies differ still agree; the
    position is mixed in so that order matters.
    """
    if not len(positions.rows):
        return pd.DataFrame(columns=GROUP + ["signature", "length"])
    names = np.array(vocab_names + ["nan"], dtype=object)
    per_name = pd.util.hash_array(names)
    unit = positions.column("unit")
    unit_hash = per_name[np.where(unit < 0, len(vocab_names), unit)]
    mixed = pd.util.hash_array(unit_hash ^ (positions.position.astype(np.uint64) * _MIX))
    group = positions.group
    order = np.argsort(group, kind="stable")
    starts = np.flatnonzero(np.r_[True, group[order][1:] != group[order][:-1]])
    sums = np.add.reduceat(mixed.astype(np.uint64)[order], starts)
    counts = np.diff(np.r_[starts, len(group)])
    first = order[starts]
    # Rows sorted like (rank, step, micro_step, phase) keys, whatever order groups ran in.
    (key,) = fold([[positions.column(c)[first]] for c in GROUP])
    by_key = np.argsort(key, kind="stable")
    sums, counts, first = sums[by_key], counts[by_key], first[by_key]
    out = positions.events.frame(positions.rows[first])[GROUP]
    out["signature"] = sums.astype(np.uint64)
    out["length"] = counts.astype(np.int64)
    return out


def first_differences(pos: Positions, left: list[np.ndarray], right: list[np.ndarray],
                      phase: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pair of orders given as (rank, step, micro_step) columns in ``phase``: the first
    index where their units differ (-1: none) and the unit codes there (``ENDED``: that order
    had ended; ``order.first_difference`` on frames, ``order.first_difference_of`` on lists)."""
    group = pos.group
    rep = np.zeros(int(group.max()) + 1 if len(group) else 0, dtype=np.int64)
    rep[group] = np.arange(len(group))
    phases = np.full(len(left[0]), phase, dtype=np.int64)
    columns = [pos.column(c)[rep] for c in GROUP]
    have, left_key, right_key = fold([[columns[i], left[i], right[i]] for i in range(3)]
                                     + [[columns[3], phases, phases]])
    order = np.argsort(group, kind="stable")
    lengths = np.bincount(group, minlength=len(rep))
    starts = np.cumsum(lengths) - lengths
    units = pos.column("unit")[order]

    def matrix(key: np.ndarray, width: int) -> np.ndarray:
        found = lookup(have, key)
        length = np.where(found >= 0, lengths[np.maximum(found, 0)], 0)
        cells = starts[np.maximum(found, 0)][:, None] + np.arange(width)
        valid = np.arange(width) < length[:, None]
        return np.where(valid, units[np.minimum(cells, max(len(units) - 1, 0))], ENDED)

    width = int(lengths.max()) + 1 if len(lengths) else 1
    lhs, rhs = matrix(left_key, width), matrix(right_key, width)
    differ = lhs != rhs
    index = np.argmax(differ, axis=1)
    picked = np.arange(len(index))
    return (np.where(differ.any(axis=1), index, -1), lhs[picked, index], rhs[picked, index])
