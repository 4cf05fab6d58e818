"""Tables as numpy columns of integer codes, so the per-rank checks skip pandas' per-call cost.

A pandas operation costs tens to hundreds of microseconds before it touches a row, and a
DataFrame built from Arrow copies every column. The live option runs the checks on a few
hundred rows before every optimizer step, and the analyzer on millions per rank: both want
plain arrays. Strings (unit names, phases, targets) become codes into one ``Vocab`` shared by
all tables of a check run, so comparing a unit across tables is comparing ints. Findings are
rare: ``Columns.frame`` rebuilds a pandas frame of just the rows a check reports.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from fsdptrace.reading.keys import KEY_LIMIT, compress_keys


class Vocab:
    """Every string the tables hold, numbered once: equal names get equal codes."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._codes: dict[str, int] = {}

    def code(self, name: str) -> int:
        found = self._codes.get(name)
        if found is None:
            found = self._codes[name] = len(self.names)
            self.names.append(name)
        return found

    def codes(self, names: Sequence[Any]) -> np.ndarray:
        """Codes of ``names`` (a dictionary or a column); -1 for missing values.

        Known names take one dict lookup each; new and missing ones the slow way.
        """
        get = self._codes.get
        out = np.fromiter((get(n, -2) if type(n) is str else -1 if n is None else -2
                           for n in names),
                          dtype=np.int64, count=len(names))
        for i in np.flatnonzero(out == -2).tolist():
            name = names[i]
            out[i] = -1 if _is_null(name) else self.code(str(name))
        return out

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """Names as an object array, NaN for -1 (what a categorical's ``astype(object)`` holds)."""
        table = np.array(self.names + [np.nan], dtype=object)
        return table[np.where(codes < 0, len(self.names), codes)]


def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)


class Columns:
    """One table as ``{column: ndarray}``; ``coded`` columns hold ``Vocab`` codes."""

    def __init__(self, data: dict[str, np.ndarray], coded: set[str], vocab: Vocab,
                 num_rows: int) -> None:
        self.data, self.coded, self.vocab, self.num_rows = data, coded, vocab, num_rows

    def __getitem__(self, column: str) -> np.ndarray:
        return self.data[column]

    def __len__(self) -> int:
        return self.num_rows

    def frame(self, rows: np.ndarray | None = None) -> pd.DataFrame:
        """The rows as a pandas frame with names decoded (only for what a check reports)."""
        out = {}
        for name, values in self.data.items():
            picked = values if rows is None else values[rows]
            out[name] = self.vocab.decode(picked) if name in self.coded else picked
        return pd.DataFrame(out)

    @classmethod
    def from_arrow(cls, table: pa.Table, vocab: Vocab, coded_strings: Sequence[str] = ()
                   ) -> Columns:
        """Dictionary columns become codes (their few distinct names looked up once).

        ``coded_strings``: plain string columns to code too (small tables only: row by row).
        """
        data, coded = {}, set()
        for name in table.column_names:
            column = table.column(name)
            if pa.types.is_dictionary(column.type):
                data[name] = _dictionary_codes(column, vocab)
                coded.add(name)
            elif name in coded_strings:
                data[name] = vocab.codes(column.to_pylist())
                coded.add(name)
            elif pa.types.is_integer(column.type) and column.null_count == 0:
                data[name] = column.to_numpy().astype(np.int64, copy=False)
            else:
                data[name] = column.to_numpy(zero_copy_only=False)
        return cls(data, coded, vocab, table.num_rows)

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, vocab: Vocab, coded: Sequence[str]) -> Columns:
        """``coded`` columns (categorical or not) become codes; integers become int64."""
        data, done = {}, set()
        for name in frame.columns:
            values = frame[name]
            if name in coded:
                data[name] = _frame_codes(values, vocab)
                done.add(name)
            elif values.dtype.kind in "iu" and isinstance(values.dtype, np.dtype):
                data[name] = values.to_numpy().astype(np.int64, copy=False)
            elif not len(values):
                # An empty table's columns may be untyped (object): as ints they fold as keys.
                data[name] = np.zeros(0, dtype=np.int64)
            else:
                data[name] = values.to_numpy()
        return cls(data, done, vocab, len(frame))

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[Any]], names: Sequence[str], vocab: Vocab,
                  coded: Sequence[str], rank: int) -> Columns:
        """A recorder's row tuples (small tables: units, edges, gradients) plus ``rank``."""
        data: dict[str, np.ndarray] = {"rank": np.full(len(rows), rank, dtype=np.int64)}
        for i, name in enumerate(names):
            values = [row[i] for row in rows]
            if name in coded:
                data[name] = vocab.codes(values)
            else:
                data[name] = _plain(values)
        return cls(data, set(coded) & set(names), vocab, len(rows))


