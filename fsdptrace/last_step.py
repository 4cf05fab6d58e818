"""Read a rank's last recorded step, not its history: what hang triage needs of the events.

After a hang a person asks where each rank stopped (check 6): the last unit each rank entered
and its position in that pass. Those are the rows of the step holding the rank's highest
``seq``. Parquet row-group statistics (min/max of ``seq`` and ``step``, in every footer the
recorder writes) say which row groups can hold them, so a deep rank's history stays on disk.

The rows returned are exactly the rows of ``reader.read_rank(run_dir, "events", rank)`` in
those row groups, in the same order: ``positions.last_positions`` gives the same answer on
them. Where the statistics cannot vouch for that (a footer without them, a damaged chunk, a
chunk replaced while we list), the whole rank is read as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fsdptrace import reader, schema
from fsdptrace.errors import FsdptraceError

TABLE = "events"


class _Group(NamedTuple):
    file: int
    row_group: int
    max_seq: int | None
    min_step: int | None
    max_step: int | None


def read_last_step(run_dir: Path, rank: int) -> pa.Table:
    """The events of ``rank``'s last recorded step (with a ``rank`` column)."""
    partition = run_dir / TABLE / schema.RANK_DIR.format(rank=rank)
    segments = reader.journal_segments(run_dir, TABLE, rank)
    if segments or not partition.is_dir():
        # A journal tail (a rank that died) is read whole, and so is its rank: rare and small.
        return reader.read_rank(run_dir, TABLE, rank)
    files = reader.part_files(partition)
    try:
        footers = [pq.read_metadata(path) for path in files]
        groups = [g for i, footer in enumerate(footers) for g in _groups(i, footer, files[i])]
    except (pa.ArrowException, OSError, FsdptraceError):
        return reader.read_rank(run_dir, TABLE, rank)  # it skips or names the damage
    if any(g.max_seq is None or g.min_step is None or g.max_step is None for g in groups):
        return reader.read_rank(run_dir, TABLE, rank)
    top = max((g.max_seq for g in groups if g.max_seq is not None), default=None)
    if top is None:
        return reader.read_rank(run_dir, TABLE, rank)
    try:
        first = {g for g in groups if g.max_seq == top}
        data = _read(files, footers, sorted(first))
        step = _step_at_max_seq(data)
        wanted = {g for g in groups if g.min_step <= step <= g.max_step}  # type: ignore[operator]
        if not wanted <= first:  # the step began in earlier row groups: read them in order
            data = _read(files, footers, sorted(wanted | first))
    except (FsdptraceError, FileNotFoundError):
        return reader.read_rank(run_dir, TABLE, rank)
    return reader.with_rank(data, rank)


def _groups(file: int, metadata: pq.FileMetaData, path: Path) -> list[_Group]:
    names = [metadata.schema.column(i).name for i in range(metadata.num_columns)]
    if "seq" not in names or "step" not in names:
        raise FsdptraceError(f"{path}: no seq or step column")
    seq, step = names.index("seq"), names.index("step")
    out = []
    for index in range(metadata.num_row_groups):
        group = metadata.row_group(index)
        seq_stats, step_stats = group.column(seq).statistics, group.column(step).statistics
        known = (seq_stats is not None and seq_stats.has_min_max and step_stats is not None
                 and step_stats.has_min_max)
        out.append(_Group(file, index, seq_stats.max if known else None,  # type: ignore[union-attr]
                          step_stats.min if known else None,  # type: ignore[union-attr]
                          step_stats.max if known else None))  # type: ignore[union-attr]
    return out


def _read(files: list[Path], footers: list[pq.FileMetaData], groups: list[_Group]
          ) -> pa.Table:
    """The rows of ``groups``, file by file in the reader's order, each file checked."""
    by_file: dict[int, list[int]] = {}
    for group in sorted(groups):
        by_file.setdefault(group.file, []).append(group.row_group)
    parts = [reader.read_file(files[f], TABLE, row_groups=indices, footer=footers[f])
             for f, indices in sorted(by_file.items())]
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts).unify_dictionaries()


def _step_at_max_seq(data: pa.Table) -> int:
    at = pc.index(data.column("seq"), pc.max(data.column("seq")))
    return int(data.column("step")[at.as_py()].as_py())
