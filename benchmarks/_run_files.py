"""Write one synthetic rank's tables as the recorder leaves them on disk.

A rank that closed: what the writer process's ``finish`` leaves, one compacted part per table
named by the journal segments it holds (``part-<writer>-000001-<last>.parquet``), stamped and
compressed like ``PartWriter``'s parts. A dead rank (its node lost: training and writer process
killed together): the recorder's own journal code writes its rows into segments, and
``PartWriter`` converts the full ones as its flush passes did; the open segments stay in
``RUN_DIR/journal/rank=<r>/``, cut to what the mirror copies, for the reader to fold in.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdptrace.record.journal import (
    FIRST_SEGMENT_BYTES,
    MAX_SEGMENT_BYTES,
    FixedTable,
    FramedTable,
    open_table,
)
from fsdptrace.record.part_writer import PartWriter
from fsdptrace.store import journal_hot, journal_read, schema
from fsdptrace.store.journal_format import (
    FIXED_TABLES,
    JOURNAL_DIR,
    RANGE_PART_FILE,
    dictionary_columns,
)
from fsdptrace.version import __version__

# Tables the recorder opens before the first step, so their first segment exists even when
# they stay empty; the others (no eval forward, no live check) keep the empty part only.
# Tables the recorder opens at its start (the others with their first row: an eval forward,
# a live finding, an FSDP collective).
OPENED_AT_START = frozenset(schema.TABLES) - {"eval_forwards", "findings", "collectives"}
# A framed row's JSON, about: sizes the compacted part's segment range of a closed rank.
_FRAMED_ROW_BYTES = 64


def write_closed(run_dir: Path, rank: int, writer: str, tables: dict[str, pa.Table]) -> None:
    """One compacted part per table, as ``PartWriter.finish`` leaves a rank that closed, and
    the rank's journal folder, which a recorder makes at its start and leaves empty."""
    (run_dir / JOURNAL_DIR / schema.RANK_DIR.format(rank=rank)).mkdir(parents=True,
                                                                      exist_ok=True)
    for name in schema.TABLES:
        table = tables.get(name, schema.TABLES[name].empty_table())
        directory = run_dir / schema.TABLE_DIR.format(table=name) / schema.RANK_DIR.format(
            rank=rank)
        directory.mkdir(parents=True, exist_ok=True)
        last = last_segment(name, table.num_rows)
        # Segments count from 1; the empty part of the start (0-0) stays only where none was.
        path = directory / RANGE_PART_FILE.format(writer=writer, first=min(1, last), last=last)
        # The rows are in the declared schema already: only the footer's stamp differs.
        stamped = table.replace_schema_metadata(schema.with_metadata(
            schema.TABLES[name], rank=rank, version=__version__).metadata)
        pq.write_table(stamped, path, compression="zstd")


def last_segment(table: str, num_rows: int) -> int:
    """The index of the last journal segment ``num_rows`` rows fill, with the recorder's
    segment sizes (doubling from the first to the largest); 0 for a table never opened."""
    if not num_rows:
        return 1 if table in OPENED_AT_START else 0
    row_bytes = (journal_read.fixed_dtype(table).itemsize if table in FIXED_TABLES
                 else _FRAMED_ROW_BYTES)
    size, index, left = FIRST_SEGMENT_BYTES, 0, num_rows
    while left > 0:
        index += 1
        left -= max(1, (size - 4096) // row_bytes)  # less the header and vocabulary, about
        size = min(2 * size, MAX_SEGMENT_BYTES)
    return index


def write_dead(run_dir: Path, rank: int, writer: str, tables: dict[str, pa.Table], *,
               segment_bytes: tuple[int, int] = (FIRST_SEGMENT_BYTES, MAX_SEGMENT_BYTES)
               ) -> None:
    """A rank whose node died: full segments in Parquet, the open ones in the journal."""
    parts = PartWriter(run_dir, rank=rank, version=__version__, writer_id=writer)
    parts.journal_dir.mkdir(parents=True, exist_ok=True)
    parts.write_empty_tables()
    for name, table in tables.items():
        if table.num_rows or name in OPENED_AT_START:
            journal_rows(parts.journal_dir, name, writer, table, segment_bytes)
    parts.convert(final=False)  # the flush passes before the node died
    for path in journal_hot.segment_files(parts.journal_dir, writer):
        data = path.read_bytes()  # the mirror copies only what a segment uses
        path.write_bytes(data[:journal_hot.used_length(data)])


def journal_rows(directory: Path, name: str, writer: str, table: pa.Table,
             segment_bytes: tuple[int, int]) -> None:
    """``table``'s rows appended to journal segments by the recorder's own tables."""
    vocab = {c: _words(table.column(c)) for c in dictionary_columns(name)}

    def fail(error: BaseException) -> None:
        raise error

    sink = open_table(directory, name, writer, vocab, fail, segment_bytes)
    if isinstance(sink, FixedTable):
        _fill_fixed(sink, name, table)
    else:
        assert isinstance(sink, FramedTable)
        sink.extend([list(row.values()) for row in table.to_pylist()])
        sink.segments.abandoned = True  # the process died: nothing more is written


def _words(column: pa.ChunkedArray) -> list[str]:
    return column.combine_chunks().dictionary.to_pylist() if len(column) else []


def _fill_fixed(sink: FixedTable, name: str, table: pa.Table) -> None:
    """Store the rows slot by slot into the segments the recorder's table maps, a segment at a
    time: the slots ``FixedTable.append`` packs, filled from numpy instead of one call a row."""
    dtype = journal_read.fixed_dtype(name)
    rows = np.zeros(table.num_rows, dtype)
    for field in schema.TABLES[name]:
        column = table.column(field.name).combine_chunks()
        if pa.types.is_dictionary(field.type):
            column = column.indices.fill_null(-1)
        rows[field.name] = column.to_numpy(zero_copy_only=False)
    rows["_trailer"] = rows[schema.TABLES[name].names[0]]
    segments, done = sink.segments, 0
    while done < len(rows) or not segments.index:
        opened = segments.open_next(dtype.itemsize)
        assert opened is not None, f"cannot create a {name} segment"
        mapped, size = opened
        fits = min(len(rows) - done, (size - segments.offset) // dtype.itemsize)
        view = np.frombuffer(mapped, dtype, fits, segments.offset)
        view[:] = rows[done:done + fits]
        del view
        mapped.flush()
        _close(mapped)
        done += fits
    segments.abandoned = True


def _close(mapped: mmap.mmap) -> None:
    try:
        mapped.close()
    except BufferError:  # a view still exported: the mapping goes with it
        pass
