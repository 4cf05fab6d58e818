"""Check a run dir's files and values once, at the reader, so nothing downstream trusts a lie.

Run dirs come from other people's jobs. The checks index, range over and group by what the
files say (ranks, world size, step ranges, phases, prefetch indexes), so a value no recorder
writes would surface far away as a traceback, or as a ``range()`` of two billion steps. This
module refuses such a file with one ``RunDirError`` naming the file, the column and what was
expected, before any check runs.

Sizes are bounded by what is on disk: a Parquet footer can promise twenty million rows in a
few hundred kilobytes, so the row count, row-group count and decoded size a file may claim
grow with its byte size, and a world size or a step range may only go so far beyond the ranks
and steps actually recorded. The limits are generous multiples of what real recordings reach
(a zstd events file holds about 0.3 rows per byte).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fsdptrace.errors import RunDirError
from fsdptrace.store import schema
from fsdptrace.store.key_ranges import MAX_MICRO_STEP, MAX_RANK, MAX_STEP  # what the keys hold

# Ranks a world size may claim beyond the highest rank with a meta partition: a bug report
# may carry only some ranks of a big job, but not a world of millions from one file.
MAX_MISSING_RANKS = 1 << 16
# Steps a ``dropped_rows`` range may reach beyond the last step the rank's markers recorded.
STEP_RANGE_MARGIN = 1
# Per file, from its byte size: rows, decoded bytes and row groups the footer may claim.
MAX_ROWS_PER_BYTE = 8
MIN_ROWS_ALLOWED = 1 << 16
MAX_DECODED_BYTES_PER_BYTE = 64
MIN_DECODED_BYTES_ALLOWED = 1 << 24
MAX_ROW_GROUPS = 4096
# An all-gather's parameter group (an index into the unit's groups) and its size: the memory
# ledger sums bytes over thousands of calls, so a size past a petabyte is no recording.
MAX_GROUP = 1 << 16
MAX_BYTES = 1 << 50
# A ``dropped_rows`` detail is a flat JSON object of a few fields.
MAX_DETAIL_CHARS = 4096

_CANONICAL_RANK = re.compile(r"^rank=(0|[1-9][0-9]*)$")
_RANK_LIKE = re.compile(r"^rank=\d+$")  # any Unicode digits: looks like a partition, is not

# Columns the checks use as keys or group by; a null there is no recording.
NOT_NULL: dict[str, tuple[str, ...]] = {
    "meta": ("world_size",),
    "units": ("unit",),
    "events": ("seq", "t_ns", "step", "micro_step", "phase", "unit"),
    "markers": ("seq", "t_ns", "step", "micro_step", "kind"),
    "prefetch": ("step", "micro_step", "unit", "phase"),
    "gradients": ("step", "micro_step", "unit", "param", "has_grad"),
    "pending": ("step", "micro_step", "unit"),
    "allgathers": ("seq", "t_ns", "step", "micro_step", "phase", "unit", "group", "event",
                   "num_bytes"),
    "backward_grads": ("seq", "t_ns", "step", "micro_step", "unit", "state", "via"),
    "grads_written": ("step", "micro_step", "unit", "param", "written"),
    "eval_forwards": ("seq", "t_ns", "step", "unit", "grad_mode"),
    "settings": ("step", "micro_step", "unit", "setting"),
    "collectives": ("seq", "t_ns", "step", "micro_step", "phase", "unit", "kind",
                    "collective_seq"),
}
PHASE_TABLES = ("events", "prefetch", "allgathers")
_STEP_TABLES = ("events", "markers", "prefetch", "gradients", "pending", "allgathers",
                "backward_grads", "grads_written", "settings")
# Columns whose words the checks compare with constants: anything else is no recording.
WORDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("backward_grads", "state"): schema.GRAD_STATES,
    ("backward_grads", "via"): schema.GRAD_VIAS,
    ("eval_forwards", "grad_mode"): schema.GRAD_MODES,
    ("settings", "setting"): schema.SETTING_NAMES,
    ("collectives", "phase"): schema.COLLECTIVE_PHASES,
    ("collectives", "kind"): schema.COLLECTIVE_KINDS,
}
# A setting's value is a short JSON text (a bool, an int, a mesh shape).
MAX_SETTING_CHARS = 256


def partition_rank(name: str, *, table_dir: Path) -> int | None:
    """The rank of a ``rank=<n>`` partition, None for entries that are no partition.

    Only ASCII decimal without leading zeros counts: ``rank=01`` or ``rank=١`` parse with
    ``int()`` but the reader opens ``rank=1``, so a name that looks like a partition and is
    not canonical is refused rather than silently read as another rank.
    """
    match = _CANONICAL_RANK.match(name)
    if match is None:
        if _RANK_LIKE.match(name):
            raise RunDirError(f"{table_dir / name}: not a rank partition name (expected "
                              f"rank=<n>, n from 0 to {MAX_RANK} in ASCII digits without "
                              "leading zeros); rename or remove it")
        return None
    if len(match.group(1)) > len(str(MAX_RANK)) or int(match.group(1)) > MAX_RANK:
        raise RunDirError(f"{table_dir / name}: rank beyond {MAX_RANK}, the most fsdptrace "
                          "reads; rename or remove it")
    return int(match.group(1))


def check_footer(path: Path, metadata: pq.FileMetaData) -> None:
    """Refuse a file whose footer claims more than its size can hold, before reading it."""
    size = path.stat().st_size
    if metadata.num_row_groups > MAX_ROW_GROUPS:
        raise RunDirError(f"{path}: {metadata.num_row_groups:,} row groups (expected at most "
                          f"{MAX_ROW_GROUPS:,}); not a file fsdptrace wrote")
    max_rows = max(MIN_ROWS_ALLOWED, size * MAX_ROWS_PER_BYTE)
    if metadata.num_rows > max_rows:
        raise RunDirError(f"{path}: the footer claims {metadata.num_rows:,} rows in "
                          f"{size:,} bytes (expected at most {max_rows:,}); refusing to read "
                          "a likely decompression bomb")
    decoded = sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))
    max_decoded = max(MIN_DECODED_BYTES_ALLOWED, size * MAX_DECODED_BYTES_PER_BYTE)
    if decoded > max_decoded:
        raise RunDirError(f"{path}: the footer claims {decoded:,} decoded bytes in {size:,} "
                          f"(expected at most {max_decoded:,}); refusing to read a likely "
                          "decompression bomb")


def check_strings(data: pa.Table, *, path: Path) -> None:
    """Refuse string columns (read dictionary-encoded) that would decode far beyond the file.

    A dictionary page of one long string, referenced by every row, is a few bytes on disk and
    rows x length in memory once decoded; this sums the decoded lengths without decoding.
    """
    limit = max(MIN_DECODED_BYTES_ALLOWED, path.stat().st_size * MAX_DECODED_BYTES_PER_BYTE)
    for name in data.column_names:
        column = data.column(name)
        if not pa.types.is_dictionary(column.type):
            continue
        bound = _decoded_bound(column)
        if bound is not None and bound <= limit:
            continue
        total = 0
        for chunk in column.chunks:
            lengths = pc.binary_length(chunk.dictionary).fill_null(0).to_numpy(
                zero_copy_only=False)
            indices = chunk.indices.fill_null(0).to_numpy(zero_copy_only=False)
            if len(lengths) and len(indices):
                total += int(lengths[np.clip(indices, 0, len(lengths) - 1)].sum())
        if total > limit:
            raise RunDirError(f"{path}: column {name} decodes to {total:,} bytes of text "
                              f"(expected at most {limit:,}); refusing to read it")


def _decoded_bound(column: pa.ChunkedArray) -> int | None:
    """At most the bytes ``column`` decodes to: each row no longer than its dictionary's
    longest text (cheap: the dictionary holds the few distinct names; the exact sum, a pass
    over every row's index, is taken only when this bound is too high)."""
    bound = 0
    for chunk in column.chunks:
        kind = chunk.dictionary.type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            return None  # another layout: no cheap bound, sum exactly
        longest = pc.max(pc.binary_length(chunk.dictionary)).as_py() or 0
        bound += longest * len(chunk)
    return bound


def check_values(data: pa.Table, *, table: str, path: Path) -> None:
    """Refuse values no recorder writes in the columns the checks trust (after the cast)."""
    try:
        data.validate(full=True)  # invalid UTF-8 and dictionary indexes out of range
    except pa.ArrowInvalid as error:
        raise RunDirError(f"{path}: invalid data in the {table} table "
                          f"({_first_line(error)}); text must be UTF-8") from None
    for name in NOT_NULL.get(table, ()):
        if data.column(name).null_count:
            raise RunDirError(f"{path}: column {name} has nulls (expected a value in every "
                              f"row of the {table} table)")
    if table in _STEP_TABLES:
        _check_range(data, "step", 0, MAX_STEP, path=path)
        _check_range(data, "micro_step", 0, MAX_MICRO_STEP, path=path)
    if table == "eval_forwards":
        _check_range(data, "step", 0, MAX_STEP, path=path)
    if table in PHASE_TABLES:
        _check_words(data, "phase", schema.PHASES, path=path)
    for (words_table, column), allowed in WORDS.items():
        if table == words_table:
            _check_words(data, column, allowed, path=path)
    if table == "settings" and data.num_rows:
        longest = pc.max(pc.utf8_length(data.column("value"))).as_py()
        if longest is not None and longest > MAX_SETTING_CHARS:
            raise RunDirError(f"{path}: column value holds a text of {longest:,} characters "
                              f"(expected a setting of at most {MAX_SETTING_CHARS})")
    if table == "prefetch":
        has_target = pc.is_valid(data.column("target"))
        index = data.column("target_index").filter(has_target)
        if index.null_count:
            raise RunDirError(f"{path}: column target_index has nulls where a target is set "
                              "(expected the target's position in its unit's list)")
        _check_range(data.filter(has_target), "target_index", 0, max(data.num_rows, 1),
                     path=path)
    if table == "allgathers":
        # -1: an HSDP unit gathers as a whole, with no parameter group (hsdp_provenance).
        _check_range(data, "group", -1, MAX_GROUP, path=path)
        _check_range(data, "num_bytes", 0, MAX_BYTES, path=path)
    if table == "meta":
        _check_range(data, "world_size", 1, MAX_RANK + 1, path=path)


def _check_words(data: pa.Table, name: str, allowed: tuple[str, ...], *, path: Path) -> None:
    # The words rows use, not the whole dictionary; unique before the cast, which would decode
    # every row (a deep rank's 375k all-gather rows: 6-10 ms -> 1 ms a column).
    words = set(pc.cast(pc.unique(data.column(name)), pa.string()).to_pylist())
    odd = sorted(str(w) for w in words - set(allowed) - {None})
    if odd:
        raise RunDirError(f"{path}: column {name} holds {odd[0]!r} (expected one of "
                          f"{', '.join(allowed)})")


def check_world_size(meta: pa.Table, *, highest_rank: int, partition: Path) -> None:
    """A world size may exceed the highest rank with a meta partition by ``MAX_MISSING_RANKS``:
    the checks list every missing rank, so a claimed world of millions is refused."""
    if not meta.num_rows:
        return
    claimed = pc.max(meta.column("world_size")).as_py()
    limit = highest_rank + 1 + MAX_MISSING_RANKS
    if claimed is not None and claimed > limit:
        raise RunDirError(f"{partition}: column world_size is {claimed:,} but the highest "
                          f"rank on disk is {highest_rank} (expected at most {limit:,})")


def check_drop_details(markers: pa.Table, *, partition: Path) -> None:
    """Every ``dropped_rows`` detail is a flat JSON object whose step range lies within the
    steps this rank recorded: the summaries spell out each step of a range."""
    if not markers.num_rows:
        return
    kind = pc.cast(markers.column("kind"), pa.string())
    drops = markers.filter(pc.equal(kind, schema.MARKER_DROPPED_ROWS))
    if not drops.num_rows:
        return
    last_recorded = int(pc.max(markers.column("step")).as_py())
    limit = last_recorded + STEP_RANGE_MARGIN
    for text in drops.column("detail").to_pylist():
        detail = _detail(text, partition=partition)
        first, last = detail.get("first_step"), detail.get("last_step")
        for key in ("first_step", "last_step", "first_micro_step", "last_micro_step"):
            value = detail.get(key)
            top = MAX_MICRO_STEP if "micro" in key else limit
            if value is not None and (type(value) is not int or not 0 <= value <= top):
                raise RunDirError(f"{partition}: a {schema.MARKER_DROPPED_ROWS} marker's "
                                  f"{key} is {_short(value)} (expected a step from 0 to {top}, "
                                  "the last step this rank recorded)")
        if first is not None and last is not None and first > last:
            raise RunDirError(f"{partition}: a {schema.MARKER_DROPPED_ROWS} marker's range "
                              f"runs backwards ({first} to {last})")


def _detail(text: str | None, *, partition: Path) -> dict[str, Any]:
    detail: Any = None
    if text is not None and len(text) <= MAX_DETAIL_CHARS:
        try:
            detail = json.loads(text)
        except (ValueError, RecursionError):
            detail = None
    if not isinstance(detail, dict) or not isinstance(detail.get("table"), str) or any(
            isinstance(v, dict | list) for v in detail.values()):
        raise RunDirError(f"{partition}: a {schema.MARKER_DROPPED_ROWS} marker's detail is not "
                          f"a flat JSON object with a table name ({_short(text)}); the markers "
                          "table is corrupt or was not written by fsdptrace")
    return detail


def _check_range(data: pa.Table, name: str, low: int, high: int, *, path: Path) -> None:
    if not data.num_rows:
        return
    bounds = pc.min_max(data.column(name)).as_py()
    if bounds["min"] is None:
        return
    if bounds["min"] < low or bounds["max"] > high:
        bad = bounds["min"] if bounds["min"] < low else bounds["max"]
        raise RunDirError(f"{path}: column {name} holds {bad:,} (expected {low} to {high:,})")


def _short(value: object) -> str:
    return repr(value)[:80]


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
