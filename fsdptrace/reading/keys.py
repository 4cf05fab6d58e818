"""Multi-column row keys as one int64, so joins over millions of events stay in numpy.

Merging or de-duplicating on several columns, some of them categoricals whose categories
differ between tables (or between ranks), makes pandas factorize or cast to strings row by
row. Here each column becomes small integer codes (categoricals map their few categories,
integers their value range) and the columns fold into one int64 per row; comparing rows is
then ``isin``/``get_indexer`` on one array.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from fsdptrace.store.key_ranges import MAX_MICRO_STEP, MAX_STEP, MICRO_STEP_BITS, STEP_BITS

KEY_LIMIT = 1 << 62  # products of column sizes past this are re-coded densely
# A ``step_key`` holds every (step, micro_step) the reader accepts (``key_ranges``), so no two
# pairs share a key. A ``place_key`` orders stop points: a slot per step (eval interval, then
# the step's passes: one bit more than a step), the micro-step, a phase (forward, backward,
# boundary) and a call position, in 63 bits.
MICRO_STEPS_PER_STEP = MAX_MICRO_STEP + 1
_STEP_KEYS_PER_RANK = (MAX_STEP + 1) * MICRO_STEPS_PER_STEP
_PHASES = 4
_POSITION_BITS = 63 - (STEP_BITS + 1) - MICRO_STEP_BITS - 2
_CALLS_PER_PHASE = 1 << _POSITION_BITS


def step_key(step: Any, micro_step: Any) -> Any:
    """One sortable int64 per (step, micro_step): the only encoding of that pair.

    Takes numpy arrays or pandas Series (or ints) and returns the same kind.
    """
    return _int64(step) * MICRO_STEPS_PER_STEP + _int64(micro_step)


def rank_step_key(rank: Any, step: Any, micro_step: Any) -> Any:
    """One sortable int64 per (rank, step, micro_step), ranks outermost."""
    return _int64(rank) * _STEP_KEYS_PER_RANK + step_key(step, micro_step)


def place_key(kind: Any, step: Any, micro_step: Any, phase_rank: Any, position: Any) -> Any:
    """A sortable int64 for a stop point (``checks.stops``): kind ``pass`` (step, micro_step,
    phase, position), ``eval`` (``step`` the eval interval, ``position`` its index) or
    ``boundary`` (after optimizer step ``step``).

    Step ``k``'s passes come after eval interval ``k`` (which follows boundary ``k - 1``) and
    before boundary ``k``: slot ``2k`` holds eval interval ``k``, slot ``2k + 1`` step ``k``.
    """
    kind = np.asarray(kind, dtype=object)
    step, micro, phase, position = (np.asarray(v).astype(np.int64)
                                    for v in (step, micro_step, phase_rank, position))
    is_eval, is_boundary = kind == "eval", kind == "boundary"
    slot = np.where(is_eval, 2 * step, 2 * step + 1)
    micro = np.where(is_eval, 0, np.where(is_boundary, MICRO_STEPS_PER_STEP - 1, micro))
    phase = np.where(is_eval, 0, np.where(is_boundary, _PHASES - 1, phase))
    position = np.where(is_boundary, _CALLS_PER_PHASE - 1,
                        np.minimum(position, _CALLS_PER_PHASE - 1))
    return ((slot * MICRO_STEPS_PER_STEP + micro) * _PHASES + phase) * _CALLS_PER_PHASE + position


def _int64(values: Any) -> Any:
    if isinstance(values, pd.Series):
        return values.astype("int64")
    if isinstance(values, np.ndarray):
        return values.astype(np.int64, copy=False)
    return int(values)


def _categories(values: pd.Series) -> pd.Index:
    if isinstance(values.dtype, pd.CategoricalDtype):
        return pd.Index(values.cat.categories)
    return pd.Index(pd.unique(values.dropna().to_numpy()))


def _codes_in(values: pd.Series, categories: pd.Index) -> np.ndarray:
    """1-based codes of ``values`` in ``categories``; 0 for missing values."""
    if isinstance(values.dtype, pd.CategoricalDtype):
        mapping = np.append(categories.get_indexer(values.cat.categories), -1)
        return mapping[values.cat.codes.to_numpy()].astype(np.int64) + 1
    return categories.get_indexer(pd.Index(values.to_numpy())).astype(np.int64) + 1


def _is_plain_int(values: pd.Series) -> bool:
    return values.dtype.kind in "iu" and isinstance(values.dtype, np.dtype)


def joint_codes(columns: list[pd.Series]) -> tuple[list[np.ndarray], int]:
    """Codes comparable across ``columns`` (one column of several frames), and their bound."""
    if all(_is_plain_int(c) for c in columns):
        present = [c for c in columns if len(c)]
        low = min((int(c.min()) for c in present), default=0)
        high = max((int(c.max()) for c in present), default=0)
        return [c.to_numpy().astype(np.int64) - low for c in columns], high - low + 1
    first = columns[0]
    same = isinstance(first.dtype, pd.CategoricalDtype) and all(
        isinstance(c.dtype, pd.CategoricalDtype)
        and c.cat.categories.equals(first.cat.categories) for c in columns)
    if same:
        bound = len(first.cat.categories) + 1
        return [c.cat.codes.to_numpy().astype(np.int64) + 1 for c in columns], bound
    categories = _categories(columns[0])
    for column in columns[1:]:
        categories = categories.append(_categories(column)).unique()
    return [_codes_in(c, pd.Index(categories)) for c in columns], len(categories) + 1


def row_keys(frames: list[pd.DataFrame], on: list[str]) -> list[np.ndarray]:
    """One int64 per row of each frame: equal keys exactly when the ``on`` values are equal.

    ``frames`` may name the same column differently: pass them already renamed.
    """
    keys = [np.zeros(len(f), dtype=np.int64) for f in frames]
    bound = 1
    for column in on:
        codes, size = joint_codes([f[column] for f in frames])
        if bound * size >= KEY_LIMIT:
            keys, bound = compress_keys(keys)
        keys = [k * size + c for k, c in zip(keys, codes, strict=True)]
        bound *= size
    return keys


def compress_keys(keys: list[np.ndarray]) -> tuple[list[np.ndarray], int]:
    """Re-code several tables' int64 keys densely (same value, same code), so more fit."""
    codes, uniques = pd.factorize(np.concatenate(keys))
    bounds = np.cumsum([0] + [len(k) for k in keys])
    return [codes[a:b].astype(np.int64) for a, b in zip(bounds[:-1], bounds[1:], strict=True)], \
        len(uniques)


