"""What each rank recorded since the last poll, read from its journal segments at a few bytes a
segment: what lets a watcher stay on for thousands of ranks.

A rank's newest rows are in the segments it is writing (``journal_format``): in its hot folder
on its own host (``journal_hot``), mirrored into ``RUN_DIR/journal/rank=<r>/`` every flush
interval for readers elsewhere. Segments fill front to back and are zero beyond what was
written, so a cursor per segment remembers where the data ended and each poll reads only from
there: one ``pread`` of a few bytes when nothing was added. Fixed tables are counted by slot
(the slot's ``seq`` is its first field), framed ones by record; the markers' records are parsed
(a few a step), because they say where micro-steps begin, where optimizer steps end and how a
rank ended. Nothing here reads Parquet: a segment the writer turned into a part was full, and
its successor is newer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fsdptrace.store import journal_hot, schema
from fsdptrace.store.journal_format import (
    FIXED_TABLES,
    FRAME,
    HEADER,
    JOURNAL_DIR,
    MAGIC,
    MAX_FRAME_BYTES,
    SEGMENT_NAME,
    is_loss_writer,
)
from fsdptrace.store.journal_read import fixed_dtype, loads_flat

# Bytes read at once past a cursor: many slots or records per syscall when a rank ran ahead.
_READ_CHUNK = 64 * 1024
_MARKER_COLUMNS = schema.MARKERS.names
# How often a rank read through the mirror is looked for in this host's hot folders again.
_HOT_RECHECK_S = 5.0


@dataclass
class RankState:
    """What the watcher knows of one rank, from its segments (``seq``: the rank's one counter
    of events, eval forwards and markers; ``t_ns``: its monotonic clock)."""

    rank: int
    last_event_seq: int = 0
    last_eval_seq: int = 0
    last_boundary_seq: int = 0
    ending: str | None = None
    # (step, micro_step, t_ns) of each micro-step begin, and t_ns of what followed it.
    micro_steps: list[tuple[int, int, int]] = field(default_factory=list)
    micro_step_ns: list[int] = field(default_factory=list)
    last_marker_ns: int = 0

    def where(self) -> str:
        """Where the rank is, by the definition of ``checks.stops``: the kind of the record
        with the highest ``seq`` among events, eval forwards and optimizer-step markers."""
        seqs = {"pass": self.last_event_seq, "eval": self.last_eval_seq,
                "boundary": self.last_boundary_seq}
        kind = max(seqs, key=lambda k: seqs[k])
        return kind if seqs[kind] else "not started"


class _Cursor:
    """Where the data of one segment ended at the last poll.

    A hot segment (tmpfs, this host) stays open between polls; a mirror is opened afresh
    each poll, so a network filesystem shows what its writer wrote since (close-to-open).
    """

    def __init__(self, table: str, path: str, *, keep_open: bool) -> None:
        self.table, self.path, self.keep_open = table, path, keep_open
        self.offset: int | None = None  # the data offset, read from the header once written
        self.dtype = fixed_dtype(table) if table in FIXED_TABLES else None
        self.slot_size = self.dtype.itemsize if self.dtype is not None else 0
        self.seq_field = schema.TABLES[table].names[0]
        self.fd: int | None = None

    def poll(self, state: RankState) -> bool:
        """``advance`` on the segment's file; False when it cannot be read (it vanished)."""
        try:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            return self.advance(self.fd, state)
        except (OSError, ValueError):
            return False
        finally:
            if not self.keep_open:
                self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def advance(self, fd: int, state: RankState) -> bool:
        """Read what was added since the last call into ``state``; True when anything was."""
        if self.offset is None:
            header = os.pread(fd, HEADER.size, 0)
            if len(header) < HEADER.size or header[:8] != MAGIC:
                return False  # created, its header not written yet
            self.offset = HEADER.unpack(header)[3]
        if self.slot_size:
            return self._slots(fd, state)
        return self._frames(fd, state)

    def _slots(self, fd: int, state: RankState) -> bool:
        assert self.offset is not None
        grew = False
        dtype = self.dtype
        size = self.slot_size  # one slot first: a quiet segment costs a few dozen bytes
        while True:
            data = os.pread(fd, size, self.offset)
            size = _READ_CHUNK - _READ_CHUNK % self.slot_size
            slots = np.frombuffer(data, dtype, len(data) // self.slot_size)
            seq = slots[self.seq_field]
            valid = (seq == slots["_trailer"]) & (seq != 0)
            count = int(np.argmin(valid)) if not valid.all() else len(valid)
            if not count:
                return grew
            grew = True
            self.offset += count * self.slot_size
            last = int(seq[count - 1])
            if self.table == "events":
                state.last_event_seq = max(state.last_event_seq, last)
            elif self.table == "eval_forwards":
                state.last_eval_seq = max(state.last_eval_seq, last)
            if count < len(slots):
                return grew

    def _frames(self, fd: int, state: RankState) -> bool:
        assert self.offset is not None
        grew = False
        while True:
            head = os.pread(fd, FRAME.size, self.offset)
            length = FRAME.unpack(head)[0] if len(head) == FRAME.size else 0
            if not length or length > MAX_FRAME_BYTES:
                return grew
            record = os.pread(fd, length + 2 * FRAME.size, self.offset)
            if len(record) < length + 2 * FRAME.size or FRAME.unpack_from(
                    record, FRAME.size + length)[0] != length:
                return grew  # being written: the leading length comes last, so this is rare
            if self.table == "markers":
                _read_markers(record[FRAME.size:FRAME.size + length], state)
            self.offset += length + 2 * FRAME.size
            grew = True


def _read_markers(payload: bytes, state: RankState) -> None:
    try:
        rows = loads_flat(payload)
    except ValueError:
        return
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, list) or len(row) != len(_MARKER_COLUMNS):
            continue
        marker = dict(zip(_MARKER_COLUMNS, row, strict=True))
        kind, t_ns = marker["kind"], int(marker["t_ns"] or 0)
        if state.micro_steps and len(state.micro_step_ns) < len(state.micro_steps):
            state.micro_step_ns.append(t_ns - state.micro_steps[-1][2])
        if kind == schema.MARKER_MICRO_STEP:
            state.micro_steps.append((int(marker["step"]), int(marker["micro_step"]), t_ns))
        elif kind == schema.MARKER_OPTIMIZER_STEP:
            state.last_boundary_seq = max(state.last_boundary_seq, int(marker["seq"]))
        elif kind in schema.ENDING_MARKERS:
            state.ending = str(kind)
        state.last_marker_ns = max(state.last_marker_ns, t_ns)


