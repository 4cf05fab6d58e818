"""The writer process: every byte a recorder puts in the run dir is written here, not in training.

A write to a frozen or stalled filesystem (``fsfreeze``, an NFS or Lustre server gone quiet)
sleeps uninterruptibly in the kernel; a process with such a thread cannot finish exiting, so a
writer *thread* would hold the training process past its end. The recording process therefore
only stores rows into memory-mapped journal segments (in a private tmpfs folder,
``journal_hot``) and this process, one per recorder (``record.writer_process``), does the rest:

- every flush interval (or when asked): turn full segments into Parquet parts named by the
  segment range they hold, then copy the open segment's new bytes into ``RUN_DIR/journal/``,
  so a reader on another host sees a hung rank's tail at most one interval late, and say
  there where that copy ends (``record.unwritten``: a rank killed with its writer reads as
  incomplete from there, not as tables cut at different moments);
- on ``close``: convert everything, compact each table to one part, answer ``done``;
- when the recording process ends without ``close`` (SIGKILL, an abort, a segfault, a close cut
  short by a frozen filesystem): the same, so the run dir holds every row in plain Parquet;
  what it cannot write stays in the run dir's journal, which ``fsdptrace`` folds in.
- when the run dir's disk is full (during the run, or only for the last conversion): nothing
  written is deleted, the segments are moved into the run dir's journal as far as they fit,
  and the rows that do not fit are said there (``record.unwritten``), so a reader of the run
  dir alone reports those micro-steps incomplete instead of reading a cut-off rank.

The process around it (``record.writer_process``) ignores SIGINT, SIGTERM and SIGHUP and runs
in its own session: the job's Ctrl-C or the scheduler's SIGTERM stop the training, and it
still has the tail to write. Its status reaches the recorder as lines on stdout: ``wrote
BYTES``, ``error TYPE: MESSAGE``, ``alive``, ``done``. Stdin carries ``flush`` and ``close``.

A part is written under a hidden temporary name, renamed, and only then are its segments
deleted: the reader skips segments a part covers and parts inside another part's range, so a
process killed between any two of these steps still reads whole. A writer started for the
same writer id (the recorder restarts a dead one; a sweep settles a dead recording's folder)
resumes from the parts already there: it never converts a segment twice.

A full hot folder sends a recorder's later segments to the run dir's journal: segments are
looked up in both places, the hot copy winning (the run dir may hold a mirror of it).
On start, it settles hot folders left on this host by recordings whose processes are all gone
(``record.hot_sweep``), after its own first parts are written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from fsdptrace.record import unwritten
from fsdptrace.store import journal_hot, journal_read, schema
from fsdptrace.store.full_writes import write_all
from fsdptrace.store.journal_format import (
    HEADER,
    JOURNAL_DIR,
    KIND_FRAMED,
    RANGE_PART_FILE,
    RANGE_PART_NAME,
    SEGMENT_FILE,
    SEGMENT_NAME,
)

_PAGE = 4096


class PartWriter:
    """One recorder's segments in, one rank's Parquet parts and journal mirror out."""

    def __init__(self, run_dir: Path, *, rank: int, version: str, writer_id: str,
                 segment_dir: Path | None = None) -> None:
        self.run_dir, self.rank, self.version, self.writer_id = run_dir, rank, version, writer_id
        self.journal_dir = run_dir / JOURNAL_DIR / schema.RANK_DIR.format(rank=rank)
        self.segment_dir = segment_dir or self.journal_dir
        self._paths: dict[tuple[str, int], Path] = {}  # where segments() found each segment
        # table -> last segment index turned into Parquet (by this writer id, in any process)
        self.converted: dict[str, int] = self._already_converted()
        # table -> (segment index, end of the bytes written, end of the complete records)
        self.mirrored: dict[str, tuple[int, int, int]] = {}
        # table -> (its open segment's index, where that segment's framed records begin; None:
        # fixed slots): one entry a table, however many segments a long run makes
        self._framed_from: dict[str, tuple[int, int | None]] = {}
        self._marked: tuple[int, int] | None = None  # the position the run dir last got
        self._at: tuple[int, int] | None = None  # where the rank was at the last pass
        # Where the rank was when a pass last found the run dir holding every row; before the
        # first pass, at the start (a writer killed in its first pass, which converts and
        # copies everything recorded so far, table after table, left no mark: CI saw a rank
        # read alone with events missing for 3 steps its gradients had).
        self._whole_at: tuple[int, int] = (0, 0)
        self.bytes_written = 0
        self.on_part: Callable[[int], None] = lambda size: None  # the process reports sizes
        self._schemas: dict[str, pa.Schema] = {}

    def _already_converted(self) -> dict[str, int]:
        converted: dict[str, int] = {}
        for name in schema.TABLES:
            for _, last, _ in self._parts(name):
                converted[name] = max(converted.get(name, 0), last)
        return converted

    def _parts(self, table: str) -> list[tuple[int, int, Path]]:
        """This writer's parts of ``table``: ``(first, last, path)``."""
        try:
            names = os.listdir(self._partition(table))
        except OSError:
            return []
        parts = []
        for name in names:
            match = RANGE_PART_NAME.match(name)
            if match and match["writer"] == self.writer_id:
                parts.append((int(match["first"]), int(match["last"]),
                              self._partition(table) / name))
        return sorted(parts)

    def segments(self) -> dict[str, list[int]]:
        """This writer's segment indexes per table, in order (hot folder and run dir)."""
        self._paths = {}
        folders = [self.journal_dir] if self.segment_dir == self.journal_dir else [
            self.journal_dir, self.segment_dir]  # the hot copy, listed last, wins
        for folder in folders:
            for path in journal_hot.segment_files(folder, self.writer_id):
                match = SEGMENT_NAME.match(path.name)
                if match and match["writer"] == self.writer_id and match["table"] in schema.TABLES:
                    self._paths[(match["table"], int(match["index"]))] = path
        found: dict[str, list[int]] = {}
        for table, index in self._paths:
            found.setdefault(table, []).append(index)
        return {table: sorted(indexes) for table, indexes in found.items()}

    def write_empty_tables(self) -> None:
        """Every table exists from the start, so hive globs never fail on a short run."""
        for name in schema.TABLES:
            self._write_part(name, self._schema(name).empty_table(), 0, 0)

    def convert(self, *, final: bool) -> None:
        """One Parquet part per table holding the segments that filled since the last call.

        A segment is full once the recorder created the next one; ``final`` (closed, or the
        recording process is gone) converts the open one too. A table whose part cannot be
        written keeps its segments, and the other tables are still converted (a full disk may
        have room for a small part): the first failure is raised at the end.
        """
        failure: Exception | None = None
        for name, indexes in self.segments().items():
            try:
                self._convert_table(name, indexes, final=final)
            except (OSError, pa.ArrowException) as error:
                failure = failure or error
        if failure is not None:
            raise failure

    def _convert_table(self, name: str, indexes: list[int], *, final: bool) -> None:
        done = self.converted.get(name, 0)
        for index in indexes:
            if index <= done:  # converted, its deletion cut short (a writer was killed)
                self._segment(name, index).unlink(missing_ok=True)
                self._cold_segment(name, index).unlink(missing_ok=True)
        ready = [i for i in (indexes if final else indexes[:-1]) if i > done]
        if not ready:
            return
        paths = [self._segment(name, i) for i in ready]
        data = pa.concat_tables([journal_read.read_segment(p, name) for p in paths])
        self._write_part(name, self._stamped(name, data), ready[0], ready[-1])
        self.converted[name] = ready[-1]
        for index, path in zip(ready, paths, strict=True):
            path.unlink()
            if self.segment_dir != self.journal_dir:
                self._cold_segment(name, index).unlink(missing_ok=True)

    def mirror(self) -> bool:
        """Copy each open segment's new bytes into the run dir's journal; whether any table's
        copy grew (False: nothing was recorded since the last pass).

        Bytes before a record still being written do not change, so each pass copies from
        the lower of a page below the end of what the last pass found written and the start
        of the first record it found incomplete: that record is copied again whole. (A framed
        record is written leading frame last and may be many pages long, the gradients of a
        whole backward: copying only from a page below the end left its leading frame zero in
        the run dir, and every later row of the segment unreadable there. The end, not what
        was copied: a pass copies a page of zeros past the end.) A copy that does not land
        whole (a short write: the disk had room for part of it) raises and leaves the offset
        where it was; the bytes it did write are copied again next time.
        """
        before = dict(self.mirrored)
        for name, index, start, tail in self._open_tails():
            used = journal_hot.used_length(tail)
            if not used:
                continue  # nothing written since (or at all)
            fd = os.open(self._cold_segment(name, index), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                write_all(fd, memoryview(tail)[:used], start)
            finally:
                os.close(fd)
            self.mirrored[name] = self._progress(name, index, start, tail)
        return self.mirrored != before

    def _progress(self, name: str, index: int, start: int, tail: bytes) -> tuple[int, int, int]:
        """(segment index, end of the bytes written, end of its complete records) of a tail
        read from ``start``: what a pass copied, and where the next must copy from."""
        end = start + len(tail.rstrip(b"\0"))
        if start == 0 and len(tail) >= HEADER.size and any(tail[:HEADER.size]):
            _, kind, _, first, _ = HEADER.unpack_from(tail)
            self._framed_from[name] = (index, first if kind == KIND_FRAMED else None)
        known, first = self._framed_from.get(name, (None, None))
        if known != index or first is None:
            return index, end, end  # fixed slots: smaller than a page, the page rule holds
        seen, _, whole = self.mirrored.get(name, (0, 0, 0))
        whole = whole if seen == index and start else first
        return index, end, start + journal_read.complete_records_end(tail, whole - start)

    def _open_tails(self) -> Iterator[tuple[str, int, int, bytes]]:
        """(table, segment index, offset, bytes from there on) of each open hot segment: what
        a mirror pass copies."""
        if self.segment_dir == self.journal_dir:
            return
        for name, indexes in self.segments().items():
            index = indexes[-1]
            if self._segment(name, index).parent != self.segment_dir:
                continue  # mapped in the run dir already (the hot folder was full)
            seen, end, whole = self.mirrored.get(name, (0, 0, 0))
            start = max(0, min(end - end % _PAGE - _PAGE, whole - whole % _PAGE)
                        ) if seen == index else 0
            try:
                with open(self._segment(name, index), "rb") as hot:
                    tail = hot.read() if not start else os.pread(hot.fileno(), 1 << 30, start)
            except FileNotFoundError:
                continue
            yield name, index, start, tail

    def _anything_to_copy(self) -> bool:
        """Whether the run dir lacks a row the hot folder holds: a segment that filled is
        left to convert, or an open one holds bytes or complete records its last copy did
        not."""
        for name, indexes in self.segments().items():
            if any(i > self.converted.get(name, 0) for i in indexes[:-1]):
                return True
        return any(journal_hot.used_length(tail)
                   and self.mirrored.get(name) != self._progress(name, index, start, tail)
                   for name, index, start, tail in self._open_tails())

    def compact(self) -> None:
        """Merge each table's parts of this writer into one, where the disk has room.

        Merging loses nothing when it fails: the parts stay as they are (a reader reads them
        all), only the merged copy's temporary file goes. So a full disk here is no failure.
        """
        for name in schema.TABLES:
            found = self._parts(name)
            # A part inside another's range is left from a compaction cut short: the reader
            # skips it, and so does this one, or its rows would count twice.
            parts = [p for p in found if not any(a <= p[0] and p[1] <= b and (a, b) != p[:2]
                                                 for a, b, _ in found)]
            # The empty part written at the start (``write_empty_tables``, segments 0-0) only
            # keeps the table's folder until rows arrive: once another part holds them, it goes
            # (below) instead of being read and merged (two thirds of a short close's work).
            if len(parts) > 1 and parts[0][:2] == (0, 0):
                parts = parts[1:]
            for part in found:
                if part not in parts:
                    part[2].unlink(missing_ok=True)
            if len(parts) < 2:
                continue
            try:
                # ParquetFile, not read_table: that imports pyarrow.dataset for one file.
                data = pa.concat_tables([self._stamped(name, pq.ParquetFile(p).read())
                                         for _, _, p in parts])
                self._write_part(name, data, parts[0][0], max(last for _, last, _ in parts))
            except (OSError, pa.ArrowException):
                continue  # the parts hold every row; only the merge did not fit
            for _, _, path in parts:
                path.unlink()

    def flush(self) -> None:
        """One pass of the loop: full segments into Parquet, the open ones mirrored, then
        where the run dir's copy ends said in it (``unwritten.mark_position``): every row
        recorded before the pass began is there now, so the position the rank was in then is
        where the run dir may start to lack rows. The mark stays while the next pass copies
        (tables land moments apart), so a writer killed mid-pass leaves that tail said.

        A pass whose second copy finds nothing new leaves the run dir holding every row (a
        rank waiting in a hung collective, a pause): then nothing is said to be missing, for a
        watcher reading it elsewhere must see the stopped pass whole. The next pass that has
        rows to copy says first where that whole copy ended, before it copies any; so does
        the first pass, from the start (it converts and copies all recorded so far)."""
        if self.segment_dir == self.journal_dir:
            self.convert(final=False)
            return  # every row is in the run dir as it is written
        at = self._mark_before_copying()
        self.convert(final=False)
        self.mirror()
        if at is None:
            return
        if not self._anything_to_copy():
            if self._marked is not None:
                unwritten.forget(self.run_dir, rank=self.rank, writer=self.writer_id)
                self._marked = None
            self._whole_at = at
            return
        if at != self._marked:
            self._mark(at)

    def convert_filled(self) -> None:
        """At an optimizer boundary: the segments that filled into Parquet, no mirror. They
        land in the run dir table after table too, so the mark goes first, as in ``flush``."""
        if self.segment_dir != self.journal_dir:
            self._mark_before_copying()
        self.convert(final=False)

    def _mark_before_copying(self) -> tuple[int, int] | None:
        """Where the rank is; unless a mark is in place already, say first that rows from
        where the last whole copy ended may be missing, when there are rows to copy."""
        # The newest events segment may hold no row yet (it just began): then the rank is
        # still where the last row of the one before was.
        at = unwritten.position(self.segment_dir, self.writer_id) or self._at
        self._at = at
        if at is not None and self._marked is None and self._anything_to_copy():
            self._mark(self._whole_at)
        return at

    def _mark(self, at: tuple[int, int]) -> None:
        unwritten.mark_position(self.run_dir, rank=self.rank, writer=self.writer_id,
                                hot=self.segment_dir, position=at)
        self._marked = at

    def finish(self) -> None:
        """Everything into Parquet, one part per table; the hot folder removed if empty."""
        self.convert(final=True)
        self.compact()
        journal_hot.release_room(self.journal_dir, self.writer_id)
        unwritten.forget(self.run_dir, rank=self.rank, writer=self.writer_id)
        if self.segment_dir != self.journal_dir:
            journal_hot.remove_if_empty(self.segment_dir)

    def salvage(self, reason: str = "the run dir's filesystem refused a write") -> int:
        """Whatever could not become Parquet: the segments themselves, into the run dir; what
        does not fit there either is said in it (``record.unwritten``). Returns the number
        of rows the run dir lacks."""
        if self.segment_dir == self.journal_dir:
            journal_hot.release_room(self.journal_dir, self.writer_id)
            return 0  # every segment is in the run dir already
        journal_hot.salvage(self.segment_dir, self.journal_dir, self.writer_id)
        return unwritten.record_loss(self.run_dir, rank=self.rank, writer=self.writer_id,
                                     hot=self.segment_dir, reason=reason)

    def _segment(self, table: str, index: int) -> Path:
        known = self._paths.get((table, index))
        return known or self.segment_dir / _segment_name(table, self.writer_id, index)

    def _cold_segment(self, table: str, index: int) -> Path:
        return self.journal_dir / _segment_name(table, self.writer_id, index)

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

    def _stamped(self, table_name: str, data: pa.Table) -> pa.Table:
        """``data`` under the table's stamped schema. Segments read back with the schema's own
        types, so only the metadata is new; a cast would import ``pyarrow.compute``, 40 ms of
        the start-up of every writer process, for nothing to convert."""
        stamped = self._schema(table_name)
        if data.schema.equals(stamped):  # metadata aside
            return data.replace_schema_metadata(stamped.metadata)
        return data.cast(stamped)

    def _write_part(self, table_name: str, table: pa.Table, first: int, last: int) -> Path:
        """Write one part atomically: a hidden temp name (hive readers skip dot-files), rename.

        A write that fails removes its temporary file: on a full disk it holds the last room.
        """
        directory = self._partition(table_name)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / RANGE_PART_FILE.format(writer=self.writer_id, first=first, last=last)
        temp = path.with_name("." + path.name + schema.TEMP_SUFFIX)
        try:
            pq.write_table(table, temp, compression="zstd")
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        size = path.stat().st_size
        self.bytes_written += size
        self.on_part(size)
        return path


def _segment_name(table: str, writer: str, index: int) -> str:
    return SEGMENT_FILE.format(table=table, writer=writer, index=index)