def _plain(values: list[Any]) -> np.ndarray:
    if values and all(type(v) is int for v in values):
        return np.array(values, dtype=np.int64)
    if values and all(type(v) is bool for v in values):
        return np.array(values, dtype=bool)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _dictionary_codes(column: pa.ChunkedArray, vocab: Vocab) -> np.ndarray:
    parts = []
    for chunk in column.chunks:
        mapping = np.append(vocab.codes(chunk.dictionary.to_pylist()), -1)
        indices = chunk.indices
        if indices.null_count:
            indices = indices.fill_null(-1)
        indices = indices.to_numpy()
        parts.append(mapping[indices])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _frame_codes(values: pd.Series, vocab: Vocab) -> np.ndarray:
    if isinstance(values.dtype, pd.CategoricalDtype):
        categories, codes = values.cat.categories, values.cat.codes.to_numpy()
    else:
        codes, categories = pd.factorize(values.to_numpy())
    mapping = np.append(vocab.codes(list(categories)), -1)
    return mapping[codes.astype(np.int64)]


def fold(columns: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """Several int columns into one int64 key per row; ``columns[i]`` may hold several parts.

    Each item of ``columns`` is a list-like of arrays (one per table) that share a key space:
    equal keys exactly when all columns are equal. Returns one key array per table.
    """
    num_tables = len(columns[0])
    keys: list[np.ndarray] | None = None
    bound = 1
    for parts in columns:
        present = [p for p in parts if len(p)]
        low = min((int(p.min()) for p in present), default=0)
        size = max((int(p.max()) for p in present), default=0) - low + 1
        if keys is None:
            # In place from here on: these arrays are as long as the events.
            keys = [np.subtract(p, low, dtype=np.int64) for p in parts]
            bound = size
            continue
        if bound * size >= KEY_LIMIT:
            keys, bound = compress_keys(keys)
        for i in range(num_tables):
            keys[i] *= size
            keys[i] += parts[i]
            if low:
                keys[i] -= low
        bound *= size
    assert keys is not None, "fold needs at least one column"
    return keys


def _dense(keys: np.ndarray, *others: np.ndarray) -> int:
    """A dense table's size for these non-negative keys, or 0 when it would be too sparse."""
    bound = max((int(k.max()) + 1 for k in (keys, *others) if len(k)), default=0)
    return bound if bound <= 4 * len(keys) + 4096 else 0


def first_mask(key: np.ndarray) -> np.ndarray:
    """Mask of each key's first row (``~duplicated``): a dense table when keys are compact."""
    size = _dense(key)
    if not size:
        return ~pd.Index(key).duplicated()
    index = np.arange(len(key), dtype=np.int64)
    first = np.full(size, len(key), dtype=np.int64)
    np.minimum.at(first, key, index)
    return first[key] == index


def lookup(have: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Row of ``have`` (unique keys) holding each ``want`` key, or -1."""
    size = _dense(have, want)
    if not size:
        return pd.Index(have).get_indexer(want)
    table = np.full(size, -1, dtype=np.int64)
    table[have] = np.arange(len(have), dtype=np.int64)
    return table[want]


def distinct_ranks(rank: np.ndarray) -> list[int]:
    """Distinct ranks, sorted; the map step holds one, so that case skips hashing."""
    if not len(rank):
        return []
    low, high = int(rank.min()), int(rank.max())
    return [low] if low == high else sorted(pd.unique(rank).tolist())


def empty_frame(dtypes: dict[str, str]) -> pd.DataFrame:
    """A frame of no rows with ``dtypes``'s columns, in its order. Built once per set of
    columns (and text storage) and copied: building one costs about 1.2 ms and a copy 0.05,
    and a check's summary of a rank without rows, or of no rank, asks for one on every
    analysis."""
    return _empty_frame(tuple(dtypes.items()), text_storage()).copy()


@functools.cache
def _empty_frame(dtypes: tuple[tuple[str, str], ...], storage: str) -> pd.DataFrame:
    return pd.DataFrame(columns=[name for name, _ in dtypes]).astype(dict(dtypes))


def text_storage() -> str:
    """pandas' ``mode.string_storage`` now: what a ``"string"`` or ``"str"`` column is made of.

    Part of the key of every frame or dtype kept across calls: the command line sets it to
    ``python`` while a command runs (``fsdptrace_cli.strings``), and a process that runs a
    command and then calls the library (a test, a notebook) must get pandas' default back,
    not a frame kept from inside the command."""
    return str(pd.get_option("mode.string_storage"))
