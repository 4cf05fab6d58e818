"""``RankTables``: what the per-rank checks read, as code columns, from any of three sources.

The offline analyzer reads a rank's Parquet with pyarrow, the live option has the recorder's
tuples, and notebook users hold a pandas ``Trace``; all three become the same columns, so one
set of check functions serves them. Tables that only a finding needs in full (pending
all-gathers, provenance) stay behind ``frame``, built on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow as pa

from fsdptrace.checks.kernel.columns import Columns, Vocab
from fsdptrace.checks.kernel.order import unit_sets
from fsdptrace.reading import endings, incomplete
from fsdptrace.reading.reader import empty_table
from fsdptrace.reading.unit_names import Label, labeller, module_types
from fsdptrace.store import schema

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.positions import Positions
    from fsdptrace.reading.trace import Trace

# Tables the checks read as pandas frames, whose sizes say whether to read them at all.
SIZED = ("pending", "allgathers", "backward_grads", "eval_forwards", "settings", "collectives")
# Columns that name things (dictionary-encoded on disk): these become vocab codes.
CODED = {name: [f.name for f in table if pa.types.is_dictionary(f.type)] + (
    ["unit"] if name == "units" else [])
    for name, table in schema.TABLES.items()}


@dataclass
class RankTables:
    """One or more ranks' tables for the per-rank checks (events, edges, gradients as codes)."""

    vocab: Vocab
    events: Columns
    prefetch: Columns
    gradients: Columns
    units: Columns
    closed: set[int]
    sizes: dict[str, int]
    frames: Callable[[str], pd.DataFrame]
    # Micro-steps each table lost rows from (``incomplete.parse``); none on the live path,
    # which checks the recorder's own rows of the step, not what the writer kept.
    incomplete: pd.DataFrame = field(default_factory=incomplete.empty)
    # Check 2: which gradients held at a boundary were written in the step (none: not known).
    grads_written: Columns | None = None
    _cache: dict[str, pd.DataFrame] = field(default_factory=dict)

    def frame(self, table: str) -> pd.DataFrame:
        """A table as ``load`` holds it, for the rare path that builds findings from it."""
        if table not in self._cache:
            self._cache[table] = self.frames(table)
        return self._cache[table]

    def code(self, name: str) -> int:
        return self.vocab.code(name)

    @cached_property
    def label(self) -> Label:
        """How a message names a unit: ``3 (Block)`` where the name alone is a position
        (``reading.unit_names``); the ``unit`` and ``target`` columns keep the names."""
        return labeller(module_types(self.frame("units")))

    @cached_property
    def unit_sets(self) -> pd.DataFrame:
        """Each rank's unit set (``order.unit_sets``): the map step and checks 10 and 12 ask."""
        return unit_sets(self.frame("units"))

    @cached_property
    def stops(self) -> pd.DataFrame:
        """Every rank's stop point (``checks.stops.stop_points``), clean or not."""
        from fsdptrace.checks.kernel.stops import stop_points

        return stop_points(self)

    def with_stops(self, stops: pd.DataFrame) -> RankTables:
        """These tables, taking their stop points from ``stops`` (as the map step found them;
        rows of other ranks ignored) instead of computing them: the reduce reads back only the
        tables the orders it spells out need, and a stop point is found from more of them."""
        if "complete" in self.__dict__:
            raise ValueError("the complete orders were computed from other stop points")
        mine = stops["rank"].isin(np.unique(self.events["rank"]))
        self.__dict__["stops"] = stops[mine].reset_index(drop=True)  # the cached property's
        return self

    @cached_property
    def complete(self) -> Positions:
        """Positions of complete orders (stalled ranks' cut-off passes dropped): checks 1, 4, 7."""
        from fsdptrace.checks.kernel.positions import complete_positions

        return complete_positions(self)

    @cached_property
    def signatures(self) -> pd.DataFrame:
        """Order signatures of the complete orders: check 7's input, and the reduce's."""
        from fsdptrace.checks.kernel.positions import signatures

        return signatures(self.complete, self.vocab.names)

    def drop_lost(self, found: pd.DataFrame, table: str, *, whole_steps: bool = False
                  ) -> pd.DataFrame:
        """Findings outside the micro-steps (or, for boundary snapshots, optimizer steps)
        whose ``table`` rows the writer partly lost: there a lost row is no fact.

        Checks that read code columns skip those gaps themselves (``complete``); checks that
        build pandas frames filter their findings here.
        """
        ranges = self.incomplete
        if not len(found) or not len(ranges) or table not in set(ranges["table"]):
            return found
        rank, step = found["rank"].to_numpy(), found["step"].to_numpy()
        if whole_steps:
            lost = incomplete.in_steps(ranges, (table,), rank, step)
        else:
            lost = incomplete.in_micro_steps(ranges, (table,), rank, step,
                                             found["micro_step"].to_numpy())
        return found[~lost].reset_index(drop=True)

    @cached_property
    def forward(self) -> int:
        return self.vocab.code(schema.FORWARD)

    @classmethod
    def from_trace(cls, trace: Trace) -> RankTables:
        """A pandas ``Trace`` (``fsdptrace.load`` or hand-built) as code columns."""
        return cls.from_frames(**{t: getattr(trace, t) for t in schema.TABLES})

    @classmethod
    def from_frames(cls, **frames: pd.DataFrame) -> RankTables:
        """Tables as ``load`` holds them, by name; tables not given count as empty."""
        vocab = Vocab()

        def get(table: str) -> pd.DataFrame:
            return frames.get(table, pd.DataFrame())

        def cols(table: str) -> Columns:
            frame = get(table)
            return Columns.from_frame(frame, vocab, CODED[table] if len(frame) else [])

        return cls(vocab=vocab, events=_events(cols("events")), prefetch=cols("prefetch"),
                   gradients=cols("gradients"), units=cols("units"),
                   closed=_closed(get("markers")), frames=get,
                   sizes={t: len(get(t)) for t in SIZED},
                   incomplete=incomplete.parse(get("markers")),
                   grads_written=cols("grads_written"))

    def orders(self, wanted: pd.DataFrame) -> pd.DataFrame:
        """Positioned complete orders (``Positions.frame`` rows) of the ``wanted``
        (rank, step, micro_step, phase) only: what a cross-rank check spells out."""
        from fsdptrace.checks.kernel.columns import fold
        from fsdptrace.checks.kernel.order import GROUP

        pos = self.complete
        phase = self.vocab.codes(list(wanted["phase"].astype(str)))
        have, want = fold([[pos.column(c), wanted[c].to_numpy().astype(np.int64)]
                           for c in GROUP[:-1]] + [[pos.column("phase"), phase]])
        return pos.frame(np.isin(have, want))

    def orders_of_stopped(self, rank: int, step: int, micro_step: int, phase: str
                          ) -> pd.DataFrame:
        """The pass a rank stopped in, as recorded (it is no complete order): ``rank, step,
        micro_step, phase, position, unit``."""
        events = self.events
        mine = np.flatnonzero((events["rank"] == rank) & (events["step"] == step)
                              & (events["micro_step"] == micro_step)
                              & (events["phase"] == self.vocab.code(phase)))
        mine = mine[np.argsort(events["seq"][mine], kind="stable")]
        out = events.frame(mine)[["rank", "step", "micro_step", "phase", "unit"]]
        return out.assign(phase=out["phase"].astype(str), unit=out["unit"].astype(str),
                          position=np.arange(len(mine)))

    @classmethod
    def from_arrow(cls, tables: dict[str, pa.Table],
                   frames: Callable[[str], pd.DataFrame]) -> RankTables:
        """Tables read by ``reader.read_rank``; ``frames`` converts one to pandas when asked.

        Tables missing from ``tables`` count as empty.
        """
        tables = {name: tables[name] if name in tables else empty_table(name, ranked=True)
                  for name in schema.TABLES}
        vocab = Vocab()
        markers = tables["markers"]
        closed = _closed(endings.ending_markers_arrow(markers))
        return cls(vocab=vocab, events=_events(Columns.from_arrow(tables["events"], vocab)),
                   prefetch=Columns.from_arrow(tables["prefetch"], vocab),
                   gradients=Columns.from_arrow(tables["gradients"], vocab),
                   units=Columns.from_arrow(tables["units"], vocab, ["unit"]), closed=closed,
                   frames=frames,
                   sizes={t: tables[t].num_rows for t in SIZED},
                   incomplete=incomplete.from_arrow(markers),
                   grads_written=Columns.from_arrow(tables["grads_written"], vocab))


def _events(events: Columns) -> Columns:
    """Events need their key columns even when empty (a hand-built Trace may lack them)."""
    for name in ("rank", "seq", "step", "micro_step", "phase", "unit", "t_ns"):
        if name not in events.data:
            events.data[name] = np.zeros(0, dtype=np.int64)
    return events


def _closed(markers: pd.DataFrame) -> set[int]:
    return endings.clean_ranks(markers)
