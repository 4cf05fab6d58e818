"""The Chrome trace export on real recordings: structure Perfetto accepts, and findings in place."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import fsdptrace
from fsdptrace.render.chrome_trace import write_chrome_trace

REQUIRED = {"X": {"name", "ph", "ts", "dur", "pid", "tid"},
            "i": {"name", "ph", "ts", "pid", "tid", "s"},
            "M": {"name", "ph", "pid", "args"},
            "C": {"name", "ph", "ts", "pid", "args"}}


def export(run_dir: Path) -> tuple[fsdptrace.Trace, Any, dict[str, Any]]:
    trace = fsdptrace.load(run_dir)
    findings = fsdptrace.analyze(trace).findings
    out = io.StringIO()
    write_chrome_trace(trace, findings, out)
    return trace, findings, json.loads(out.getvalue())


def of(doc: dict[str, Any], ph: str, cat: str | None = None) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"]
            if e["ph"] == ph and (cat is None or e.get("cat", "").startswith(cat))]


def test_structure(scenario_runs: Path) -> None:
    trace, _, doc = export(scenario_runs / "clean")
    for event in doc["traceEvents"]:
        assert REQUIRED[event["ph"]] <= set(event), event
    names = {e["pid"]: e["args"]["name"] for e in of(doc, "M") if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in of(doc, "M")
               if e["name"] == "thread_name"}
    assert {threads[(0, 1)], threads[(0, 2)]} == {"forward", "backward"}
    slices = of(doc, "X")
    assert len(slices) == len(trace.events)
    assert {e["pid"] for e in slices} == {0, 1}
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in slices)
    assert min(e["ts"] for e in doc["traceEvents"] if "ts" in e) == 0
    assert len(of(doc, "i", "boundary")) == len(trace.markers)
    assert of(doc, "i", "finding") == []


def test_findings_sit_on_the_event_they_name(scenario_runs: Path) -> None:
    _, findings, doc = export(scenario_runs / "wrong-forward-prefetch")
    assert len(of(doc, "i", "finding")) == len(findings)
    instants = [e for e in of(doc, "i", "finding") if e["name"].startswith("prefetch-order")]
    assert len(instants) == 12
    begins = {(e["pid"], e["ts"]) for e in of(doc, "X")
              if e["name"] == "layers.2" and e["tid"] == 1}
    assert {(e["pid"], e["ts"]) for e in instants} == begins
    assert all(e["name"] == "prefetch-order: layers.2 -> layers.1" for e in instants)


def test_stalled_rank_finding_at_its_last_event(scenario_runs: Path) -> None:
    _, findings, doc = export(scenario_runs / "killed-rank")
    stalled = [e for e in of(doc, "i", "finding") if e["name"].startswith("stalled-rank")]
    assert len(stalled) == (findings["check"] == "stalled-rank").sum() >= 1
    last = {pid: max(e["ts"] for e in of(doc, "X") if e["pid"] == pid) for pid in (0, 1)}
    for event in stalled:  # where it stopped: the last unit it entered
        assert event["ts"] == last[event["pid"]]