@dataclass
class Poll:
    """One poll's result: which ranks recorded something new, and every rank's state."""

    progressed: list[int]
    ranks: dict[int, RankState]
    mirrored: bool  # some rank was read from the run dir's mirror (no hot folder here)


class Probe:
    """Follows every rank's newest segments of one run dir, poll by poll."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.ranks: dict[int, RankState] = {}
        self._cursors: dict[str, _Cursor] = {}
        self._hot: dict[int, str | None] = {}
        self._hot_checked: dict[int, float] = {}
        self._now = 0.0

    def poll(self) -> Poll:
        """Read every rank's new rows; never blocks on, or signals, a training process."""
        progressed = []
        mirrored = False
        self._now = time.monotonic()
        seen: set[str] = set()
        for rank, folder in self._journal_folders().items():
            state = self.ranks.setdefault(rank, RankState(rank))
            if self._poll_rank(rank, folder, state, seen):
                progressed.append(rank)
            mirrored |= self._hot.get(rank) is None
        for gone in set(self._cursors) - seen:
            self._cursors.pop(gone).close()  # turned into Parquet, or salvaged at the end
        return Poll(progressed, self.ranks, mirrored)

    def _journal_folders(self) -> dict[int, str]:
        journal = os.path.join(self.run_dir, JOURNAL_DIR)
        try:
            names = os.listdir(journal)
        except OSError:
            return {}
        return {int(name[5:]): os.path.join(journal, name) for name in names
                if name.startswith("rank=") and name[5:].isdigit()}

    def _poll_rank(self, rank: int, cold: str, state: RankState, seen: set[str]) -> bool:
        hot = self._hot.get(rank)
        if hot is None and self._hot_checked.get(rank, 0.0) <= self._now:
            # Off this rank's host no hot folder ever appears: look again now and then only.
            found = journal_hot.hot_dir(Path(cold), create=False)
            hot = self._hot[rank] = str(found) if found is not None else None
            self._hot_checked[rank] = self._now + _HOT_RECHECK_S
        newest: dict[tuple[str, str], tuple[int, str, bool]] = {}
        for folder, is_hot in ((cold, False), (hot, True)):  # the hot copy wins its mirror
            if folder is None:
                continue
            try:
                names = os.listdir(folder)
            except OSError:
                if is_hot:
                    self._hot[rank] = None  # the rank's writer finished with it
                continue
            for name in names:
                match = SEGMENT_NAME.match(name)
                if match is None or is_loss_writer(match["writer"]):
                    continue  # a writer's note of rows not copied yet: no progress of the rank
                key, index = (match["table"], match["writer"]), int(match["index"])
                if key not in newest or index >= newest[key][0]:
                    newest[key] = (index, os.path.join(folder, name), is_hot)
        grew = False
        for (table, _), (_, path, is_hot) in newest.items():
            seen.add(path)
            cursor = self._cursors.get(path)
            if cursor is None:
                cursor = self._cursors[path] = _Cursor(table, path, keep_open=is_hot)
                grew = True  # a new segment: rows were added, or a rank started
            grew |= cursor.poll(state)
        return grew
