"""Chunks too damaged to read: skipped with one warning, their steps counted as incomplete.

A disk that filled up or a copy cut short leaves a chunk that is truncated or corrupt. Refusing
the whole run dir for it would hide every other rank and step, so the reader skips it; but a
check must not read the rows it held as something the job did not do. The steps it covered
(from the last step of the readable chunk before it to the first step of the one after it, in
the same table and rank) become a ``dropped_rows`` marker of that rank, which
``checks.incomplete`` already cuts out of the checks that would misread a gap.

Each skipped chunk is said once per process (``note``); the map step's worker processes keep
quiet (``quiet``) and hand what they skipped to the parent, which says it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fsdptrace.errors import SkippedChunkWarning, UnreadableChunkError
from fsdptrace.store import journal_read, schema
from fsdptrace.store.journal_hot import SEGMENT_SUFFIX
from fsdptrace.store.key_ranges import MAX_MICRO_STEP

# Micro-steps a gap covers at its edges: all of them (the chunk's own are unknown).
_LAST_MICRO_STEP = MAX_MICRO_STEP


class SkippedChunk(NamedTuple):
    path: Path
    table: str
    rank: int
    reason: str


_skipped: dict[Path, SkippedChunk] = {}
_announce = True
# Chunks this process read whole without error, with their size and mtime then: the gap
# probe opens no footer of theirs unless a neighbour is damaged or the file changed since
# (a notebook re-reads a run dir whose file was rewritten in place). Bounded: the probe follows
# the read of the same rank, so recent files are what count, and each entry holds a Path
# (~0.5 KiB with its parts): 2**18 of them were ~70 MiB of the map step at 10,240 ranks.
_read_whole: dict[Path, tuple[int, int] | None] = {}
_MAX_READ_WHOLE = 1 << 14


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        status = path.stat()
    except OSError:
        return None
    return (status.st_size, status.st_mtime_ns)


def read_whole(path: Path) -> None:
    """Remember that ``path`` was read without error (``reader.read_file``)."""
    if len(_read_whole) >= _MAX_READ_WHOLE:
        _read_whole.clear()
    _read_whole[path] = _identity(path)


def _unchanged_since_read(path: Path) -> bool:
    known = _read_whole.get(path)
    return known is not None and known == _identity(path)


def note(chunk: SkippedChunk) -> None:
    """Remember a skipped chunk and, the first time in this process, warn about it."""
    if chunk.path in _skipped:
        return
    _skipped[chunk.path] = chunk
    if _announce:
        what = "journal segment" if chunk.path.name.endswith(SEGMENT_SUFFIX) else "Parquet"
        warnings.warn(
            f"skipping {chunk.path}: unreadable {what} ({chunk.reason}); it is truncated or "
            "corrupt - the steps it covered count as incomplete", SkippedChunkWarning,
            stacklevel=2)


def noted() -> list[SkippedChunk]:
    """Every chunk this process skipped so far, in order."""
    return list(_skipped.values())


def reset() -> None:
    """Forget what was skipped (a new command): each says its skipped chunks again."""
    _skipped.clear()


def quiet() -> None:
    """Skip without warning (a worker process: its parent warns for what it hands back)."""
    global _announce
    _announce = False


def gap_markers(parts: dict[str, list[Path]], rank: int, *, last_step: int, t_ns: int
                ) -> pa.Table | None:
    """``dropped_rows`` markers for the unreadable chunks among one rank's ``parts``
    (``{table: chunk files in order}``); ``None`` when every chunk is readable.

    Chunks whose footer cannot be read are found here (and noted); those that fail later, on
    their data, are known from ``note``. Steps are capped at ``last_step`` (the last the
    rank's markers vouch for): footers come from someone else's job, and a range is spelled
    out step by step downstream. ``t_ns``: when the markers say so (the rank's first marker,
    so a timeline's origin stays where it was).
    """
    spans: dict[Path, tuple[int, int] | None] = {}
    bad: dict[Path, str] = {}
    unprobed = []
    for table, files in parts.items():
        for path in files:
            known = _skipped.get(path)
            if known is not None:
                bad[path] = table
                continue
            if _unchanged_since_read(path):
                unprobed.append(path)
                continue
            try:
                spans[path] = _span(path, table)
            except (pa.ArrowException, OSError, UnreadableChunkError) as error:
                if not path.exists():
                    continue  # a writer's compaction replaced it after we listed: not damage
                reason = getattr(error, "reason", None) or (
                    str(error).strip().splitlines() or [type(error).__name__])[0]
                note(SkippedChunk(path, table, rank, reason))
                bad[path] = table
    if not bad:
        return None
    for path in unprobed:  # a neighbour of a gap: its steps bound the gap
        try:
            spans[path] = _span(path, next(t for t, files in parts.items() if path in files))
        except (pa.ArrowException, OSError, UnreadableChunkError):
            continue  # replaced since it was read: no bound from it
    capped = {p: (min(s[0], last_step), min(s[1], last_step)) if s else None
              for p, s in spans.items()}
    last_recorded = max((span[1] for span in capped.values() if span), default=0)
    rows = [_gap_row(path, table, parts[table], capped, last_recorded) | {"t_ns": t_ns}
            for path, table in bad.items()]
    return pa.Table.from_pylist(rows, schema=schema.TABLES["markers"].remove_metadata())


def _gap_row(path: Path, table: str, files: list[Path],
             spans: dict[Path, tuple[int, int] | None], last_recorded: int) -> dict[str, object]:
    at = files.index(path)
    before = [s for p in files[:at] if (s := spans.get(p))]
    after = [s for p in files[at + 1:] if (s := spans.get(p))]
    first = before[-1][1] if before else 0
    last = max(after[0][0] if after else last_recorded, first)
    detail = {"table": table, "first_step": first, "first_micro_step": 0, "last_step": last,
              "last_micro_step": _LAST_MICRO_STEP, "unreadable_chunk": path.name}
    # seq -1: before every real marker, so "how the recording ended" still reads the last one.
    return {"seq": -1, "step": first, "micro_step": 0,
            "kind": schema.MARKER_DROPPED_ROWS, "count": 0, "detail": json.dumps(detail)}


def _span(path: Path, table: str) -> tuple[int, int] | None:
    """(first, last) step of a chunk: a Parquet part's footer, a journal segment's rows."""
    if path.name.endswith(SEGMENT_SUFFIX):
        return _segment_step_span(path, table)
    return _step_span(pq.ParquetFile(path).metadata)


def _segment_step_span(path: Path, table: str) -> tuple[int, int] | None:
    """(first, last) optimizer step of a journal segment's rows; ``None`` without rows or steps.
    Here, not in ``store.journal_read``: the writer process imports that module, and
    ``pyarrow.compute`` would cost each writer 40 ms of start-up for a reader's question."""
    data = journal_read.read_segment(path, table)
    if "step" not in data.column_names or not data.num_rows:
        return None
    bounds = pc.min_max(data.column("step")).as_py()
    if bounds["min"] is None:
        return None
    return max(int(bounds["min"]), 0), max(int(bounds["max"]), 0)


def _step_span(metadata: pq.FileMetaData) -> tuple[int, int] | None:
    """(first, last) optimizer step of a chunk from its footer statistics; ``None`` for a
    table without steps or a chunk without rows or statistics."""
    names = metadata.schema.names
    if "step" not in names or not metadata.num_rows:
        return None
    column = names.index("step")
    lows, highs = [], []
    for index in range(metadata.num_row_groups):
        stats = metadata.row_group(index).column(column).statistics
        if stats is None or not stats.has_min_max:
            return None
        if not (isinstance(stats.min, int) and isinstance(stats.max, int)):
            return None  # not a step column; read_file will say so
        lows.append(max(stats.min, 0))
        highs.append(max(stats.max, 0))
    return (min(lows), max(highs)) if lows else None


__all__ = ["SkippedChunk", "gap_markers", "note", "noted", "quiet", "read_whole", "reset"]
