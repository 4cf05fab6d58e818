"""Read journal segments (``journal_format``) into tables without trusting their bytes.

Used by the background writer to turn full segments into Parquet, and by the reader to fold
the tail a rank left behind when it died. Every size comes from the file itself and is checked
before it is read, JSON is refused before it nests deeper than the format does, slots that
fail their checks are skipped as torn, and anything else wrong raises ``UnreadableChunkError``
naming the file (the reader skips that segment, as it skips an unreadable Parquet part):
never a traceback, a memory error or a recursion error on garbage.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable
from operator import itemgetter
from pathlib import Path

import numpy as np
import pyarrow as pa

from fsdptrace.errors import UnreadableChunkError
from fsdptrace.store import schema
from fsdptrace.store.journal_format import (
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

# The largest vocabulary a segment's header may declare (every unit name of a model, and some).
MAX_VOCAB_BYTES = 16 * 1024 * 1024
# The largest segment file a reader opens: a header, a vocabulary and one record of the
# largest size a reader accepts (a recorder's segments are a few MB; a bigger file is not one,
# and is never read whole: a sparse file claims gigabytes in a few blocks).
MAX_SEGMENT_FILE_BYTES = HEADER.size + MAX_VOCAB_BYTES + 2 * FRAME.size + MAX_FRAME_BYTES
# How deep JSON in a segment nests: a vocabulary is an object of lists of names, a framed
# record a list of rows of scalars or lists of names (``units.param_names``). Deeper is
# garbage, refused before ``json`` recurses into it.
MAX_JSON_DEPTH = 3
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def fixed_dtype(table: str) -> np.dtype:
    """A packed numpy structured dtype equal to ``fixed_format(table)``."""
    fields = [(f.name, "<i8" if f.type == pa.int64() else "<i4") for f in schema.TABLES[table]]
    return np.dtype([*fields, ("_trailer", "<i8")])


def segments(journal_dir: Path, table: str) -> list[tuple[str, int, Path]]:
    """``(writer, index, path)`` of one table's segments, in writing order.

    A folder that is gone holds none, also when it goes while listed: a hot folder's writer
    removes it once it has converted every segment into parts (which a reader lists after
    the segments), and a reader of a run still finishing must not fail on that.
    """
    try:
        names = list(journal_dir.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for path in names:
        match = SEGMENT_NAME.match(path.name)
        if match and match["table"] == table and path.is_file():
            found.append((match["writer"], int(match["index"]), path))
    return sorted(found)


def read_segment(path: Path, table: str) -> pa.Table:
    """The complete rows of one segment, as a table of ``schema.TABLES[table]``."""
    data = _read_bounded(path)
    if data.count(0) == len(data):
        # Created, but the rank died (or the disk filled) before its header was written.
        return schema.TABLES[table].remove_metadata().empty_table()
    if len(data) < HEADER.size:
        raise _unreadable(path, f"not a journal segment ({len(data)} bytes, no header)")
    magic, kind, record_size, offset, vocab_len = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise _unreadable(path, "not a fsdptrace journal segment (bad magic)")
    if not HEADER.size + vocab_len <= offset <= len(data) or vocab_len > MAX_VOCAB_BYTES:
        raise _unreadable(path, f"journal header points beyond the file ({offset:,} of "
                                f"{len(data):,} bytes)")
    try:
        vocab = loads_flat(data[HEADER.size:HEADER.size + vocab_len] or b"{}")
        if table in FIXED_TABLES:
            if kind != KIND_FIXED or record_size != fixed_dtype(table).itemsize:
                raise ValueError(f"kind {kind}, slots of {record_size} bytes")
            if not isinstance(vocab, dict):
                raise ValueError("the vocabulary is not an object")
            return _fixed_rows(data, offset, table, vocab)
        if kind != KIND_FRAMED:
            raise ValueError(f"kind {kind}")
        return _framed_rows(data, offset, table)
    except (ValueError, TypeError, KeyError, pa.ArrowException) as error:
        raise _unreadable(path, f"corrupt {table} journal segment ({error})") from None


def _read_bounded(path: Path) -> bytes:
    """The file's bytes, its size checked (on the open file) before any is read."""
    try:
        with open(path, "rb") as file:
            status = os.fstat(file.fileno())
            size = status.st_size
            if not stat.S_ISREG(status.st_mode):
                raise _unreadable(path, "not a regular file")
            if size > MAX_SEGMENT_FILE_BYTES:
                raise _unreadable(path, f"{size:,} bytes, more than a journal segment holds "
                                  f"(at most {MAX_SEGMENT_FILE_BYTES:,}); not read")
            return file.read(MAX_SEGMENT_FILE_BYTES)
    except OSError as error:
        raise _unreadable(path, f"unreadable journal segment ({error})") from None


