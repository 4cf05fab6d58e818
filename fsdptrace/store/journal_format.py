"""The journal's on-disk layout, shared by the recorder that writes it and the reader.

A rank's journal is a folder of segment files, ``RUN_DIR/journal/rank=<r>/<table>-<writer>-
<index>.seg``, outside the table folders and not named ``*.parquet`` so hive readers never see
it. Each segment is a fixed header (``HEADER``), a JSON vocabulary (the dictionaries of coded
columns, so a segment reads on its own), then records from ``data_offset`` on:

- *fixed* tables (``FIXED_TABLES``: many rows per step) hold one struct per row, the row's
  fields then a trailer equal to its ``seq``. A slot counts only when its first field equals
  its trailer and is not 0: a slot the process died while writing is skipped, and a slot
  never written is zeros.
- *framed* tables (everything else, a few rows per step) hold records ``length, JSON list of
  rows, length``; the leading length is written last, so a record cut short reads as the end.
"""

from __future__ import annotations

import re
import struct

import pyarrow as pa

from fsdptrace.store import schema

JOURNAL_DIR = "journal"
SEGMENT_FILE = "{table}-{writer}-{index:06d}.seg"
SEGMENT_NAME = re.compile(r"^(?P<table>[a-z_]+)-(?P<writer>j[0-9_]+)-(?P<index>\d{6,})\.seg$")
# Parquet parts written from segments name the segment range they hold (schema 2). Schema-1
# writer ids start with "w", so their ``part-<writer>-<n>`` names never match this.
RANGE_PART_FILE = "part-{writer}-{first:06d}-{last:06d}.parquet"
RANGE_PART_NAME = re.compile(r"^part-(?P<writer>j[0-9_]+)-(?P<first>\d{6,})-(?P<last>\d{6,})"
                             r"\.parquet$")

# The writer id of the loss markers a recording's writer writes when rows cannot reach the
# run dir (``record.unwritten``): its own id with a suffix no recorder's id (``j<pid>_<ns>``)
# has, so that a writer's segment listing never takes them for its own.
LOSS_WRITER = "{writer}_0"


def is_loss_writer(writer: str) -> bool:
    """Whether ``writer`` (a segment name's) is a ``LOSS_WRITER`` id."""
    return writer.count("_") == 2 and writer.endswith("_0")


MAGIC = b"FSDPJNL2"
HEADER = struct.Struct("<8sIIII")  # magic, kind, record size, data offset, vocabulary length
KIND_FIXED, KIND_FRAMED = 1, 2
FRAME = struct.Struct("<I")
# The largest framed record a reader accepts: bounds what garbage can make it allocate.
MAX_FRAME_BYTES = 64 * 1024 * 1024

FIXED_TABLES = ("events", "allgathers", "backward_grads", "eval_forwards", "collectives")


def _code(kind: pa.DataType) -> str:
    if pa.types.is_dictionary(kind) or kind == pa.int32():
        return "i"
    assert kind == pa.int64(), kind
    return "q"


def fixed_format(table: str) -> str:
    """The struct of one fixed slot: the row's columns (dictionaries as codes), then the trailer."""
    return "<" + "".join(_code(f.type) for f in schema.TABLES[table]) + "q"


def dictionary_columns(table: str) -> list[str]:
    return [f.name for f in schema.TABLES[table] if pa.types.is_dictionary(f.type)]
