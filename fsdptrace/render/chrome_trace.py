"""A run as Chrome Trace Event JSON, to see units, all-gathers, memory and findings on a timeline.

Opens in Perfetto UI (ui.perfetto.dev) and chrome://tracing: one process per rank (``pid`` =
rank) with a track per phase, one per concurrent all-gather and a bytes-held counter. What is
drawn is what was recorded, nothing stretched to fill a gap:

- a unit is a slice from its begin to its own end where the recording has one (post-forward
  reshard, post-backward; ``unit_spans``), otherwise an instant; ``args.end`` says which;
- each all-gather is a slice from issue to consume on an all-gather track, with a flow arrow
  from the issue to the consuming unit's slice (``gathers``);
- ``ts`` is microseconds since the Unix epoch (``wall_clock``), the clock torch.profiler's
  trace is on once its ``baseTimeNanoseconds`` is added, so the two files line up.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from itertools import chain, islice
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pandas as pd

from fsdptrace.reading import unsharded
from fsdptrace.reading.trace import Trace, read_rank_by_rank, world_size_of
from fsdptrace.render import wall_clock
from fsdptrace.render.chrome_findings import finding_instants
from fsdptrace.render.gathers import gathers, lanes
from fsdptrace.render.unit_spans import NO_END, unit_spans
from fsdptrace.store import schema

TRACKS = {"boundaries": 0, schema.FORWARD: 1, schema.BACKWARD: 2}
GATHER_TRACK = 3  # first all-gather track; one more per gather in flight at the same time
COUNTER = "unsharded parameter bytes"
FLOW_CATEGORY = "all-gather"
CLOCK = ("ts: microseconds since the Unix epoch, each rank's monotonic t_ns shifted by its "
         "wall_anchor_ns - mono_anchor_ns (meta). A torch.profiler (Kineto) trace writes ts "
         "relative to its top-level baseTimeNanoseconds: add baseTimeNanoseconds / 1000 to "
         "its ts to put it on this clock.")
GATHERS = ("each all-gather is a slice from its issue to its first consume (else the reshard "
           "or drop that ended it) on an 'all-gathers' track, with a flow (s/f) from the issue "
           "to the consuming unit's slice where that slice is recorded.")
SPANS = ("unit slices ('X') run from the unit's begin to its own recorded end: the "
         "post-forward reshard, the post-backward; where none is recorded the begin is an "
         "instant ('i'). args.end names which.")


# The tables a rank's part of the trace is drawn from (meta is read for every rank at once).
DRAWN_TABLES = ("units", "events", "markers", "allgathers", "backward_grads")
# Records encoded per call: one call for all of a deep rank's would hold its whole text.
_RECORDS_PER_CHUNK = 50_000


def write_chrome_trace(trace: Trace, findings: pd.DataFrame, out: TextIO) -> None:
    """Write the Trace Event JSON object of ``trace`` (and ``findings``) to ``out``."""
    _write(_Document(trace, findings), [trace], out)


def write_run_dir_chrome_trace(run_dir: Path, findings: pd.DataFrame, out: TextIO) -> None:
    """``write_chrome_trace`` of a run dir read a rank at a time: what ``fsdptrace export``
    holds is one rank's tables and records, not the run (a 64-rank run of 10M events passed
    20 GB loaded whole). The records come rank by rank; Perfetto does not need them sorted."""
    run = read_rank_by_rank(run_dir)
    _write(_Document(run.whole_trace(), findings), run.traces(DRAWN_TABLES), out)


def chrome_trace(trace: Trace, findings: pd.DataFrame) -> dict[str, Any]:
    """The Trace Event document as a dict (``traceEvents`` plus run facts in ``otherData``):
    what ``write_chrome_trace`` writes."""
    document = _Document(trace, findings)
    records = [*document.records(trace), *document.rest()]
    return {"traceEvents": records, "displayTimeUnit": "ms", "otherData": document.other_data()}


def _write(document: _Document, pieces: Iterable[Trace], out: TextIO) -> None:
    """The bytes ``json.dump(chrome_trace(...))`` writes, a piece of the trace at a time and
    ``_RECORDS_PER_CHUNK`` records in memory at a time (a deep rank has millions)."""
    out.write('{"traceEvents": [')
    separator = ""
    for records in _one_after_another(document, pieces):
        while chunk := list(islice(records, _RECORDS_PER_CHUNK)):
            out.write(separator + json.dumps(chunk)[1:-1])
            separator = ", "
    out.write('], "displayTimeUnit": "ms", "otherData": ')
    out.write(json.dumps(document.other_data()))
    out.write("}\n")


def _one_after_another(document: _Document, pieces: Iterable[Trace]
                       ) -> Iterator[Iterator[dict[str, Any]]]:
    """Each piece's records, then the rest: each drawn only once the one before is written."""
    for piece in pieces:
        yield document.records(piece)
    yield document.rest()