def _unreadable(path: Path, reason: str) -> UnreadableChunkError:
    """A segment that cannot be read; the reader skips it (``chunk_gaps``), as a bad part."""
    return UnreadableChunkError(f"{path}: {reason}; move it aside to read the rest",
                                reason=reason)


def loads_flat(text: bytes) -> object:
    """``json.loads`` of text nested at most ``MAX_JSON_DEPTH`` deep; deeper is a ValueError
    before any parsing (``json`` recurses once per level: a megabyte of ``[`` overflows it)."""
    if nesting_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return json.loads(text)


def nesting_depth(text: bytes) -> int:
    """How deep the brackets of JSON ``text`` nest, brackets inside strings not counted.

    Without a backslash, and with every quote closed, strings are what lies between
    consecutive quotes (as ``json`` pairs them), so the quotes' running parity marks them: a
    few array passes. Otherwise a quote may be escaped or left open, and the strings are
    matched by their pattern: ten times slower on the megabyte frames of a deep run's
    gradients (0.34 -> 0.03 s for the segments of a generated 16-rank run).
    """
    codes = np.frombuffer(text, dtype=np.uint8)
    in_string = (np.bitwise_xor.accumulate((codes == ord('"')).view(np.uint8))
                 if b"\\" not in text else None)
    if in_string is None or (len(codes) and in_string[-1]):
        codes = np.frombuffer(_JSON_STRING.sub(b"", text).translate(None, _NOT_BRACKET),
                              dtype=np.uint8)
    else:
        brackets = ((codes == ord("[")) | (codes == ord("]")) | (codes == ord("{"))
                    | (codes == ord("}")))
        codes = codes[brackets & (in_string == 0)]
    if not len(codes):
        return 0
    opens = (codes == ord("[")) | (codes == ord("{"))
    return max(0, int(np.cumsum(np.where(opens, 1, -1), dtype=np.int32).max()))


_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def _fixed_rows(data: bytes, offset: int, table: str, vocab: dict) -> pa.Table:
    dtype = fixed_dtype(table)
    count = (len(data) - offset) // dtype.itemsize
    slots = np.frombuffer(data, dtype, count, offset)
    seq = slots[schema.TABLES[table].names[0]]
    rows = slots[(seq == slots["_trailer"]) & (seq != 0)]
    coded = set(dictionary_columns(table))
    columns = []
    for field in schema.TABLES[table]:
        values = np.ascontiguousarray(rows[field.name])
        if field.name in coded:
            words = pa.array(list(vocab[field.name]), pa.string())
            indices = pa.array(values, mask=values < 0)
            columns.append(pa.DictionaryArray.from_arrays(indices, words, safe=True))
        else:
            columns.append(pa.array(values))
    # The slots' dtype is the schema's (``fixed_dtype``): no cast, which would import
    # ``pyarrow.compute`` (40 ms of each writer process's start-up) for nothing to convert.
    return pa.Table.from_arrays(columns, schema=schema.TABLES[table].remove_metadata())


def complete_records_end(data: bytes, offset: int) -> int:
    """Where the complete framed records from ``offset`` on end: a record being written has
    its leading frame still zero (``record.journal.FramedTable`` writes it last)."""
    end = len(data)
    while offset + 2 * FRAME.size <= end:
        (length,) = FRAME.unpack_from(data, offset)
        stop = offset + FRAME.size + length
        if (length == 0 or length > MAX_FRAME_BYTES or stop + FRAME.size > end
                or FRAME.unpack_from(data, stop)[0] != length):
            break
        offset = stop + FRAME.size
    return offset


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
        rows = loads_flat(data[offset + FRAME.size:stop])
        if not isinstance(rows, list):
            raise ValueError("a record is not a list of rows")
        yield from rows
        offset = stop + FRAME.size


def _framed_rows(data: bytes, offset: int, table: str) -> pa.Table:
    names = schema.TABLES[table].names
    rows = list(framed_rows(data, offset))
    if any(not isinstance(r, list) or len(r) != len(names) for r in rows):
        raise ValueError(f"a row without the {len(names)} columns of {table}")
    # A column at a time (``itemgetter`` mapped over the rows): ``zip(*rows)`` over a dead
    # rank's hundreds of thousands of rows took 5x as long (the transposition alone).
    columns = {name: list(map(itemgetter(i), rows)) for i, name in enumerate(names)}
    return pa.Table.from_pydict(columns, schema=schema.TABLES[table].remove_metadata())
