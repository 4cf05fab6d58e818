"""A run as Chrome Trace Event JSON, to see units, boundaries and findings on a timeline.

Opens in Perfetto UI (ui.perfetto.dev) and chrome://tracing: one process per rank, one track
per phase. The recorder keeps only when each unit *began* a phase, so a unit's slice lasts
until the rank's next recorded begin or boundary: the gaps and overlaps a person looks for
(a rank that stalls, a unit that takes long before the next one starts) stay visible.
Findings are instant events at the event they point to, so a finding sits where it happened.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

import numpy as np
import pandas as pd

from fsdptrace import schema, unsharded
from fsdptrace.trace import Trace

TRACKS = {"boundaries": 0, schema.FORWARD: 1, schema.BACKWARD: 2}
# Narrowing keys, most precise first: a finding lands on the first event that matches.
_FINDING_KEYS = (
    ["rank", "step", "micro_step", "phase", "unit"],
    ["rank", "step", "micro_step", "phase"],
    ["rank", "step", "micro_step"],
    ["rank", "step"],
)
_MIN_DURATION_US = 1.0


def write_chrome_trace(trace: Trace, findings: pd.DataFrame, out: TextIO) -> None:
    """Write the Trace Event JSON object of ``trace`` (and ``findings``) to ``out``."""
    json.dump(chrome_trace(trace, findings), out)
    out.write("\n")


def chrome_trace(trace: Trace, findings: pd.DataFrame) -> dict[str, Any]:
    """The Trace Event document as a dict (``traceEvents`` plus run facts in ``otherData``)."""
    events = _with_time(trace.events, trace.meta)
    markers = _with_time(trace.markers, trace.meta)
    ledger = _with_time(unsharded.timeline(trace.allgathers), trace.meta)
    origin = _origin(events, markers, ledger)
    events = events.assign(ts=(events["t_wall"] - origin) / 1000.0)
    markers = markers.assign(ts=(markers["t_wall"] - origin) / 1000.0)
    ranks = sorted(set(trace.ranks) | _finding_ranks(findings))
    records = (_metadata(ranks) + _unit_slices(events, markers) + _boundaries(markers)
               + _finding_instants(findings, events)
               + _unsharded_counter(ledger, origin))
    return {
        "traceEvents": records,
        "displayTimeUnit": "ms",
        "otherData": {"run_dir": str(trace.run_dir), "world_size": trace.world_size,
                      "num_findings": len(findings)},
    }


def _with_time(frame: pd.DataFrame, meta: pd.DataFrame) -> pd.DataFrame:
    """Add ``t_wall``: monotonic ``t_ns`` shifted by each rank's wall-clock anchor.

    Monotonic clocks of different hosts share no origin; the anchors the recorder wrote at
    start put every rank on one wall-clock axis. Ranks without meta keep their raw clock.
    """
    anchors = meta.drop_duplicates("rank")[["rank", "wall_anchor_ns", "mono_anchor_ns"]]
    merged = frame.merge(anchors, on="rank", how="left")
    shift = (merged["wall_anchor_ns"] - merged["mono_anchor_ns"]).fillna(0).astype("int64")
    return merged.assign(t_wall=merged["t_ns"].astype("int64") + shift)


def _origin(*frames: pd.DataFrame) -> int:
    times = pd.concat([frame["t_wall"] for frame in frames])
    return int(times.min()) if len(times) else 0


def _finding_ranks(findings: pd.DataFrame) -> set[int]:
    return {int(r) for r in findings["rank"].dropna()} if len(findings) else set()


def _metadata(ranks: list[int]) -> list[dict[str, Any]]:
    """Process and track names, so Perfetto shows "rank 0 / forward" instead of numbers."""
    records: list[dict[str, Any]] = []
    for rank in ranks:
        records.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                        "args": {"name": f"rank {rank}"}})
        records.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                        "args": {"sort_index": rank}})
        for name, tid in TRACKS.items():
            records.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                            "args": {"name": name}})
    return records


def _unit_slices(events: pd.DataFrame, markers: pd.DataFrame) -> list[dict[str, Any]]:
    """One "X" slice per unit begin, ending at the rank's next begin or boundary."""
    if not len(events):
        return []
    stops = pd.concat([events[["rank", "ts"]], markers[["rank", "ts"]]], ignore_index=True)
    stops = stops.sort_values(["rank", "ts"], kind="stable")
    ordered = events.sort_values(["rank", "ts"], kind="stable")
    # For each begin, the first stop strictly later on the same rank.
    nxt = pd.merge_asof(ordered.assign(ts_key=ordered["ts"] + 1e-3).sort_values("ts_key"),
                        stops.rename(columns={"ts": "end"}).assign(
                            ts_key=lambda f: f["end"]).sort_values("ts_key"),
                        on="ts_key", by="rank", direction="forward")
    duration = (nxt["end"] - nxt["ts"]).fillna(_MIN_DURATION_US)
    frame = pd.DataFrame({
        "ph": "X", "cat": "unit", "name": nxt["unit"].astype(str),
        "pid": nxt["rank"].astype("int64"),
        "tid": nxt["phase"].astype(str).map(TRACKS).fillna(0).astype("int64"),
        "ts": nxt["ts"].astype(float).round(3),
        "dur": np.maximum(duration.astype(float), _MIN_DURATION_US).round(3),
        "step": nxt["step"].astype("int64"), "micro_step": nxt["micro_step"].astype("int64"),
    })
    return [_with_args(r, ("step", "micro_step")) for r in frame.to_dict("records")]