class _Document:
    """One trace's records, drawn a piece (a rank, or the whole trace) at a time, and what
    they add up to: flow ids go on from piece to piece, and the findings no piece holds an
    event of (a rank without events, none at all) sit at the run's last event, at the end."""

    def __init__(self, whole: Trace, findings: pd.DataFrame) -> None:
        self.run_dir, self.meta = whole.run_dir, whole.meta
        self.anchors = wall_clock.anchors(whole.meta)
        self.shift = wall_clock.shifts(whole.meta)
        self.findings = findings.reset_index(drop=True)
        self.placed = np.zeros(len(self.findings), dtype=bool)
        self.ranks: set[int] = set()  # those with metadata records so far
        self.drawn: set[int] = set()  # those with rows in a piece (the world size without meta)
        self.lanes: dict[int, int] = {}
        self.end: float | None = None  # the latest unit begin of any rank
        self.num_spans = self.num_instants = self.num_gathers = self.num_flows = 0

    def records(self, piece: Trace) -> Iterator[dict[str, Any]]:
        """The records of ``piece``'s ranks, with the findings of those that ran a unit (the
        counts are taken at once; the records are made as they are read)."""
        spans = unit_spans(piece.events, piece.allgathers, piece.backward_grads)
        spans["ts"] = wall_clock.epoch_us(spans["t_ns"], spans["rank"], self.shift)
        flights = _Flights(gathers(piece.allgathers), spans, self.shift, self.num_flows)
        self.drawn.update(piece.ranks)
        ranks = sorted(set(piece.ranks) - self.ranks)
        self.ranks.update(ranks)
        self.lanes.update(flights.num_lanes)
        here = self.findings["rank"].isin(set(spans["rank"].astype("int64"))).to_numpy()
        self.placed |= here
        num_spans = int((spans["end_kind"] != NO_END).sum()) if len(spans) else 0
        self.num_spans += num_spans
        self.num_instants += len(spans) - num_spans
        self.num_gathers += len(flights.rows)
        self.num_flows += flights.num_flows
        if len(spans):
            last = float(spans["ts"].max())
            self.end = last if self.end is None else max(self.end, last)
        return chain(_metadata(ranks, flights.num_lanes), _units(spans),
                     _boundaries(piece.markers, self.shift), flights.records(),
                     _counter(unsharded.held_over_time(piece.allgathers), self.shift),
                     finding_instants(self.findings[here], spans, TRACKS))

    def rest(self) -> Iterator[dict[str, Any]]:
        """Ranks only findings name, and the findings no piece placed, at the last event."""
        ranks = sorted(self._finding_ranks() - self.ranks)
        self.ranks.update(ranks)
        left = self.findings[~self.placed]
        return chain(_metadata(ranks, self.lanes),
                     finding_instants(left, _NO_EVENTS, TRACKS, end=self.end or 0.0))

    def other_data(self) -> dict[str, Any]:
        """The run's facts (``otherData``), once every piece and the rest are drawn."""
        ranks = sorted(self.ranks | self._finding_ranks())
        return {
            "run_dir": str(self.run_dir),
            "world_size": world_size_of(self.meta, sorted(self.drawn)),
            "num_findings": len(self.findings),
            "clock": CLOCK, "wall_clock_anchors": self.anchors,
            "ranks_without_anchor": [r for r in ranks if r not in self.shift],
            "unit_spans": SPANS, "num_unit_spans": self.num_spans,
            "num_unit_instants": self.num_instants,
            "num_all_gathers": self.num_gathers, "num_all_gather_flows": self.num_flows,
            "all_gathers": GATHERS,
        }

    def _finding_ranks(self) -> set[int]:
        return {int(r) for r in self.findings["rank"].dropna()}


