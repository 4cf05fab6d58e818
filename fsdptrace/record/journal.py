"""The memory-mapped journal: a recorded row is in a file the kernel keeps once ``append`` returns.

Each table of a rank writes into ``MAP_SHARED`` mappings of segment files (``journal_format``)
in a private tmpfs folder (``journal_hot``: no filesystem freeze can stall a row), or in the
run dir's journal when there is none. Storing into a mapping is a memory write, not a
syscall: SIGKILL, an abort or a segfault right after a hook loses nothing, because the pages
belong to the file. A syscall happens only when a segment fills and the next one is created:
they start at ``FIRST_SEGMENT_BYTES`` and double up to ``MAX_SEGMENT_BYTES``, and are
``posix_fallocate``d, so a full disk fails there instead of a SIGBUS later. A full hot folder
is not the end: segments go on in the run dir's journal (``fallback``, the ``off`` mapping)
and only a failure there stops recording (one warning).

Every segment's vocabulary says which recording it belongs to (``RECORDING_KEY``: launch id,
writer id, pid, start time), flat like the dictionaries so any reader of them reads it too.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from fsdptrace.store.journal_format import (
    FRAME,
    HEADER,
    KIND_FIXED,
    KIND_FRAMED,
    MAGIC,
    SEGMENT_FILE,
    fixed_format,
)

RECORDING_KEY = "_recording"
FIRST_SEGMENT_BYTES = 64 * 1024
MAX_SEGMENT_BYTES = 4 * 1024 * 1024
_PAGE = mmap.PAGESIZE


class Segments:
    """Creates one table's segment files in order and remembers the full ones."""

    def __init__(self, directory: Path, table: str, writer: str, kind: int, record_size: int,
                 vocab: dict[str, Sequence[str]], on_failure: Callable[[BaseException], None],
                 segment_bytes: tuple[int, int] = (FIRST_SEGMENT_BYTES, MAX_SEGMENT_BYTES),
                 *, recording: Sequence[str] = (),
                 fallback: Callable[[OSError], Path | None] | None = None) -> None:
        self.directory, self.table, self.writer = directory, table, writer
        self.kind, self.record_size = kind, record_size
        named = {k: list(v) for k, v in vocab.items()}
        if recording:
            named[RECORDING_KEY] = list(recording)
        self.vocab = json.dumps(named).encode()
        # Called when a segment cannot be created in ``directory``: the folder to go on in, or
        # None (then recording stops).
        self.fallback = fallback
        self.offset = -(-(HEADER.size + len(self.vocab)) // 8) * 8
        self.on_failure = on_failure
        self.next_bytes, self.max_bytes = segment_bytes
        self.index = 0
        self.full: list[int] = []  # indexes of finished segments, appended in order
        self.failed = False
        self.abandoned = False

    def open_next(self, min_bytes: int) -> tuple[mmap.mmap, int] | None:
        """Finish the current segment and map the next; None once recording cannot go on."""
        if self.index:
            self.full.append(self.index)
        if self.failed or self.abandoned:
            return None
        size = max(self.next_bytes, -(-(self.offset + min_bytes) // _PAGE) * _PAGE)
        self.next_bytes = min(self.next_bytes * 2, self.max_bytes)
        mapped = self._create(size)
        if mapped is None:
            return None
        HEADER.pack_into(mapped, 0, MAGIC, self.kind, self.record_size, self.offset,
                         len(self.vocab))
        mapped[HEADER.size:HEADER.size + len(self.vocab)] = self.vocab
        self.index += 1
        return mapped, size

    def _create(self, size: int) -> mmap.mmap | None:
        """Map a new zero-filled segment; in the fallback folder if ``directory`` is full."""
        name = SEGMENT_FILE.format(table=self.table, writer=self.writer, index=self.index + 1)
        while True:
            tried = self.directory
            path = tried / name
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.posix_fallocate(fd, 0, size)
                    return mmap.mmap(fd, size)
                finally:
                    os.close(fd)
            except OSError as error:
                try:
                    path.unlink()  # an empty segment would only say what the warning says
                except OSError:
                    pass
                elsewhere = self.fallback(error) if self.fallback is not None else None
                if elsewhere is not None and elsewhere != tried:
                    self.directory = elsewhere
                    continue
                self.failed = True
                self.on_failure(error)
                return None


class FixedTable:
    """Rows of one hot table as struct slots; ``append`` is the recorder's per-event cost."""

    __slots__ = ("_buf", "_end", "_pack", "_pos", "_size", "segments")

    def __init__(self, segments: Segments, fmt: str) -> None:
        self.segments = segments
        self._pack = struct.Struct(fmt).pack_into
        self._size = struct.calcsize(fmt)
        self._buf: mmap.mmap | bytearray = bytearray(0)
        self._pos = self._end = 0

    def append(self, row: tuple) -> None:
        pos = self._pos
        if pos + self._size > self._end and not self._roll():
            return
        # seq first and the trailer last, in one call: a slot cut short fails seq == trailer.
        self._pack(self._buf, self._pos, *row, row[0])
        self._pos += self._size

    def append_event(self, seq: int, t_ns: int, step: int, micro_step: int, phase: int,
                     unit: int) -> None:
        """``append`` of one ``events`` row, fields passed as they are: no tuple to build and
        unpack on the hottest path (one call per unit entry)."""
        pos = self._pos
        if pos + self._size > self._end and not self._roll():
            return
        self._pack(self._buf, self._pos, seq, t_ns, step, micro_step, phase, unit, seq)
        self._pos += self._size

    def extend(self, rows: Iterable[tuple]) -> None:
        for row in rows:
            self.append(row)

    def _roll(self) -> bool:
        opened = self.segments.open_next(self._size)
        if opened is None:
            self._end = self._pos = 0
            self._buf = bytearray(0)
            return False
        self._buf, self._end = opened
        self._pos = self.segments.offset
        return True

    def seal(self) -> None:
        """No more rows: the current segment counts as full, later appends are dropped."""
        self.segments.abandoned = True
        if self._end:
            self._roll()

    def abandon(self) -> None:
        """Forget the mappings without touching the files (a forked child)."""
        self.segments.abandoned = True
        self._buf, self._pos, self._end = bytearray(0), 0, 0


class FramedTable:
    """Rows of a table written a few times per step, as JSON records under a lock.

    ``reserve``: bytes at the end of every segment that ordinary rows leave free, so that one
    last row always fits once no new segment can be made (a full disk: the marker saying
    recording stopped); ``release_reserve`` hands them to the next rows.
    """

    def __init__(self, segments: Segments, *, reserve: int = 0) -> None:
        self.segments = segments
        # Markers come from several threads, and re-entrantly: a segment that cannot be made
        # stops recording, whose marker is a row of this table.
        self._lock = threading.RLock()
        self._buf: mmap.mmap | bytearray = bytearray(0)
        self._pos = self._end = 0
        self._reserve = reserve

    def append(self, row: tuple) -> None:
        self.extend((row,))

    def extend(self, rows: Iterable[tuple]) -> None:
        if self.segments.abandoned:  # a forked child: its copy of the lock may never be freed
            return
        self._write(json.dumps(list(rows), separators=(",", ":")).encode())

    def extend_json(self, payload: bytes) -> None:
        """``extend`` with the rows already encoded: ``payload`` is the JSON list of rows that
        ``extend`` would write (the boundary joins rows from encodings it keeps)."""
        if self.segments.abandoned:
            return
        self._write(payload)

    def _write(self, payload: bytes) -> None:
        need = len(payload) + 2 * FRAME.size
        with self._lock:
            if self._pos + need > self._end - self._reserve and not self._roll(need):
                return
            pos = self._pos
            self._buf[pos + FRAME.size:pos + FRAME.size + len(payload)] = payload
            FRAME.pack_into(self._buf, pos + FRAME.size + len(payload), len(payload))
            FRAME.pack_into(self._buf, pos, len(payload))  # last: the record now counts
            self._pos = pos + need

    def release_reserve(self) -> None:
        """The reserved bytes are for the rows from now on (the last a recording writes).

        No lock: the caller may be inside this table's own failed ``_roll``."""
        self._reserve = 0

    def _roll(self, need: int) -> bool:
        opened = self.segments.open_next(need + self._reserve)
        if opened is None:
            self._buf, self._pos, self._end = bytearray(0), 0, 0
            return False
        self._buf, self._end = opened
        self._pos = self.segments.offset
        return True

    def seal(self, timeout_s: float = 1.0) -> None:
        # Bounded: another thread may hold the lock while creating a segment on a frozen
        # filesystem; then its segment simply stays unconverted in the journal.
        locked = self._lock.acquire(timeout=timeout_s)
        try:
            self.segments.abandoned = True
            if locked and self._end:
                self._roll(0)
        finally:
            if locked:
                self._lock.release()

    def abandon(self) -> None:
        self.segments.abandoned = True
        self._buf, self._pos, self._end = bytearray(0), 0, 0


Table = FixedTable | FramedTable


def open_table(directory: Path, table: str, writer: str, vocab: dict[str, Sequence[str]],
               on_failure: Callable[[BaseException], None],
               segment_bytes: tuple[int, int] = (FIRST_SEGMENT_BYTES, MAX_SEGMENT_BYTES),
               *, recording: Sequence[str] = (),
               fallback: Callable[[OSError], Path | None] | None = None,
               reserve: int = 0) -> Table:
    """One table's journal; ``reserve``: bytes kept for a last row (``FramedTable``)."""
    from fsdptrace.store.journal_format import FIXED_TABLES

    if table in FIXED_TABLES:
        fmt = fixed_format(table)
        return FixedTable(Segments(directory, table, writer, KIND_FIXED, struct.calcsize(fmt),
                                   vocab, on_failure, segment_bytes, recording=recording,
                                   fallback=fallback), fmt)
    return FramedTable(Segments(directory, table, writer, KIND_FRAMED, 0, {}, on_failure,
                                segment_bytes, recording=recording, fallback=fallback),
                       reserve=reserve)
