"""Read a run dir's Parquet safely: one rank at a time, every file checked before it is trusted.

Run dirs come from other people's jobs: this module only ever parses Parquet (no pickle, no
eval), names the offending file in every error, and tells apart "not a run dir", "a corrupt
file" and "written by a newer fsdptrace".
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fsdptrace.errors import RunDirError, UnreadableChunkError
from fsdptrace.reading import chunk_gaps, validate
from fsdptrace.store import fatal_signals, journal_hot, journal_read, schema
from fsdptrace.store.journal_format import JOURNAL_DIR, RANGE_PART_NAME, is_loss_writer
from fsdptrace.store.run_dirs import launch_dirs

_PART_FILE = re.compile(r"^part-.*\.parquet$")
# Rows from which a chunk is decoded on several threads.
_THREADED_ROWS = 1 << 16


def check_run_dir(run_dir: Path) -> None:
    """Fail with one clear line unless ``run_dir`` looks like a fsdptrace run dir."""
    if not run_dir.exists():
        raise RunDirError(f"run dir {run_dir} does not exist")
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is not a directory (expected a fsdptrace run dir)")
    if not any(rank_dirs(run_dir, table) for table in (*schema.REQUIRED_TABLES, JOURNAL_DIR)):
        launches = launch_dirs(run_dir)
        if launches:
            raise RunDirError(
                f"{run_dir} holds {len(launches)} launches recorded with --append "
                f"({', '.join(p.name for p in launches)}): analyze one of them, e.g. "
                f"{launches[-1]}")
        raise RunDirError(
            f"no rank partitions under {run_dir}: is this a fsdptrace run dir? "
            "(expected meta/rank=<n>/part-*.parquet and units/rank=<n>/...)"
        )
    journal = rank_dirs(run_dir, JOURNAL_DIR).values()
    if not any(any(p.iterdir()) for p in journal) and not _any_readable_chunk(run_dir):
        raise RunDirError(
            f"nothing readable left in {run_dir}: every meta and units chunk is truncated or "
            "corrupt"
        )


def _any_readable_chunk(run_dir: Path) -> bool:
    """Whether some meta or units chunk has a readable footer (the first found ends the scan)."""
    for table in schema.REQUIRED_TABLES:
        for partition in rank_dirs(run_dir, table).values():
            for path in part_files(partition):
                try:
                    pq.ParquetFile(path)  # reads and parses the footer
                except (pa.ArrowException, OSError):
                    continue
                return True
    return False


def rank_dirs(run_dir: Path, table: str) -> dict[int, Path]:
    """``{rank: path}`` of one table's hive partitions; other entries are ignored."""
    table_dir = run_dir / table
    if not table_dir.is_dir():
        return {}
    found: dict[int, Path] = {}
    for entry in table_dir.iterdir():
        rank = validate.partition_rank(entry.name, table_dir=table_dir)
        if rank is not None and entry.is_dir():
            if rank in found:
                raise RunDirError(
                    f"rank {rank} has two partitions under {table_dir} "
                    f"({found[rank].name}, {entry.name}): rename or remove one"
                )
            found[rank] = entry
    return found


def discover_ranks(run_dir: Path) -> list[int]:
    """Every rank with a partition in any table."""
    ranks: set[int] = set()
    for table in schema.TABLES:
        ranks.update(rank_dirs(run_dir, table))
    ranks.update(rank_dirs(run_dir, JOURNAL_DIR))  # a rank killed before its first part
    return sorted(ranks)


def part_files(partition: Path) -> list[Path]:
    """Complete chunk files of a partition; temp files of an interrupted write are skipped.

    Of schema-2 parts, one whose segment range lies inside another part's range of the same
    writer is skipped: a compaction was interrupted after its rename.
    """
    files = sorted(p for p in partition.iterdir() if p.is_file() and _PART_FILE.match(p.name))
    inside = _inside_others(covered_ranges(files))
    return [p for p in files if not _in(p, inside)]


