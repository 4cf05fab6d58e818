"""Read journal segments (``journal_format``) into tables without trusting their bytes.

Used by the background writer to turn full segments into Parquet, and by the reader to fold
the tail a rank left behind when it died. Every size comes from the file itself, slots that
fail their checks are skipped as torn, and anything else wrong raises ``RunDirError`` naming
the file: never a traceback on garbage.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa

from fsdptrace import schema
from fsdptrace.errors import RunDirError
from fsdptrace.journal_format import (
    FIXED_TABLES,
    FRAME,
    HEADER,
    KIND_FIXED,
    KIND_FRAMED,
    MAGIC,
    MAX_FRAME_BYTES,
    SEGMENT_NAME,
    dictionary_columns,
)


def fixed_dtype(table: str) -> np.dtype:
    """A packed numpy structured dtype equal to ``fixed_format(table)``."""
    fields = [(f.name, "<i8" if f.type == pa.int64() else "<i4") for f in schema.TABLES[table]]
    return np.dtype([*fields, ("_trailer", "<i8")])


def segments(journal_dir: Path, table: str) -> list[tuple[str, int, Path]]:
    """``(writer, index, path)`` of one table's segments, in writing order."""
    if not journal_dir.is_dir():
        return []
    found = []
    for path in journal_dir.iterdir():
        match = SEGMENT_NAME.match(path.name)
        if match and match["table"] == table and path.is_file():
            found.append((match["writer"], int(match["index"]), path))
    return sorted(found)


def read_segment(path: Path, table: str) -> pa.Table:
    """The complete rows of one segment, as a table of ``schema.TABLES[table]``."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise RunDirError(f"{path}: unreadable journal segment ({error})") from None
    if not data.strip(b"\0"):
        # Created, but the rank died (or the disk filled) before its header was written.
        return schema.TABLES[table].remove_metadata().empty_table()
    if len(data) < HEADER.size:
        raise RunDirError(f"{path}: not a journal segment ({len(data)} bytes, no header)")
    magic, kind, record_size, offset, vocab_len = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise RunDirError(f"{path}: not a fsdptrace journal segment (bad magic)")
    if not HEADER.size + vocab_len <= offset <= len(data):
        raise RunDirError(f"{path}: journal header points beyond the file ({offset:,} of "
                          f"{len(data):,} bytes)")
    try:
        vocab = json.loads(data[HEADER.size:HEADER.size + vocab_len] or b"{}")
        if table in FIXED_TABLES:
            if kind != KIND_FIXED or record_size != fixed_dtype(table).itemsize:
                raise ValueError(f"kind {kind}, slots of {record_size} bytes")
            return _fixed_rows(data, offset, table, vocab)
        if kind != KIND_FRAMED:
            raise ValueError(f"kind {kind}")
        return _framed_rows(data, offset, table)
    except (ValueError, TypeError, KeyError, pa.ArrowException) as error:
        raise RunDirError(f"{path}: corrupt {table} journal segment ({error}); move it aside "
                          "to read the rest") from None


def _fixed_rows(data: bytes, offset: int, table: str, vocab: dict) -> pa.Table:
    dtype = fixed_dtype(table)
    count = (len(data) - offset) // dtype.itemsize
    slots = np.frombuffer(data, dtype, count, offset)
    seq = slots[schema.TABLES[table].names[0]]
    rows = slots[(seq == slots["_trailer"]) & (seq != 0)]
    coded = set(dictionary_columns(table))
    columns = {}
    for field in schema.TABLES[table]:
        values = np.ascontiguousarray(rows[field.name])
        if field.name in coded:
            words = pa.array(list(vocab[field.name]), pa.string())
            indices = pa.array(values, mask=values < 0)
            columns[field.name] = pa.DictionaryArray.from_arrays(indices, words, safe=True)
        else:
            columns[field.name] = pa.array(values)
    return pa.table(columns).cast(schema.TABLES[table].remove_metadata())


def framed_rows(data: bytes, offset: int) -> Iterable[list]:
    """Each complete framed record's rows; stops at the first record not (yet) complete."""
    end = len(data)
    while offset + 2 * FRAME.size <= end:
        (length,) = FRAME.unpack_from(data, offset)
        stop = offset + FRAME.size + length
        if length == 0 or length > MAX_FRAME_BYTES or stop + FRAME.size > end:
            return
        if FRAME.unpack_from(data, stop)[0] != length:
            return
        rows = json.loads(data[offset + FRAME.size:stop])
        if not isinstance(rows, list):
            raise ValueError("a record is not a list of rows")
        yield from rows
        offset = stop + FRAME.size


def _framed_rows(data: bytes, offset: int, table: str) -> pa.Table:
    names = schema.TABLES[table].names
    rows = list(framed_rows(data, offset))
    if any(not isinstance(r, list) or len(r) != len(names) for r in rows):
        raise ValueError(f"a row without the {len(names)} columns of {table}")
    columns = dict(zip(names, zip(*rows, strict=True), strict=True)) if rows else {
        n: [] for n in names}
    return pa.Table.from_pydict(columns, schema=schema.TABLES[table].remove_metadata())