def _unsharded_counter(ledger: pd.DataFrame, origin: int) -> list[dict[str, Any]]:
    """A counter track per rank: bytes of all-gathered parameters held (``unsharded``)."""
    if not len(ledger):
        return []
    frame = pd.DataFrame({
        "ph": "C", "name": "unsharded parameter bytes", "pid": ledger["rank"].astype("int64"),
        "ts": ((ledger["t_wall"] - origin) / 1000.0).astype(float).round(3),
    })
    held = ledger["held_bytes"].astype("int64").tolist()
    return [{**record, "args": {"bytes": value}}
            for record, value in zip(frame.to_dict("records"), held, strict=True)]


def _boundaries(markers: pd.DataFrame) -> list[dict[str, Any]]:
    """Micro-step begins, optimizer steps and closes as instants on the boundaries track."""
    if not len(markers):
        return []
    kind = markers["kind"].astype(str)
    label = kind + " step " + markers["step"].astype(str)
    label = label.where(kind != schema.MARKER_MICRO_STEP,
                        label + "." + markers["micro_step"].astype(str))
    frame = pd.DataFrame({
        "ph": "i", "s": "p", "cat": "boundary", "name": label,
        "pid": markers["rank"].astype("int64"), "tid": TRACKS["boundaries"],
        "ts": markers["ts"].astype(float).round(3), "step": markers["step"].astype("int64"),
        "micro_step": markers["micro_step"].astype("int64"),
        "detail": markers["detail"].fillna("").astype(str),
    })
    return [_with_args(r, ("step", "micro_step", "detail")) for r in frame.to_dict("records")]


def _finding_instants(findings: pd.DataFrame, events: pd.DataFrame) -> list[dict[str, Any]]:
    """Each finding at the first event it names; else at its rank's last event."""
    if not len(findings):
        return []
    placed = _place_findings(findings.reset_index(drop=True), events)
    records = []
    for row in placed.itertuples(index=False):
        has_rank = pd.notna(row.rank)
        where = f"{row.unit}" + (f" -> {row.target}" if pd.notna(row.target) else "")
        records.append({
            "ph": "i", "s": "p" if has_rank else "g", "cat": f"finding,{row.severity}",
            "name": f"{row.check}: {where}" if pd.notna(row.unit) else str(row.check),
            "pid": int(row.rank) if has_rank else 0,
            "tid": TRACKS.get(str(row.phase), 0), "ts": round(float(row.ts), 3),
            "args": {"severity": str(row.severity), "message": str(row.message)},
        })
    return records


def _place_findings(findings: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """Add ``ts`` to each finding by the narrowest key set that matches an event."""
    ts = pd.Series(np.nan, index=findings.index)
    keyed = events
    for keys in _FINDING_KEYS:
        todo = findings[ts.isna() & findings[keys].notna().all(axis=1)]
        if not len(todo) or not len(keyed):
            continue
        first = keyed.groupby(keys, observed=True)["ts"].min().rename("hit").reset_index()
        probe = _as_keys(todo[keys]).reset_index()
        hits = probe.merge(_as_keys(first[keys]).assign(hit=first["hit"]), on=keys, how="left")
        ts.loc[hits["index"]] = hits["hit"].to_numpy()
    last = events.groupby("rank")["ts"].max() if len(events) else pd.Series(dtype=float)
    end = float(events["ts"].max()) if len(events) else 0.0
    fallback = findings["rank"].map(lambda r: last.get(int(r), end) if pd.notna(r) else end)
    return findings.assign(ts=ts.fillna(fallback.astype(float)))


def _as_keys(frame: pd.DataFrame) -> pd.DataFrame:
    """Location columns in one comparable form (findings use Int64/str, events int32/category)."""
    out = frame.copy()
    for column in out.columns:
        if column in ("rank", "step", "micro_step"):
            out[column] = out[column].astype("int64")
        elif column in ("phase", "unit"):
            out[column] = out[column].astype(object).astype("string")
    return out


def _with_args(record: dict[str, Any], arg_names: tuple[str, ...]) -> dict[str, Any]:
    args = {name: record.pop(name) for name in arg_names}
    record["args"] = args
    return record