def covered_ranges(files: list[Path]) -> dict[str, list[tuple[int, int]]]:
    """``{writer: [(first, last), ...]}`` of the schema-2 parts among ``files``."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for path in files:
        match = RANGE_PART_NAME.match(path.name)
        if match:
            ranges.setdefault(match["writer"], []).append((int(match["first"]),
                                                           int(match["last"])))
    return ranges


def _inside_others(ranges: dict[str, list[tuple[int, int]]]) -> set[tuple[str, int, int]]:
    """(writer, first, last) of each range inside another range of its writer: one sort per
    writer, so thousands of parts are listed in time proportional to their number."""
    inside = set()
    for writer, spans in ranges.items():
        # Sorted by first, longest first: a range lies inside another exactly when a range
        # before it reaches as far (equal ranges are one part: set).
        reach = -1
        for first, last in sorted(set(spans), key=lambda s: (s[0], -s[1])):
            if reach >= last:
                inside.add((writer, first, last))
            reach = max(reach, last)
    return inside


def _in(path: Path, inside: set[tuple[str, int, int]]) -> bool:
    match = RANGE_PART_NAME.match(path.name) if inside else None
    return match is not None and (match["writer"], int(match["first"]),
                                  int(match["last"])) in inside


def read_file(path: Path, table: str, *, row_groups: list[int] | None = None,
              footer: pq.FileMetaData | None = None) -> pa.Table:
    """Read one chunk, check its schema version, columns and values (``reading.validate``).

    The footer is checked before any data is read, and only the declared columns are read,
    text dictionary-encoded, so a file's claims cannot make the reader allocate beyond it.
    ``row_groups``: read only these (the file's footer is checked whole all the same);
    ``footer``: the file's footer, when the caller has parsed it already.
    """
    expected = schema.TABLES[table]
    try:
        parquet = _open(path, expected, footer)
        validate.check_footer(path, parquet.metadata)
        present = set(parquet.schema_arrow.names)
        columns = [n for n in expected.names if n in present]
        # Threads pay off on big chunks only: the map step fans out over processes.
        threads = parquet.metadata.num_rows >= _THREADED_ROWS
        if row_groups is None:
            data = parquet.read(columns=columns, use_threads=threads)
        else:
            data = parquet.read_row_groups(row_groups, columns=columns, use_threads=threads)
    except pa.ArrowMemoryError:
        raise  # not the file's fault: never call it corrupt
    except (pa.ArrowException, OSError) as error:
        raise UnreadableChunkError(
            f"{path}: unreadable Parquet ({_first_line(error)}); it is truncated or corrupt - "
            "move it aside to analyze the rest", reason=_first_line(error)
        ) from None
    metadata = parquet.schema_arrow.metadata or {}
    version = metadata.get(schema.SCHEMA_VERSION_KEY)
    if version is None:
        raise RunDirError(f"{path}: not written by fsdptrace (no schema version in the footer)")
    writer = metadata.get(schema.FSDPTRACE_VERSION_KEY, b"?").decode(errors="replace")
    if version.decode(errors="replace") not in {str(v) for v in schema.READABLE_SCHEMA_VERSIONS}:
        raise RunDirError(
            f"{path}: written by fsdptrace {writer} with schema "
            f"{version.decode(errors='replace')}; this fsdptrace reads schema "
            f"{' and '.join(map(str, schema.READABLE_SCHEMA_VERSIONS))}"
        )
    missing = [name for name in expected.names if name not in data.column_names]
    if missing:
        raise RunDirError(f"{path}: not a {table} table (missing columns {', '.join(missing)})")
    validate.check_strings(data, path=path)
    conformed = _conform(data.select(expected.names), expected, path=path, table=table)
    validate.check_values(conformed, table=table, path=path)
    if row_groups is None:
        chunk_gaps.read_whole(path)
    return conformed


def _open(path: Path, expected: pa.Schema, footer: pq.FileMetaData | None
          ) -> pq.ParquetFile:
    """The file, its text columns to be read dictionary-encoded (one open, one footer parse
    when every declared column is there, as the recorder writes them)."""
    text = [f.name for f in expected if _is_text(f.type)]
    try:
        return pq.ParquetFile(path, metadata=footer, read_dictionary=text)
    except KeyError:  # a declared text column is missing, or no text: name only text ones
        plain = pq.ParquetFile(path, metadata=footer)
        present = plain.schema_arrow
        return pq.ParquetFile(path, metadata=plain.metadata, read_dictionary=[
            n for n in text if n in present.names and _is_text(present.field(n).type)])


def _is_text(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind)


def _conform(data: pa.Table, expected: pa.Schema, *, path: Path, table: str) -> pa.Table:
    try:
        return data.cast(expected.remove_metadata())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as error:
        # One line naming the file: the schema's own text spans many lines.
        raise RunDirError(
            f"{path}: column types do not match the {table} table ({_first_line(error)})"
        ) from None


_RELIST_ATTEMPTS = 5


def read_rank(run_dir: Path, table: str, rank: int, *, highest_rank: int | None = None,
              gaps: bool = True, journal: RankJournal | None = None) -> pa.Table:
    """All chunks of one table for one rank, as one table with a ``rank`` column.

    ``highest_rank``: the highest rank with a meta partition (``highest_meta_rank``), which
    the meta table's world size is checked against; a caller reading many ranks lists it
    once, not once per rank. ``gaps=False``: markers without the ``dropped_rows`` rows of
    other tables' unreadable chunks (no footer of theirs is opened), for a reader of endings.
    ``journal``: the rank's ``rank_journal``, for a caller reading several of its tables.

    A writer process may be converting or compacting while we read (a rank still running,
    or one that just died). Segments are listed before parts, so a segment converted in
    between is found in its part (and skipped as covered); a listed file that vanished means
    a compaction replaced it, so everything is listed and read again.
    """
    partition = run_dir / table / schema.RANK_DIR.format(rank=rank)
    journal = journal or rank_journal(run_dir, rank)
    for attempt in range(_RELIST_ATTEMPTS):
        segments = journal.segments(table)
        files = part_files(partition) if partition.is_dir() else []
        try:
            parts = _read_readable(files, table, rank)
            parts += _journal_tail(segments, table, covered_ranges(files), rank)
            break
        except (RunDirError, FileNotFoundError):
            listed = [*files, *segments.values()]
            if attempt + 1 == _RELIST_ATTEMPTS or all(p.exists() for p in listed):
                raise
    data = _concat(parts, table)
    if table == "meta":
        highest = highest_meta_rank(run_dir) if highest_rank is None else highest_rank
        validate.check_world_size(data, highest_rank=max(highest, rank), partition=partition)
    elif table == "markers":
        validate.check_drop_details(data, partition=partition)
    if table == "markers" and gaps:
        # After the check: a gap's range is not one the rank's own markers vouch for.
        last_step = int(pc.max(data.column("step")).as_py() or 0) if data.num_rows else 0
        first_t_ns = int(pc.min(data.column("t_ns")).as_py() or 0) if data.num_rows else 0
        gap_rows = chunk_gaps.gap_markers(_rank_parts(run_dir, rank, journal), rank,
                                          last_step=last_step + validate.STEP_RANGE_MARGIN,
                                          t_ns=first_t_ns)
        if gap_rows is not None:
            data = pa.concat_tables([data, gap_rows.cast(data.schema)]).unify_dictionaries()
    if table == "markers":
        data = _with_fatal_signal(data, run_dir, rank)
    if not data.num_rows:  # thousands of ranks without this table: one shared empty table
        return empty_table(table, ranked=True)
    return with_rank(data, rank)


def _with_fatal_signal(markers: pa.Table, run_dir: Path, rank: int) -> pa.Table:
    """The rank's markers and, if it died by a fatal signal, that ending as their last row.

    The dying process could write no marker: the ending comes from its faulthandler dump
    (``fatal_signals``), placed at the step and micro-step of the last marker recorded.
    """
    dump = fatal_signals.read_fatal_dump(run_dir, rank)
    if dump is None:
        return markers
    last = {"seq": 0, "t_ns": 0, "step": 0, "micro_step": 0}
    if markers.num_rows:
        at = int(pc.index(markers.column("seq"), pc.max(markers.column("seq"))).as_py())
        last = {c: int(markers.column(c)[at].as_py() or 0) for c in last}
        last["t_ns"] = int(pc.max(markers.column("t_ns")).as_py() or 0)
    row = pa.table({"seq": [last["seq"] + 1], "t_ns": [last["t_ns"] + 1],
                    "step": [last["step"]], "micro_step": [last["micro_step"]],
                    "kind": [schema.MARKER_FATAL_SIGNAL], "count": [0],
                    "detail": [fatal_signals.marker_detail(dump)]})
    row = row.cast(markers.schema.remove_metadata(), safe=False)
    return pa.concat_tables([markers.cast(row.schema), row]).unify_dictionaries()


def highest_meta_rank(run_dir: Path) -> int:
    """The highest rank with a meta partition (0 when none)."""
    return max(rank_dirs(run_dir, "meta"), default=0)


def _read_readable(files: list[Path], table: str, rank: int) -> list[pa.Table]:
    """``read_file`` of each file; a truncated or corrupt one is skipped (``chunk_gaps``)."""
    parts = []
    for path in files:
        try:
            parts.append(read_file(path, table))
        except UnreadableChunkError as error:
            if not path.exists():
                raise  # a compaction replaced it while we read: list again
            chunk_gaps.note(chunk_gaps.SkippedChunk(path, table, rank, error.reason))
    return parts


def _rank_parts(run_dir: Path, rank: int, journal: RankJournal) -> dict[str, list[Path]]:
    """Every table's chunk files of one rank, in order: Parquet parts, then the journal
    segments no part covers (the tail a rank left; a skipped one is a gap like a part)."""
    found = {}
    for table in schema.TABLES:
        partition = run_dir / table / schema.RANK_DIR.format(rank=rank)
        files = part_files(partition) if partition.is_dir() else []
        tail = tail_segments(journal.segments(table), covered_ranges(files))
        if files or tail:
            found[table] = files + tail
    return found


@dataclass(frozen=True)
class RankJournal:
    """Where one rank's journal segments are: the run dir's journal folder and, for a rank
    this host recorded, its private hot folder (``journal_hot``).

    Found once per rank (``rank_journal``) and listed anew per table, also when ``read_rank``
    lists again: naming the hot folder resolves the path and reads the run's mark, a quarter of
    reading a small run when each table did it.
    """

    cold: Path
    hot: Path | None

    def segments(self, table: str) -> dict[tuple[str, int], Path]:
        """The rank's segments of ``table`` by (writer, index).

        A rank on this host that is still writing (or just died, its writer process not done)
        has its newest bytes in its hot folder: those copies win over the run dir's.
        """
        if not self.cold.is_dir():  # none yet, or not a folder (a link to itself: ELOOP)
            return {}
        found = {(w, i): p for w, i, p in journal_read.segments(self.cold, table)}
        if self.hot is not None:
            found.update({(w, i): p for w, i, p in journal_read.segments(self.hot, table)})
            # The loss markers name rows only the hot folder holds (``record.unwritten``):
            # read here, they are not missing.
            found = {key: path for key, path in found.items() if not is_loss_writer(key[0])}
        return found


def rank_journal(run_dir: Path, rank: int) -> RankJournal:
    """``rank``'s journal folders, for reading several of its tables."""
    cold = run_dir / JOURNAL_DIR / schema.RANK_DIR.format(rank=rank)
    # A writer makes its hot folder only once the journal folder exists.
    hot = journal_hot.hot_dir(cold, create=False) if cold.is_dir() else None
    return RankJournal(cold, hot)


def tail_segments(segments: dict[tuple[str, int], Path],
                  ranges: dict[str, list[tuple[int, int]]]) -> list[Path]:
    """Segments no part covers, in writing order (a deletion may have been cut)."""
    return [path for (writer, index), path in sorted(segments.items())
            if not any(a <= index <= b for a, b in ranges.get(writer, ()))]


def _journal_tail(segments: dict[tuple[str, int], Path], table: str,
                  ranges: dict[str, list[tuple[int, int]]], rank: int) -> list[pa.Table]:
    """Rows a rank left in its journal; a segment that cannot be read is skipped with one
    warning, its steps counted as incomplete (``chunk_gaps``), as an unreadable part is."""
    tail = []
    for path in tail_segments(segments, ranges):
        try:
            data = journal_read.read_segment(path, table)
        except UnreadableChunkError as error:
            if not path.exists():
                raise  # converted and removed while we read: list again
            chunk_gaps.note(chunk_gaps.SkippedChunk(path, table, rank, error.reason))
            continue
        validate.check_values(data, table=table, path=path)
        chunk_gaps.read_whole(path)
        tail.append(data)
    return tail


def read_ranks(run_dir: Path, table: str, ranks: Iterable[int],
               journals: Mapping[int, RankJournal] | None = None) -> pa.Table:
    """``read_rank`` of each rank; ``journals``: their ``rank_journal``s, for a caller reading
    several tables."""
    journals = journals or {}
    return concat_ranks([read_rank(run_dir, table, rank, journal=journals.get(rank))
                         for rank in ranks], table)


def concat_ranks(tables: list[pa.Table], table: str) -> pa.Table:
    """``read_rank`` results of several ranks as one table (a batch of the map step)."""
    return _concat(tables, table, ranked=True)


def _concat(tables: list[pa.Table], table: str, *, ranked: bool = False) -> pa.Table:
    tables = [t for t in tables if t.num_rows] or tables[:1]
    if not tables:
        return empty_table(table, ranked=ranked)
    if len(tables) == 1:
        return tables[0]
    # No combine_chunks: to_pandas concatenates chunks anyway, a second copy costs time.
    return pa.concat_tables(tables).unify_dictionaries()


@functools.cache
def empty_table(table: str, *, ranked: bool = False) -> pa.Table:
    """``table`` with no rows (and a ``rank`` column if ``ranked``), built once: a run of
    5,000 ranks reads 70,000 rank tables, most of them empty, and building an empty table
    costs more than reading a small Parquet part."""
    empty = schema.TABLES[table].remove_metadata().empty_table()
    return with_rank(empty, 0) if ranked else empty


def with_rank(data: pa.Table, rank: int) -> pa.Table:
    if "rank" in data.column_names:
        return data
    return data.add_column(0, "rank", pa.array(np.full(data.num_rows, rank, dtype=np.int32)))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
