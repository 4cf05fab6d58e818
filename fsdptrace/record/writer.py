"""Background writer: turns the recorder's in-memory rows into Parquet chunks.

The training thread only appends tuples to ``collections.deque`` buffers (append and popleft
are atomic under the GIL, so no lock sits on the hot path). This thread wakes at every
optimizer boundary and at least every ``flush_interval_s`` seconds, and writes each table's
new rows as one complete Parquet file: first under a temporary name, then renamed atomically,
so a job killed at any instant leaves only whole files behind.

The writer shares the GIL with training: while it converts rows, a hook that wants to run
waits until the writer lets go (up to ``sys.getswitchinterval()``, 5 ms, if it never does).
So it takes rows in one C-level call, converts integer columns with numpy instead of Python
objects, and yields the GIL (``time.sleep(0)``) between stages: a hook then waits for one
stage (tens of µs), not for the whole flush.
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdptrace import schema
from fsdptrace.record.dropped import DroppedRows, RowPositions

log = logging.getLogger("fsdptrace")

DEFAULT_FLUSH_INTERVAL_S = 2.0
# Rows held per table while writes fail or lag; beyond this the oldest are dropped and counted.
DEFAULT_MAX_BUFFERED_ROWS = 1_000_000


def yield_gil() -> None:
    """Let a waiting training thread run now rather than after the GIL switch interval."""
    time.sleep(0)


def int_column(values: Sequence[int], dtype: type[np.integer]) -> np.ndarray:
    """Non-null ints as a numpy array: pyarrow then copies a buffer, not Python objects."""
    return np.fromiter(values, dtype, len(values))


class TableBuffer:
    """Rows of one table waiting to be written, how to turn them into columns, what was lost."""

    def __init__(self, name: str, to_columns: Callable[[list[tuple]], dict[str, Any]],
                 on_drop: Callable[[], None] | None = None) -> None:
        self.name = name
        self.on_drop = on_drop
        self.rows: collections.deque[tuple] = collections.deque()
        self.to_columns = to_columns
        self.num_chunks = 0
        self.num_dropped = 0
        # Appended by the writer thread only; the recorder reads it at boundaries and close.
        self.drops: list[DroppedRows] = []
        self._positions = RowPositions(name)

    def take(self, count: int) -> list[tuple]:
        """The ``count`` oldest rows, removed in one C-level pass (no bytecode per row)."""
        return list(map(operator.call, itertools.repeat(self.rows.popleft, count)))

    def drop_oldest(self, count: int) -> None:
        """Drop the ``count`` oldest rows, remembering which (one contiguous run)."""
        if count <= 0:
            return
        lost = self.take(count)
        self.num_dropped += count
        self.drops.append(self._positions.run(lost[0], lost[-1], count))
        if self.on_drop is not None:
            self.on_drop()


def plain_columns(table: str) -> Callable[[list[tuple]], dict[str, Any]]:
    """Rows stored in schema column order become columns by transposition."""
    names = schema.TABLES[table].names

    def to_columns(rows: list[tuple]) -> dict[str, Any]:
        return dict(zip(names, zip(*rows, strict=True), strict=True))

    return to_columns


class ChunkWriter:
    """Owns the writer thread and the file layout of one rank's recording."""

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        version: str,
        writer_id: str,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        max_buffered_rows: int = DEFAULT_MAX_BUFFERED_ROWS,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.version = version
        self.writer_id = writer_id
        self.flush_interval_s = flush_interval_s
        self.max_buffered_rows = max_buffered_rows
        self.on_failure = on_failure
        self.buffers: dict[str, TableBuffer] = {}
        self.failed = False
        self.bytes_written = 0
        self.num_drop_runs = 0  # runs of dropped rows, all tables (see ``TableBuffer.drops``)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._flush_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._schemas: dict[str, pa.Schema] = {}

    def buffer(self, table: str, to_columns: Callable[[list[tuple]], dict[str, Any]] | None = None
               ) -> collections.deque[tuple]:
        """The deque the training thread appends ``table``'s rows to."""
        if table not in self.buffers:
            self.buffers[table] = TableBuffer(table, to_columns or plain_columns(table),
                                              self._count_drop)
        return self.buffers[table].rows

    def _count_drop(self) -> None:
        """Lets the recorder see new drops at a boundary with one int comparison."""
        self.num_drop_runs += 1

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fsdptrace-writer", daemon=True)
        self._thread.start()

    def request_flush(self) -> None:
        """Ask the writer thread to flush soon; never blocks the caller."""
        self._wake.set()

    def sync(self, timeout_s: float) -> bool:
        """Flush now and wait for it up to ``timeout_s``, never longer; True when it is done.

        The flush runs on a helper thread so a filesystem that hangs cannot hold the caller
        (a signal watcher that must let the signal act) past its bound.
        """
        done = threading.Thread(target=self.flush, kwargs={"drop": False},
                                name="fsdptrace-sync", daemon=True)
        done.start()
        done.join(max(timeout_s, 0.0))
        return not done.is_alive()

    def abandon(self) -> None:
        """Write nothing, ever again (a forked child's copy of its parent's writer).

        Takes no lock: a lock a parent thread held at fork time is never released in the child.
        """
        self.failed = True
        self._stop.set()
        self._thread = None
        for buffer in self.buffers.values():
            buffer.rows.clear()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the thread (no flush): after this, nothing is dropped behind the caller's back."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after a last flush of everything buffered."""
        self.stop(timeout_s)
        # The last flush keeps every row: dropping here would lose the newest ones, which
        # are the close and 'dropped' markers that say what is missing.
        self.flush(drop=False)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if not self._stop.is_set():  # close() flushes last, without dropping
                self.flush()

    def flush(self, *, drop: bool = True) -> None:
        """Write every buffered row; on failure, report once and stop writing."""
        with self._flush_lock:
            if self.failed:
                self._drop_excess()
                return
            try:
                for buffer in list(self.buffers.values()):
                    if drop:
                        self._drop_excess_of(buffer)
                    self._write_buffer(buffer)
            except BaseException as error:  # never let the writer thread die silently
                self.failed = True
                if self.on_failure is not None:
                    self.on_failure(error)

    def _drop_excess(self) -> None:
        for buffer in self.buffers.values():
            self._drop_excess_of(buffer)

    def _drop_excess_of(self, buffer: TableBuffer) -> None:
        buffer.drop_oldest(len(buffer.rows) - self.max_buffered_rows)

    def _write_buffer(self, buffer: TableBuffer) -> None:
        count = len(buffer.rows)
        if count == 0:
            return
        rows = buffer.take(count)
        yield_gil()
        columns = buffer.to_columns(rows)
        yield_gil()
        table = pa.Table.from_pydict(columns, schema=self._schema(buffer.name))
        self.write_table(buffer.name, table, chunk=buffer.num_chunks)
        buffer.num_chunks += 1
        yield_gil()

    def _schema(self, table_name: str) -> pa.Schema:
        cached = self._schemas.get(table_name)
        if cached is None:
            cached = schema.with_metadata(schema.TABLES[table_name], rank=self.rank,
                                          version=self.version)
            self._schemas[table_name] = cached
        return cached

    def write_table(self, table_name: str, table: pa.Table, *, chunk: int) -> Path:
        """Write one complete chunk file atomically: temp name, fsync-free rename.

        The temp name is hidden (leading ``.``) as well as suffixed: a job killed mid-write
        leaves it behind, and hive readers such as ``pyarrow.dataset`` skip dot-files but
        would otherwise try to read the half-written file and fail on the whole table.
        """
        directory = (
            self.run_dir
            / schema.TABLE_DIR.format(table=table_name)
            / schema.RANK_DIR.format(rank=self.rank)
        )
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / schema.PART_FILE.format(writer=self.writer_id, chunk=chunk)
        temp = path.with_name("." + path.name + schema.TEMP_SUFFIX)
        pq.write_table(table, temp, compression="zstd")
        os.replace(temp, path)
        self.bytes_written += path.stat().st_size
        return path


def dropped_counts(writer: ChunkWriter) -> dict[str, Any]:
    return {name: b.num_dropped for name, b in writer.buffers.items() if b.num_dropped}
