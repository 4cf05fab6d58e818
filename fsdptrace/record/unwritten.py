"""Rows a writer could not get into the run dir: said there, as ranges a reader elsewhere skips.

A run dir whose disk fills (during the run, or only at close, in the writer's last conversion)
leaves rows in the hot folder (``journal_hot``) alone. A reader on that host folds them in;
read from the run dir alone (another host, ``FSDPTRACE_HOT_DIR=off``, after a reboot) the rank
looks cut off, and a cut-off order reads as a finding. So once what can be moved has been
(``journal_hot.salvage``), each segment still in the hot folder is compared with its copy in
the run dir's journal (a mirror pass may have copied a prefix of it), and one ``dropped_rows``
marker per table whose rows the run dir lacks is written into the disk room kept for it: the
table, the (step, micro-step) of its first missing row, its last step, how many rows, and why
(``unwritten``). ``checks.incomplete`` reads them as it reads any loss: those micro-steps are
incomplete, never findings, and ``summary`` counts the rows.

While the run goes on, the same segment says where the run dir's copy ends
(``mark_position``): after each of its passes the writer has copied every row recorded
before the pass began, so from the micro-step the rank was in then, every table may lack rows
that only the hot folder holds. Killed together with its writer (a cgroup kill, a node that
goes down), a rank leaves exactly that said: read elsewhere, the tail its tables were copied
at slightly different moments is incomplete, not a rank that ran some units without others.

The markers go in a segment of their own (``journal_format.LOSS_WRITER``), written into the
disk room the writer set aside for it at its start (``journal_hot.reserve_room``): no writer
converts it with the recording's segments, every salvage rewrites it whole (a loss is never
counted twice), and a writer that later converts the hot folder into the run dir
(``record.hot_sweep``, once the disk has room) removes it, for then nothing is missing.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from fsdptrace.errors import UnreadableChunkError
from fsdptrace.record.journal import RECORDING_KEY
from fsdptrace.store import journal_hot, journal_read, schema
from fsdptrace.store.journal_format import (
    FRAME,
    HEADER,
    JOURNAL_DIR,
    KIND_FRAMED,
    LOSS_WRITER,
    MAGIC,
    RANGE_PART_NAME,
    SEGMENT_FILE,
    SEGMENT_NAME,
)
from fsdptrace.store.key_ranges import MAX_MICRO_STEP
from fsdptrace.store.run_mark import read_launch

MAX_REASON_CHARS = 300


def record_loss(run_dir: Path, *, rank: int, writer: str, hot: Path, reason: str) -> int:
    """Say in the run dir which rows of ``writer`` only ``hot`` holds; the number of rows.

    Into the room kept for it, else wherever the disk has room; the room is freed after.
    Never raises: there is nothing more to do when even this cannot be written (the rows
    stay in ``hot`` for the next sweep, and an earlier salvage's markers stay as they are).
    """
    cold = run_dir / JOURNAL_DIR / schema.RANK_DIR.format(rank=rank)
    owner = LOSS_WRITER.format(writer=writer)
    target = cold / SEGMENT_FILE.format(table="markers", writer=owner, index=1)
    try:
        lost = missing(hot, cold, writer, converted_through(run_dir, rank, writer))
        if not lost:
            target.unlink(missing_ok=True)  # an earlier salvage's: nothing is missing now
            return 0
        data = _segment(loss_markers(lost, reason=reason, hot=hot), run_dir, writer)
        if not journal_hot.write_in_room(cold, owner, data, target):
            journal_hot.release_room(cold, writer)
            journal_hot.write_segment(data, target)
        return sum(len(table) for table in lost.values())
    except (OSError, UnreadableChunkError, pa.ArrowException, ValueError):
        return 0
    finally:
        journal_hot.release_room(cold, writer)


def mark_position(run_dir: Path, *, rank: int, writer: str, hot: Path,
                  position: tuple[int, int]) -> None:
    """Say that rows from ``position`` (step, micro-step) on may be in ``hot`` only: every
    table, to the rank's last step (``last_step`` null: the reader fills it in)."""
    cold = run_dir / JOURNAL_DIR / schema.RANK_DIR.format(rank=rank)
    target = cold / SEGMENT_FILE.format(table="markers", writer=LOSS_WRITER.format(
        writer=writer), index=1)
    step, micro_step = position
    where = f"{socket.gethostname()}:{hot}"[:MAX_REASON_CHARS]
    rows = [[0, time.monotonic_ns(), step, micro_step, schema.MARKER_DROPPED_ROWS, 0,
             json.dumps({"table": table, "first_step": step, "first_micro_step": micro_step,
                         "last_step": None, "last_micro_step": None,
                         "unwritten": "not copied into the run dir yet", "kept_in": where})]
            for table in schema.TABLES]
    journal_hot.write_segment(_segment(rows, run_dir, writer), target)


def position(hot: Path, writer: str) -> tuple[int, int] | None:
    """(step, micro-step) of the last row in ``writer``'s newest ``events`` segment in
    ``hot``: where the rank is (it records events in every micro-step); None before any."""
    newest = [p for p in journal_hot.segment_files(hot, writer)
              if p.name.startswith("events-") and SEGMENT_NAME.match(p.name)]
    if not newest:
        return None
    try:
        rows = journal_read.read_segment(newest[-1], "events")
    except (UnreadableChunkError, OSError):
        return None
    if not rows.num_rows:
        return None
    last = rows.slice(rows.num_rows - 1)
    return int(last.column("step")[0].as_py()), int(last.column("micro_step")[0].as_py())


def forget(run_dir: Path, *, rank: int, writer: str) -> None:
    """Every row of ``writer`` reached the run dir: its loss markers say nothing true now."""
    cold = run_dir / JOURNAL_DIR / schema.RANK_DIR.format(rank=rank)
    target = cold / SEGMENT_FILE.format(table="markers", writer=LOSS_WRITER.format(
        writer=writer), index=1)
    try:
        target.unlink(missing_ok=True)
    except OSError:
        pass


def converted_through(run_dir: Path, rank: int, writer: str) -> dict[str, int]:
    """Per table, the last segment index ``writer``'s Parquet parts hold (by their names)."""
    through: dict[str, int] = {}
    for table in schema.TABLES:
        try:
            names = os.listdir(run_dir / table / schema.RANK_DIR.format(rank=rank))
        except OSError:
            continue
        for name in names:
            match = RANGE_PART_NAME.match(name)
            if match and match["writer"] == writer:
                through[table] = max(through.get(table, 0), int(match["last"]))
    return through


def missing(hot: Path, cold: Path, writer: str, converted: dict[str, int]
            ) -> dict[str, pa.Table]:
    """Per table, the rows of ``writer``'s segments in ``hot`` that neither a Parquet part
    (``converted``) nor the segment's copy in ``cold`` holds, in writing order."""
    found: dict[str, list[pa.Table]] = {}
    for path in journal_hot.segment_files(hot, writer):
        match = SEGMENT_NAME.match(path.name)
        if not match or match["writer"] != writer or match["table"] not in schema.TABLES:
            continue
        table = match["table"]
        if int(match["index"]) <= converted.get(table, 0):
            continue  # in Parquet already; its deletion was cut short
        try:
            rows = journal_read.read_segment(path, table)
        except UnreadableChunkError:
            continue  # nothing a reader could have had from it either
        have = _num_rows(cold / path.name, table)
        if rows.num_rows > have:
            found.setdefault(table, []).append(rows.slice(have))
    return {table: pa.concat_tables(parts) for table, parts in found.items()}


def _num_rows(path: Path, table: str) -> int:
    """Rows of the run dir's copy of a segment (a mirror copies a prefix: those come first)."""
    try:
        return journal_read.read_segment(path, table).num_rows if path.exists() else 0
    except UnreadableChunkError:
        return 0


def loss_markers(lost: dict[str, pa.Table], *, reason: str, hot: Path) -> list[list[object]]:
    """One ``dropped_rows`` marker row (``schema.MARKERS`` columns) per table of ``lost``.

    A table without steps (meta, units) spans every step the other tables lost rows in; the
    marker's own step is its range's last, which the reader checks ranges against.
    """
    spans = {table: _span(data) for table, data in lost.items()}
    last = max((s[2] for s in spans.values() if s is not None), default=0)
    t_ns = min((int(np.min(d.column("t_ns").to_numpy())) for d in lost.values()
                if "t_ns" in d.column_names), default=time.monotonic_ns())
    where = f"{socket.gethostname()}:{hot}"
    rows = []
    for table, data in sorted(lost.items()):
        first_step, first_micro, last_step = spans[table] or (0, 0, last)
        detail = {"table": table, "first_step": first_step, "first_micro_step": first_micro,
                  "last_step": last_step, "last_micro_step": MAX_MICRO_STEP,
                  "unwritten": reason[:MAX_REASON_CHARS], "kept_in": where[:MAX_REASON_CHARS]}
        rows.append([0, t_ns, last_step, 0, schema.MARKER_DROPPED_ROWS, data.num_rows,
                     json.dumps(detail)])
    return rows


def _span(data: pa.Table) -> tuple[int, int, int] | None:
    """(first step, its first micro-step, last step) of rows, or None without a step column."""
    if "step" not in data.column_names or not data.num_rows:
        return None
    steps = np.maximum(data.column("step").to_numpy(zero_copy_only=False), 0)
    first = int(steps.min())
    micro = 0
    if "micro_step" in data.column_names:
        micros = data.column("micro_step").to_numpy(zero_copy_only=False)
        micro = int(np.clip(micros[steps == first].min(), 0, MAX_MICRO_STEP))
    return first, micro, int(steps.max())


def _segment(rows: list[list[object]], run_dir: Path, writer: str) -> bytes:
    """A framed markers segment (``journal_format``) holding ``rows`` as one record."""
    recording = [read_launch(run_dir) or "", LOSS_WRITER.format(writer=writer),
                 str(os.getpid()), str(time.time_ns())]
    vocab = json.dumps({RECORDING_KEY: recording}).encode()
    offset = -(-(HEADER.size + len(vocab)) // 8) * 8
    head = bytearray(offset)
    HEADER.pack_into(head, 0, MAGIC, KIND_FRAMED, 0, offset, len(vocab))
    head[HEADER.size:HEADER.size + len(vocab)] = vocab
    payload = json.dumps(rows, separators=(",", ":")).encode()
    return bytes(head) + FRAME.pack(len(payload)) + payload + FRAME.pack(len(payload))
