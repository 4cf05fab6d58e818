"""Background writer: turns full journal segments into Parquet parts, compacts them at close.

The training thread writes rows into the memory-mapped journal (``record.journal``); this
thread only moves finished segments into the hive-partitioned tables. A part is named by the
segment range it holds, written under a hidden temporary name, renamed, and only then are
its segments deleted: the reader skips segments a part covers and parts inside another
part's range, so a process killed between any two of these steps still reads whole.

Files follow bytes, not steps: a part holds whatever segments filled since the last wake,
and segments grow to ``journal.MAX_SEGMENT_BYTES``. ``close`` seals the journal, converts the
tail and compacts each table to one part per writer, on this thread, and waits at most
``close_timeout_s``: a writer stuck on a frozen filesystem leaves its rows in the journal,
where the reader finds them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from fsdptrace import journal_read, schema
from fsdptrace.journal_format import JOURNAL_DIR, RANGE_PART_FILE, RANGE_PART_NAME, SEGMENT_FILE
from fsdptrace.record.journal import FIRST_SEGMENT_BYTES, MAX_SEGMENT_BYTES, Table, open_table

log = logging.getLogger("fsdptrace")

DEFAULT_FLUSH_INTERVAL_S = 2.0
DEFAULT_CLOSE_TIMEOUT_S = 5.0


class ChunkWriter:
    """Owns one rank's journal, the writer thread and the Parquet layout."""

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        version: str,
        writer_id: str,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        on_failure: Callable[[BaseException], None] | None = None,
        segment_bytes: tuple[int, int] = (FIRST_SEGMENT_BYTES, MAX_SEGMENT_BYTES),
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.version = version
        self.writer_id = writer_id
        self.flush_interval_s = flush_interval_s
        self.on_failure = on_failure
        self.segment_bytes = segment_bytes  # (first, largest): tests make them small
        self.journal_dir = self.run_dir / JOURNAL_DIR / schema.RANK_DIR.format(rank=rank)
        self.tables: dict[str, Table] = {}
        self.converted: dict[str, int] = {}  # table -> last segment index turned into Parquet
        self.failed = False
        # Reported by the recorder once it can warn (``report_init_error``), not raised:
        # recording must never break training.
        self.init_error: OSError | None = None
        try:
            self.journal_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            self.failed, self.init_error = True, error
        self.bytes_written = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._schemas: dict[str, pa.Schema] = {}

    def buffer(self, table: str, vocab: dict[str, Sequence[str]] | None = None) -> Table:
        """The journal table the training thread appends ``table``'s row tuples to.

        ``vocab`` names the codes of dictionary columns (fixed tables store codes).
        """
        if table not in self.tables:
            self.tables[table] = open_table(self.journal_dir, table, self.writer_id,
                                            vocab or {}, self._fail, self.segment_bytes)
            self.tables[table].segments.failed = self.failed
        return self.tables[table]

    def _fail(self, error: BaseException) -> None:
        if not self.failed:
            self.failed = True
            if self.on_failure is not None:
                self.on_failure(error)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fsdptrace-writer", daemon=True)
        self._thread.start()

    def request_flush(self) -> None:
        """Ask the writer thread to convert full segments soon; never blocks the caller."""
        self._wake.set()

    def sync(self, timeout_s: float = 0.0) -> bool:
        """Whether every recorded row is durable: with the journal it always is."""
        return True

    def abandon(self) -> None:
        """In a forked child: forget the parent's mappings; write, delete and start nothing."""
        self._stop.set()
        self._thread = None
        for table in self.tables.values():
            table.abandon()

    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> bool:
        """Seal the journal, let the thread write the tail and compact; True if it finished."""
        for table in self.tables.values():
            table.seal()
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return False
        thread.join(timeout_s)
        return not thread.is_alive()

    def _run(self) -> None:
        try:
            _import_lazy_readers()
            self._write_empty_tables()
            while not self._stop.is_set():
                self._wake.wait(self.flush_interval_s)
                self._wake.clear()
                self.convert_full()
            self.convert_full()
            self.compact()
        except BaseException as error:  # never let the writer thread die silently
            self._fail(error)

    def _write_empty_tables(self) -> None:
        """Every table exists from the start, so hive globs never fail on a short run."""
        for name in schema.TABLES:
            table = self._schema(name).empty_table()
            self._write_part(name, table, 0, 0)

    def convert_full(self) -> None:
        """One Parquet part per table holding every segment that filled since the last call."""
        for name, table in list(self.tables.items()):
            full = table.segments.full
            done = self.converted.get(name, 0)
            ready = [i for i in full[:] if i > done]
            if not ready:
                continue
            paths = [self._segment(name, i) for i in ready]
            data = pa.concat_tables([journal_read.read_segment(p, name) for p in paths])
            self._write_part(name, data.cast(self._schema(name)), ready[0], ready[-1])
            self.converted[name] = ready[-1]
            for path in paths:
                path.unlink()
            time.sleep(0)  # let a waiting hook run now, not after the GIL switch interval

    def compact(self) -> None:
        """Merge each table's parts of this writer into one (at close)."""
        for name in schema.TABLES:
            parts = []
            for path in self._partition(name).iterdir():
                match = RANGE_PART_NAME.match(path.name)
                if match and match["writer"] == self.writer_id:
                    parts.append((int(match["first"]), int(match["last"]), path))
            if len(parts) < 2:
                continue
            parts.sort()
            data = pa.concat_tables([pq.read_table(p).cast(self._schema(name))
                                     for _, _, p in parts])
            self._write_part(name, data, parts[0][0], max(last for _, last, _ in parts))
            for _, _, path in parts:
                path.unlink()

    def _segment(self, table: str, index: int) -> Path:
        return self.journal_dir / SEGMENT_FILE.format(table=table, writer=self.writer_id,
                                                      index=index)

    def _partition(self, table: str) -> Path:
        return (self.run_dir / schema.TABLE_DIR.format(table=table)
                / schema.RANK_DIR.format(rank=self.rank))

    def _schema(self, table_name: str) -> pa.Schema:
        cached = self._schemas.get(table_name)
        if cached is None:
            cached = schema.with_metadata(schema.TABLES[table_name], rank=self.rank,
                                          version=self.version)
            self._schemas[table_name] = cached
        return cached

    def _write_part(self, table_name: str, table: pa.Table, first: int, last: int) -> Path:
        """Write one part atomically: a hidden temp name (hive readers skip dot-files), rename."""
        directory = self._partition(table_name)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / RANGE_PART_FILE.format(writer=self.writer_id, first=first, last=last)
        temp = path.with_name("." + path.name + schema.TEMP_SUFFIX)
        pq.write_table(table, temp, compression="zstd")
        os.replace(temp, path)
        self.bytes_written += path.stat().st_size
        return path


def _import_lazy_readers() -> None:
    """Import now what ``pq.read_table`` imports on first use (``pyarrow.dataset``).

    Compaction may first read at interpreter exit, and importing pyarrow's Cython modules
    then resets CPython's record of an unhandled KeyboardInterrupt: a Ctrl-C'd rank would
    exit 1 instead of dying by SIGINT as it does without fsdptrace. Done on this thread, so
    the training thread never pays for it.
    """
    import pyarrow.dataset  # noqa: F401

