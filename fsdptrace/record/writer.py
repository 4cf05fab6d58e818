"""The recorder's side of writing: journal tables for the hooks, a writer process for the disk.

The training thread writes rows into memory-mapped journal segments (``record.journal``),
mapped from a private tmpfs folder (``journal_hot``) when there is one, else from
``RUN_DIR/journal/``. Everything else happens in the writer process (``record.part_writer``,
one per recorder): Parquet parts, the journal mirror, compaction, and the tail of a process
that died. This process only tells it ``flush`` and ``close`` through a pipe and reads its
status on a thread, so it never waits on the run dir's filesystem: a frozen one stalls the
writer process, not training, ``close()`` or the exit.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

from fsdptrace import journal_hot, schema
from fsdptrace.journal_format import JOURNAL_DIR
from fsdptrace.record.journal import FIRST_SEGMENT_BYTES, MAX_SEGMENT_BYTES, Table, open_table

log = logging.getLogger("fsdptrace")

DEFAULT_FLUSH_INTERVAL_S = 2.0
DEFAULT_CLOSE_TIMEOUT_S = 5.0


class WriterProcessError(Exception):
    """A failure the writer process reported (its message names the original type)."""


class ChunkWriter:
    """Owns one rank's journal tables and the writer process that turns them into Parquet."""

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
        self.failed = False
        # Reported by the recorder once it can warn (``report_init_error``), not raised:
        # recording must never break training.
        self.init_error: OSError | None = None
        try:
            self.journal_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            self.failed, self.init_error = True, error
        hot = None if self.failed else journal_hot.hot_dir(self.journal_dir, create=True)
        self.segment_dir = hot or self.journal_dir  # where the hooks' segments are mapped
        self._process: subprocess.Popen[bytes] | None = None
        self._status = _Status()

    def buffer(self, table: str, vocab: dict[str, Sequence[str]] | None = None) -> Table:
        """The journal table the training thread appends ``table``'s row tuples to.

        ``vocab`` names the codes of dictionary columns (fixed tables store codes).
        """
        if table not in self.tables:
            self.tables[table] = open_table(self.segment_dir, table, self.writer_id,
                                            vocab or {}, self._fail, self.segment_bytes)
            self.tables[table].segments.failed = self.failed
        return self.tables[table]

    def _fail(self, error: BaseException) -> None:
        if not self.failed:
            self.failed = True
            for table in self.tables.values():
                table.segments.failed = True
            if self.on_failure is not None:
                self.on_failure(error)

    def start(self) -> None:
        """Start the writer process and the thread that reads its status."""
        if self.failed:
            self._status.done.set()
            return
        package_parent = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH"))
                                            if p)
        command = [sys.executable, "-m", "fsdptrace.record.part_writer", "--parent",
                   str(os.getpid()), "--run-dir", str(self.run_dir), "--rank", str(self.rank),
                   "--version", self.version, "--writer-id", self.writer_id, "--segment-dir",
                   str(self.segment_dir), "--interval", str(self.flush_interval_s)]
        try:
            # Its own session: the job's Ctrl-C and the scheduler's SIGTERM reach training,
            # and the writer process is still there to write the tail.
            # Not the job's stderr: a writer stuck on a frozen filesystem would hold the
            # launcher's pipe open. Its failures come back as status lines.
            self._process = subprocess.Popen(command, stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                             env=env, cwd="/", start_new_session=True,
                                             close_fds=True)
        except OSError as error:
            self._status.done.set()
            self._fail(error)
            return
        assert self._process.stdin is not None
        os.set_blocking(self._process.stdin.fileno(), False)
        # The thread outlives close() by the writer's last moments: it holds no recorder.
        threading.Thread(target=_read_status, args=(self._process, self._status,
                                                    weakref.ref(self)),
                         name="fsdptrace-writer-status", daemon=True).start()

    @property
    def bytes_written(self) -> int:
        return self._status.bytes_written

    def _tell(self, word: bytes) -> None:
        """One line to the writer process; never blocks the caller (a full pipe drops it)."""
        process = self._process
        if process is None or process.stdin is None:
            return
        try:
            os.write(process.stdin.fileno(), word + b"\n")
        except (BlockingIOError, BrokenPipeError, OSError, ValueError):
            pass

    def request_flush(self) -> None:
        """Ask the writer process to convert full segments soon; never blocks the caller."""
        self._tell(b"flush")

    def sync(self, timeout_s: float = 0.0) -> bool:
        """Whether every recorded row is durable: with the journal it always is."""
        return True

    def abandon(self) -> None:
        """In a forked child: forget the parent's mappings and writer; write nothing."""
        self._process = None  # the parent's; it watches the parent, not us
        self._status.done.set()
        for table in self.tables.values():
            table.abandon()

    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> bool:
        """Seal the journal and wait at most ``timeout_s`` for the writer to finish.

        True if every row is in Parquet. Otherwise (a stalled filesystem, a failure) the
        writer process finishes on its own, after this process has gone if need be.
        """
        for table in self.tables.values():
            table.seal()
        if self._process is None:
            return False
        self._tell(b"close")
        return self._status.done.wait(timeout_s) and self._status.finished and not self.failed


class _Status:
    """What the writer process said: bytes written, whether it finished."""

    def __init__(self) -> None:
        self.bytes_written = 0
        self.finished = False  # it said ``done``: every row is in Parquet (or the journal)
        self.done = threading.Event()  # it finished, or is gone


def _read_status(process: subprocess.Popen[bytes], status: _Status,
                 writer: weakref.ref[ChunkWriter]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        word, _, rest = line.decode(errors="replace").strip().partition(" ")
        if word == "wrote":
            status.bytes_written += int(rest or 0)
        elif word == "error":
            alive = writer()
            if alive is not None:
                alive._fail(WriterProcessError(rest))
            del alive
        elif word == "done":
            status.finished = True
            status.done.set()
    status.done.set()  # it exited (or was killed) without a word
    process.wait()
