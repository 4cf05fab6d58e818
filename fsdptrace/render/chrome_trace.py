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
from typing import Any, TextIO

import pandas as pd

from fsdptrace.reading import unsharded
from fsdptrace.reading.trace import Trace
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


def write_chrome_trace(trace: Trace, findings: pd.DataFrame, out: TextIO) -> None:
    """Write the Trace Event JSON object of ``trace`` (and ``findings``) to ``out``."""
    json.dump(chrome_trace(trace, findings), out)
    out.write("\n")


def chrome_trace(trace: Trace, findings: pd.DataFrame) -> dict[str, Any]:
    """The Trace Event document as a dict (``traceEvents`` plus run facts in ``otherData``)."""
    shift = wall_clock.shifts(trace.meta)
    spans = unit_spans(trace.events, trace.allgathers, trace.backward_grads)
    spans["ts"] = wall_clock.epoch_us(spans["t_ns"], spans["rank"], shift)
    flights = gathers(trace.allgathers)
    ranks = sorted(set(trace.ranks) | {int(r) for r in findings["rank"].dropna()})
    gather_records, num_flows, num_lanes = _gathers(flights, spans, shift)
    records = (_metadata(ranks, num_lanes) + _units(spans)
               + _boundaries(trace.markers, shift) + gather_records
               + _counter(unsharded.held_over_time(trace.allgathers), shift)
               + finding_instants(findings, spans, TRACKS))
    num_spans = int((spans["end_kind"] != NO_END).sum()) if len(spans) else 0
    return {
        "traceEvents": records,
        "displayTimeUnit": "ms",
        "otherData": {
            "run_dir": str(trace.run_dir), "world_size": trace.world_size,
            "num_findings": len(findings),
            "clock": CLOCK, "wall_clock_anchors": wall_clock.anchors(trace.meta),
            "ranks_without_anchor": [r for r in ranks if r not in shift],
            "unit_spans": SPANS, "num_unit_spans": num_spans,
            "num_unit_instants": len(spans) - num_spans,
            "num_all_gathers": len(flights), "num_all_gather_flows": num_flows,
            "all_gathers": GATHERS,
        },
    }


def _metadata(ranks: list[int], num_lanes: dict[int, int]) -> list[dict[str, Any]]:
    """Process and track names, so Perfetto shows "rank 0 / forward" instead of numbers."""
    records: list[dict[str, Any]] = []
    for rank in ranks:
        records.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                        "args": {"name": f"rank {rank}"}})
        records.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                        "args": {"sort_index": rank}})
        names = dict(TRACKS)
        for lane in range(num_lanes.get(rank, 0)):
            names["all-gathers" + (f" {lane + 1}" if lane else "")] = GATHER_TRACK + lane
        for name, tid in names.items():
            records.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                            "args": {"name": name}})
            records.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                            "args": {"sort_index": tid}})
    return records


def _units(spans: pd.DataFrame) -> list[dict[str, Any]]:
    """A slice per unit begin that has its own end; an instant per begin that has none."""
    records = []
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
        records.append(record)
    return records


def _boundaries(markers: pd.DataFrame, shift: dict[int, int]) -> list[dict[str, Any]]:
    """Micro-step begins, optimizer steps and closes as instants on the boundaries track."""
    if not len(markers):
        return []
    ts = wall_clock.epoch_us(markers["t_ns"], markers["rank"], shift)
    records = []
    for row, at in zip(markers.itertuples(index=False), ts, strict=True):
        # "step 0, micro-step 1", never "step 0.1", which reads as a number.
        label = f"{row.kind} step {int(row.step)}"
        if str(row.kind) == schema.MARKER_MICRO_STEP:
            label += f", micro-step {int(row.micro_step)}"
        records.append({
            "ph": "i", "s": "t", "cat": "boundary", "name": label, "pid": int(row.rank),
            "tid": TRACKS["boundaries"], "ts": float(at),
            "args": {"step": int(row.step), "micro_step": int(row.micro_step),
                     "detail": "" if pd.isna(row.detail) else str(row.detail)},
        })
    return records


def _gathers(flights: pd.DataFrame, spans: pd.DataFrame, shift: dict[int, int]
             ) -> tuple[list[dict[str, Any]], int, dict[int, int]]:
    """Gather slices (issue to consume) on non-overlapping tracks, and a flow per gather
    from its issue to the slice of the unit that consumed it, where that unit's slice is
    recorded (the arrow needs a slice to land on; an instant has none)."""
    if not len(flights):
        return [], 0, {}
    start = wall_clock.epoch_us(flights["issue_ns"], flights["rank"], shift)
    end = wall_clock.epoch_us(flights["end_ns"], flights["rank"], shift)
    lane = pd.Series(0, index=flights.index)
    for _, mine in flights.groupby("rank"):
        lane.loc[mine.index] = lanes(mine["issue_ns"].tolist(), mine["end_ns"].tolist())
    landing = _landing(flights, spans)
    records: list[dict[str, Any]] = []
    num_flows = 0
    for i, row in enumerate(flights.itertuples(index=False)):
        tid = GATHER_TRACK + int(lane.iloc[i])
        issuer = f"{row.issuer_kind}" + (f" ({row.issuer_unit})" if row.issuer_unit else "")
        records.append({
            "ph": "X", "cat": FLOW_CATEGORY, "name": f"all-gather {row.unit}",
            "pid": int(row.rank), "tid": tid, "ts": float(start.iloc[i]),
            "dur": (int(row.end_ns) - int(row.issue_ns)) / 1000.0,
            "args": {"unit": row.unit, "group": int(row.group), "bytes": int(row.num_bytes),
                     "issued_by": issuer, "ended_by": row.end_event,
                     "step": int(row.step), "micro_step": int(row.micro_step),
                     "phase": row.phase},
        })
        if not landing.iloc[i]:
            continue
        num_flows += 1
        common = {"cat": FLOW_CATEGORY, "name": FLOW_CATEGORY, "id": num_flows,
                  "pid": int(row.rank)}
        records.append({**common, "ph": "s", "tid": tid, "ts": float(start.iloc[i])})
        records.append({**common, "ph": "f", "bp": "e", "tid": TRACKS[row.end_phase],
                        "ts": float(end.iloc[i])})
    num_lanes = {int(r): int(n) + 1 for r, n in lane.groupby(flights["rank"]).max().items()}
    return records, num_flows, num_lanes


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


def _counter(ledger: pd.DataFrame, shift: dict[int, int]) -> list[dict[str, Any]]:
    """A counter track per rank (its ``pid``): bytes of all-gathered parameters held."""
    if not len(ledger):
        return []
    ts = wall_clock.epoch_us(ledger["t_ns"], ledger["rank"], shift)
    return [{"ph": "C", "cat": "memory", "name": COUNTER, "pid": int(r), "tid": 0, "ts": float(t),
             "args": {"bytes": int(b)}}
            for r, t, b in zip(ledger["rank"], ts, ledger["held_bytes"], strict=True)]