def isin(frame: pd.DataFrame, other: pd.DataFrame, on: list[str]) -> np.ndarray:
    """Boolean mask: rows of ``frame`` whose ``on`` values occur in some row of ``other``."""
    if not len(frame) or not len(other):
        return np.zeros(len(frame), dtype=bool)
    left, right = row_keys([frame, other], on)
    return pd.Index(right).unique().get_indexer(left) >= 0


def group_ids(frame: pd.DataFrame, on: list[str]) -> np.ndarray:
    """Per row, its group's number among the distinct ``on`` values, numbered as they first
    appear: ``frame.groupby(on, sort=False, observed=True).ngroup()`` for columns without
    nulls, without pandas' per-column factorizing (34 -> 4 ms on 500k rows of three columns).

    Event tables come in runs of equal keys (a rank's rows, a pass's rows), so only each
    run's first key is hashed.
    """
    (key,) = row_keys([frame], on)
    if not len(key):
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    ids = pd.factorize(key[starts])[0].astype(np.int64)
    return np.repeat(ids, np.diff(np.r_[starts, len(key)]))


def first_rows(ids: np.ndarray) -> np.ndarray:
    """Each group's first row, for ``group_ids``' numbers (in order of first appearance): a
    group starts where the running maximum grows."""
    if not len(ids):
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.r_[True, ids[1:] > np.maximum.accumulate(ids)[:-1]])


def in_seq_order(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame.sort_values(["rank", "seq"], kind="stable")``, without sorting when the rows are
    in that order already: a rank's rows are written in ``seq`` order and its files read in
    turn, so they nearly always are (the sort was a tenth of the memory ledger on deep ranks).
    """
    if seq_ordered(frame["rank"].to_numpy(), frame["seq"].to_numpy()):
        return frame
    return frame.sort_values(["rank", "seq"], kind="stable")


def seq_ordered(rank: np.ndarray, seq: np.ndarray) -> bool:
    """Whether rows of these ranks and seq numbers are in (rank, seq) order."""
    return bool(((rank[1:] > rank[:-1]) | ((rank[1:] == rank[:-1]) & (seq[1:] >= seq[:-1]))).all())
