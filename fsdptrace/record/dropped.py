"""Where the writer lost rows, so the analyzer can tell a gap from a real difference.

A writer that cannot keep up (or cannot write at all) drops a table's oldest buffered rows.
Without knowing which, a gap in one rank's ``events`` reads like a rank that skipped units,
and checks comparing orders across ranks report divergence that never happened. So every
drop is kept as one ``DroppedRows`` run (the rows one flush removed: contiguous in the order
they were recorded) and the recorder writes one ``dropped_rows`` marker per run:

- ``count``: rows dropped; ``step``/``micro_step``: where the recorder was when it wrote the
  marker, as for every marker (markers stay in recording order);
- ``detail``: JSON ``{"table", "first_seq", "last_seq", "first_step", "first_micro_step",
  "last_step", "last_micro_step"}`` (``*_seq`` null for tables without ``seq``).

Every (step, micro_step) from first to last, both included, is incomplete in that table.
The totals stay in the ``dropped`` markers written at close (``count``: rows, ``detail``:
table).
"""

from __future__ import annotations

import json
from typing import NamedTuple

from fsdptrace import schema
from fsdptrace.schema import MARKER_DROPPED_ROWS as MARKER_DROPPED_ROWS  # re-exported


class DroppedRows(NamedTuple):
    """One contiguous run of rows a table lost, with the step range they belonged to."""

    table: str
    num_rows: int
    first_seq: int | None
    last_seq: int | None
    first_step: int | None
    first_micro_step: int | None
    last_step: int | None
    last_micro_step: int | None

    def detail(self) -> str:
        """The ``dropped_rows`` marker's detail: the run as JSON (the table name included)."""
        fields = self._asdict()
        del fields["num_rows"]  # it is the marker's count
        return json.dumps(fields, separators=(",", ":"))


class RowPositions:
    """Where seq/step/micro_step sit in a table's row tuples (rows follow the schema order)."""

    def __init__(self, table: str) -> None:
        names = schema.TABLES[table].names
        self.table = table
        self.seq = names.index("seq") if "seq" in names else None
        self.step = names.index("step") if "step" in names else None
        self.micro_step = names.index("micro_step") if "micro_step" in names else None

    def run(self, first: tuple, last: tuple, num_rows: int) -> DroppedRows:
        """The run from its first and last dropped rows."""
        return DroppedRows(self.table, num_rows, self._at(first, self.seq),
                           self._at(last, self.seq), self._at(first, self.step),
                           self._at(first, self.micro_step), self._at(last, self.step),
                           self._at(last, self.micro_step))

    @staticmethod
    def _at(row: tuple, index: int | None) -> int | None:
        return None if index is None else row[index]