_NO_EVENTS = pd.DataFrame({"rank": pd.Series(dtype="int64"), "ts": pd.Series(dtype="float64")})


def _metadata(ranks: list[int], num_lanes: dict[int, int]) -> Iterator[dict[str, Any]]:
    """Process and track names, so Perfetto shows "rank 0 / forward" instead of numbers."""
    for rank in ranks:
        yield {"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
               "args": {"name": f"rank {rank}"}}
        yield {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
               "args": {"sort_index": rank}}
        names = dict(TRACKS)
        for lane in range(num_lanes.get(rank, 0)):
            names["all-gathers" + (f" {lane + 1}" if lane else "")] = GATHER_TRACK + lane
        for name, tid in names.items():
            yield {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                   "args": {"name": name}}
            yield {"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                   "args": {"sort_index": tid}}


def _units(spans: pd.DataFrame) -> Iterator[dict[str, Any]]:
    """A slice per unit begin that has its own end; an instant per begin that has none."""
    for row in spans.itertuples(index=False):
        record: dict[str, Any] = {
            "cat": "unit", "name": str(row.unit), "pid": int(row.rank),
            "tid": TRACKS.get(str(row.phase), 0), "ts": float(row.ts),
            "args": {"step": int(row.step), "micro_step": int(row.micro_step),
                     "phase": str(row.phase), "end": str(row.end_kind)},
        }
        if pd.isna(row.end_ns):
            record.update(ph="i", s="t")
        else:
            record.update(ph="X", dur=(int(row.end_ns) - int(row.t_ns)) / 1000.0)
        yield record


def _boundaries(markers: pd.DataFrame, shift: dict[int, int]) -> Iterator[dict[str, Any]]:
    """Micro-step begins, optimizer steps and closes as instants on the boundaries track."""
    if not len(markers):
        return
    ts = wall_clock.epoch_us(markers["t_ns"], markers["rank"], shift)
    for row, at in zip(markers.itertuples(index=False), ts, strict=True):
        # "step 0, micro-step 1", never "step 0.1", which reads as a number.
        label = f"{row.kind} step {int(row.step)}"
        if str(row.kind) == schema.MARKER_MICRO_STEP:
            label += f", micro-step {int(row.micro_step)}"
        yield {
            "ph": "i", "s": "t", "cat": "boundary", "name": label, "pid": int(row.rank),
            "tid": TRACKS["boundaries"], "ts": float(at),
            "args": {"step": int(row.step), "micro_step": int(row.micro_step),
                     "detail": "" if pd.isna(row.detail) else str(row.detail)},
        }


class _Flights:
    """Gather slices (issue to consume) on non-overlapping tracks, and a flow per gather
    from its issue to the slice of the unit that consumed it, where that unit's slice is
    recorded (the arrow needs a slice to land on; an instant has none). Flow ids follow
    ``first_id``; lanes and flows are counted before any record is made."""

    def __init__(self, rows: pd.DataFrame, spans: pd.DataFrame, shift: dict[int, int],
                 first_id: int) -> None:
        self.rows, self.first_id = rows, first_id
        self.lane = np.zeros(len(rows), dtype=np.int64)
        self.num_lanes: dict[int, int] = {}
        self.start = self.end = np.zeros(len(rows), dtype=np.float64)
        self.landing = np.zeros(len(rows), dtype=bool)
        if len(rows):
            self.start = wall_clock.epoch_us(rows["issue_ns"], rows["rank"], shift).to_numpy()
            self.end = wall_clock.epoch_us(rows["end_ns"], rows["rank"], shift).to_numpy()
            for rank, mine in rows.reset_index(drop=True).groupby("rank"):
                at = mine.index.to_numpy()
                self.lane[at] = lanes(mine["issue_ns"].tolist(), mine["end_ns"].tolist())
                self.num_lanes[int(rank)] = int(self.lane[at].max()) + 1
            self.landing = _landing(rows, spans).to_numpy(dtype=bool)
        self.num_flows = int(self.landing.sum())

    def records(self) -> Iterator[dict[str, Any]]:
        num_flows = 0
        columns = (self.lane.tolist(), self.start.tolist(), self.end.tolist(),
                   self.landing.tolist())
        for row, lane, start, end, landing in zip(self.rows.itertuples(index=False), *columns,
                                                  strict=True):
            tid = GATHER_TRACK + lane
            issuer = f"{row.issuer_kind}" + (f" ({row.issuer_unit})" if row.issuer_unit else "")
            yield {
                "ph": "X", "cat": FLOW_CATEGORY, "name": f"all-gather {row.unit}",
                "pid": int(row.rank), "tid": tid, "ts": start,
                "dur": (int(row.end_ns) - int(row.issue_ns)) / 1000.0,
                "args": {"unit": row.unit, "group": int(row.group), "bytes": int(row.num_bytes),
                         "issued_by": issuer, "ended_by": row.end_event,
                         "step": int(row.step), "micro_step": int(row.micro_step),
                         "phase": row.phase},
            }
            if not landing:
                continue
            num_flows += 1
            common = {"cat": FLOW_CATEGORY, "name": FLOW_CATEGORY,
                      "id": self.first_id + num_flows, "pid": int(row.rank)}
            yield {**common, "ph": "s", "tid": tid, "ts": start}
            yield {**common, "ph": "f", "bp": "e", "tid": TRACKS[row.end_phase], "ts": end}


def _landing(flights: pd.DataFrame, spans: pd.DataFrame) -> pd.Series:
    """Whether each consumed gather's consume lies inside the consuming unit's recorded slice
    (the latest begin of that unit and phase before the consume, ending after it)."""
    consumed = flights.assign(phase_key=flights["end_phase"].astype(str),
                              order=range(len(flights)))
    consumed = consumed[consumed["end_event"] == "consume"].sort_values("end_seq")
    if not len(consumed) or not len(spans):
        return pd.Series(False, index=flights.index)
    # Every begin takes part (an instant too): the latest begin before the consume decides.
    slices = spans.assign(phase_key=spans["phase"].astype(str), unit=spans["unit"].astype(str),
                          span_end=pd.to_numeric(spans["end_seq"]).astype("float64").fillna(-1.0))
    slices = slices[["rank", "unit", "phase_key", "seq", "span_end"]]
    hit = pd.merge_asof(consumed, slices.sort_values("seq"), left_on="end_seq",
                        right_on="seq", by=["rank", "unit", "phase_key"], direction="backward")
    inside = (hit["span_end"] > hit["end_seq"]).fillna(False)
    out = pd.Series(False, index=flights.index)
    out.iloc[hit["order"].to_numpy()] = inside.to_numpy(dtype=bool)
    return out


def _counter(ledger: pd.DataFrame, shift: dict[int, int]) -> Iterator[dict[str, Any]]:
    """A counter track per rank (its ``pid``): bytes of all-gathered parameters held."""
    if not len(ledger):
        return
    ts = wall_clock.epoch_us(ledger["t_ns"], ledger["rank"], shift)
    for r, t, b in zip(ledger["rank"], ts, ledger["held_bytes"], strict=True):
        yield {"ph": "C", "cat": "memory", "name": COUNTER, "pid": int(r), "tid": 0,
               "ts": float(t), "args": {"bytes": int(b)}}
