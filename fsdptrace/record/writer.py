"""The recorder's side of writing: journal tables for the hooks, a writer process for the disk.

The training thread writes rows into memory-mapped journal segments (``record.journal``),
mapped from a private tmpfs folder (``journal_hot``) when there is one, else from
``RUN_DIR/journal/``. Everything else happens in the writer process (``record.part_writer``,
one per recorder): Parquet parts, the journal mirror, compaction, and the tail of a process
that died. This process only tells it ``flush`` and ``close`` through a pipe and reads its
status on a thread, so it never waits on the run dir's filesystem: a frozen one stalls the
writer process, not training, ``close()`` or the exit.

The writer process is supervised, at flush time (an optimizer boundary) and at ``close()``,
never on the hooks' path: one that ended without ``done`` (SIGKILL, the OOM killer) is
recorded as a ``writer_lost`` marker and restarted with the same writer id, so it picks up the
segments where the dead one stopped; one silent for ``stall_s`` is recorded as
``writer_stalled``. If no writer can be started at close, this process moves the segments
into the run dir's journal itself. A hot folder that fills up sends new segments to the run
dir's journal (with one warning naming the hot folder), not to the bin.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

from fsdptrace.record.journal import (
    FIRST_SEGMENT_BYTES,
    MAX_SEGMENT_BYTES,
    FramedTable,
    Table,
    open_table,
)
from fsdptrace.record.writer_status import WriterStatus, how_it_ended, is_stopped, read_status
from fsdptrace.store import journal_hot, run_mark, schema
from fsdptrace.store.env import SINGLE_THREADED_ENV
from fsdptrace.store.journal_format import JOURNAL_DIR

log = logging.getLogger("fsdptrace")

DEFAULT_FLUSH_INTERVAL_S = 2.0
DEFAULT_CLOSE_TIMEOUT_S = 5.0
# A writer process says ``alive`` every flush interval; silent this many intervals (and at
# least MIN_STALL_S) it is stalled: stopped, or stuck on a frozen filesystem.
STALL_INTERVALS = 10
MIN_STALL_S = 30.0
# Restarts of a writer that keeps dying (one that dies at start would otherwise loop).
MAX_RESTARTS = 3
# Bytes of every markers segment kept free for the ``recording_disabled`` marker: when the
# run dir's disk fills, no new segment may be made, and the marker saying why the rank's rows
# stop must still be recorded. Its detail is cut to MAX_FAILURE_CHARS, run dir path included.
MARKER_RESERVE_BYTES = 16 * 1024
MAX_FAILURE_CHARS = 4000


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
        on_notice: Callable[[str, str], None] | None = None,
        segment_bytes: tuple[int, int] = (FIRST_SEGMENT_BYTES, MAX_SEGMENT_BYTES),
        stall_s: float | None = None,
        max_restarts: int = MAX_RESTARTS,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.version = version
        self.writer_id = writer_id
        self.flush_interval_s = flush_interval_s
        self.on_failure = on_failure
        self.on_notice = on_notice  # (marker kind, detail): recorded as a marker
        self.segment_bytes = segment_bytes  # (first, largest): tests make them small
        self.stall_s = stall_s if stall_s is not None else max(
            MIN_STALL_S, STALL_INTERVALS * flush_interval_s)
        self.journal_dir = self.run_dir / JOURNAL_DIR / schema.RANK_DIR.format(rank=rank)
        self.tables: dict[str, Table] = {}
        self.failed = False
        # Reported by the recorder once it can warn (``report_init_error``), not raised:
        # recording must never break training.
        self.init_error: OSError | None = None
        self.launch: str | None = None
        try:
            self.journal_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            self.failed, self.init_error = True, error
        if not self.failed:
            self.launch = run_mark.mark_run_dir(self.run_dir)
        self.recording = (self.launch or "", writer_id, str(os.getpid()), str(time.time_ns()))
        self._owner_fd: int | None = None
        hot = None if self.failed else journal_hot.hot_dir(self.journal_dir, create=True,
                                                            launch=self.launch)
        if hot is not None:
            self._owner_fd = journal_hot.claim(hot, {
                "journal": os.path.realpath(self.journal_dir), "rank": rank,
                "launch": self.launch, "version": version})
            hot = hot if self._owner_fd is not None else None
        self.segment_dir = hot or self.journal_dir  # where the hooks' segments are mapped
        self.fell_back = False
        self._process: subprocess.Popen[bytes] | None = None
        self._status = WriterStatus()
        self._bytes_before = 0  # written by writer processes that ended
        self._restarts = 0
        self.max_restarts = max_restarts
        self._stall_noted = False
        self._salvaged = False

    def buffer(self, table: str, vocab: dict[str, Sequence[str]] | None = None) -> Table:
        """The journal table the training thread appends ``table``'s row tuples to.

        ``vocab`` names the codes of dictionary columns (fixed tables store codes).
        """
        if table not in self.tables:
            self.tables[table] = open_table(
                self.journal_dir if self.fell_back else self.segment_dir, table,
                self.writer_id, vocab or {}, self._fail, self.segment_bytes,
                recording=self.recording, fallback=self._fall_back,
                reserve=MARKER_RESERVE_BYTES if table == "markers" else 0)
            self.tables[table].segments.failed = self.failed
        return self.tables[table]

    def _fall_back(self, error: OSError) -> Path | None:
        """A segment could not be created in the hot folder: go on in the run dir's journal.

        Every table moves at once (one warning); a failure there stops recording.
        """
        if self.segment_dir == self.journal_dir or self.fell_back:
            return None
        self.fell_back = True
        for table in self.tables.values():
            table.segments.directory = self.journal_dir
        reason = errno.errorcode.get(error.errno or 0, type(error).__name__)
        warnings.warn(
            f"fsdptrace: rank {self.rank}: the hot journal folder {self.segment_dir} cannot "
            f"take another segment ({reason}: {error.strerror or error}); recording goes on "
            f"in {self.journal_dir} (free space under {self.segment_dir.parent.parent}, or "
            f"set {journal_hot.HOT_DIR_ENV}=off to write there from the start)",
            RuntimeWarning, stacklevel=2)
        return self.journal_dir

    def _fail(self, error: BaseException) -> None:
        """Recording stops: its marker first (into the room kept for it), then no segment
        more. Called from the status thread, or from inside a table's failed segment."""
        if self.failed:
            return
        self.failed = True
        markers = self.tables.get("markers")
        if isinstance(markers, FramedTable):
            markers.release_reserve()
        if self.on_failure is not None:
            text = str(error) if isinstance(error, WriterProcessError) else (
                f"{type(error).__name__}: {error}")
            if len(text) > MAX_FAILURE_CHARS:
                error = WriterProcessError(text[:MAX_FAILURE_CHARS] + "...")
            self.on_failure(error)
        for table in self.tables.values():
            table.segments.failed = True

    def start(self) -> None:
        """Start the writer process and the thread that reads its status."""
        if self.failed:
            self._status.done.set()
            return
        self._spawn(first=True)

    def _spawn(self, *, first: bool = False) -> bool:
        """A writer process for this recorder's segments (a new one picks up where the last
        stopped: it converts whatever segments are left). False if none could start."""
        self._bytes_before += self._status.bytes_written
        self._status = WriterStatus()
        package_parent = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, **SINGLE_THREADED_ENV}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH"))
                                            if p)
        command = [sys.executable, "-m", "fsdptrace.record.writer_process", "--parent",
                   str(os.getpid()), "--run-dir", str(self.run_dir), "--rank", str(self.rank),
                   "--version", self.version, "--writer-id", self.writer_id, "--segment-dir",
                   str(self.segment_dir), "--interval", str(self.flush_interval_s)]
        try:
            # Its own session: the job's Ctrl-C and the scheduler's SIGTERM reach training,
            # and the writer process is still there to write the tail.
            # Not the job's stderr: a writer stuck on a frozen filesystem would hold the
            # launcher's pipe open. Its failures come back as status lines.
            # It inherits the hot folder's owner lock: the folder is in use while it lives.
            passed = (self._owner_fd,) if self._owner_fd is not None else ()
            self._process = subprocess.Popen(command, stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                             env=env, cwd="/", start_new_session=True,
                                             close_fds=True, pass_fds=passed)
        except OSError as error:
            self._process = None
            self._status.done.set()
            if first:  # a restart that fails leaves the segments to close(), not recording off
                self._fail(error)
            return False
        assert self._process.stdin is not None
        os.set_blocking(self._process.stdin.fileno(), False)
        # The thread outlives close() by the writer's last moments: it holds no recorder.
        me = weakref.ref(self)

        def on_error(message: str) -> None:
            alive = me()
            if alive is not None:
                alive._fail(WriterProcessError(message))

        threading.Thread(target=read_status, args=(self._process, self._status, on_error),
                         name="fsdptrace-writer-status", daemon=True).start()
        return True

    @property
    def bytes_written(self) -> int:
        return self._bytes_before + self._status.bytes_written

    def supervise(self) -> None:
        """Notice a dead or stalled writer process; restart a dead one. At flush time only."""
        process = self._process
        if process is None or self.failed:
            return
        if self._status.exited and not self._status.finished:
            self._replace_dead(process)
        elif is_stopped(process.pid):
            # SIGSTOP (a debugger, a stray signal): it would never finish. Killed, it stops
            # at an instruction boundary, which a restart resumes from as after any kill.
            process.kill()
            self._replace_dead(process, stopped=True)
        elif (not self._stall_noted and not self._status.exited
              and time.monotonic() - self._status.last_heard > self.stall_s):
            self._stall_noted = True
            self._notice(schema.MARKER_WRITER_STALLED,
                         f"writer process {process.pid} silent for "
                         f"{time.monotonic() - self._status.last_heard:.0f} s (stopped, or its "
                         f"filesystem is frozen); its rows wait in {self.segment_dir}")

    def _replace_dead(self, process: subprocess.Popen[bytes], *, stopped: bool = False) -> bool:
        try:
            process.wait(timeout=1.0)  # its stdout closed: it is gone, or all but
        except subprocess.TimeoutExpired:
            process.kill()  # it closed its status pipe yet lives: useless to us
            process.wait()
        how = how_it_ended(process.returncode, stopped=stopped)
        if self._restarts >= self.max_restarts:
            self._process = None
            self._notice(schema.MARKER_WRITER_LOST, f"writer process {process.pid} {how}; "
                         f"not restarted (restarted {self._restarts} times already)")
            return False
        self._restarts += 1
        started = self._spawn()
        new = f"restarted as {self._process.pid}" if started and self._process else (
            "no new one could start")
        self._notice(schema.MARKER_WRITER_LOST, f"writer process {process.pid} {how}; {new}")
        return started

    def _notice(self, kind: str, detail: str) -> None:
        warnings.warn(f"fsdptrace: rank {self.rank}: {detail}", RuntimeWarning, stacklevel=3)
        if self.on_notice is not None:
            self.on_notice(kind, detail)

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
        self.supervise()
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
        writer process finishes on its own, after this process has gone if need be. A writer
        that died is replaced first; if none can start, the segments are moved into the run
        dir's journal from here (the reader folds them in).
        """
        self.supervise()  # a death noticed now still gets its marker: nothing is sealed yet
        for table in self.tables.values():
            table.seal()
        process = self._process
        if process is not None and self._status.exited and not self._status.finished:
            self._replace_dead(process)
        if self._process is None:
            self._salvage_here()
            return False
        self._tell(b"close")
        done = self._status.done.wait(timeout_s)
        if done and self._status.exited and not self._status.finished:
            # It died during the close: one more try, then move the segments ourselves.
            if self._replace_dead(self._process) and self._process is not None:
                self._tell(b"close")
                if self._status.done.wait(timeout_s) and self._status.finished:
                    return not self.failed
            self._salvage_here()
            return False
        return done and self._status.finished and not self.failed

    def _salvage_here(self) -> None:
        """No writer process could finish: move the segments into the run dir's journal from
        here, and say there which rows did not fit (``record.unwritten``)."""
        if self.segment_dir != self.journal_dir and not self._salvaged:
            # Here only: it reads segments (numpy, pyarrow.compute), which training never needs.
            from fsdptrace.record import unwritten

            self._salvaged = True
            try:
                journal_hot.salvage(self.segment_dir, self.journal_dir, self.writer_id)
            except OSError:
                pass  # they stay in the hot folder; the next sweep on this host moves them
            unwritten.record_loss(self.run_dir, rank=self.rank, writer=self.writer_id,
                                  hot=self.segment_dir,
                                  reason="no writer process could write them")
