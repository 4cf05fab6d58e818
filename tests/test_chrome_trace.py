"""The Chrome trace export on real recordings: conventional Trace Event JSON that Perfetto
imports, unit slices only where an end was recorded, all-gather flows, a bytes-held counter per
rank, an epoch clock, and findings in place."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import fsdptrace
from fsdptrace.reading import unsharded
from fsdptrace.render.chrome_trace import (
    COUNTER,
    chrome_trace,
    write_chrome_trace,
    write_run_dir_chrome_trace,
)
from fsdptrace.render.wall_clock import shifts, wall_ns

REQUIRED = {"X": {"name", "ph", "ts", "dur", "pid", "tid"},
            "i": {"name", "ph", "ts", "pid", "tid", "s"},
            "M": {"name", "ph", "pid", "tid", "args"},
            "C": {"name", "ph", "ts", "pid", "tid", "args"},
            "s": {"name", "cat", "ph", "ts", "pid", "tid", "id"},
            "f": {"name", "cat", "ph", "ts", "pid", "tid", "id", "bp"}}
EPOCH_2020_US = 1_577_836_800 * 10**6


def export(run_dir: Path) -> tuple[fsdptrace.Trace, Any, dict[str, Any]]:
    trace = fsdptrace.load(run_dir)
    findings = fsdptrace.analyze(trace).findings
    out = io.StringIO()
    write_chrome_trace(trace, findings, out)
    return trace, findings, json.loads(out.getvalue())


def of(doc: dict[str, Any], ph: str, cat: str | None = None) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"]
            if e["ph"] == ph and (cat is None or e.get("cat", "").startswith(cat))]


def epoch_us(trace: fsdptrace.Trace, rank: int, t_ns: int) -> float:
    return (t_ns + shifts(trace.meta)[rank]) / 1000.0


@pytest.mark.parametrize("name", ["clean", "clean-reentrant-checkpoint", "killed-rank"])
def test_conventional_trace_event_json(scenario_runs: Path, name: str) -> None:
    trace, _, doc = export(scenario_runs / name)
    for event in doc["traceEvents"]:
        assert REQUIRED[event["ph"]] <= set(event), event
        assert type(event["pid"]) is int and type(event["tid"]) is int, event
    names = {e["pid"]: e["args"]["name"] for e in of(doc, "M") if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in of(doc, "M")
               if e["name"] == "thread_name"}
    assert {threads[(0, 1)], threads[(0, 2)], threads[(0, 3)]} == {
        "forward", "backward", "all-gathers"}
    used = {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["ph"] != "M"}
    assert used <= set(threads), "every track in use has a name"
    units = of(doc, "X", "unit") + of(doc, "i", "unit")
    assert len(units) == len(trace.events)
    assert len(of(doc, "i", "boundary")) == len(trace.markers)


def test_timestamps_are_epoch_microseconds_from_the_anchor(scenario_runs: Path) -> None:
    trace, _, doc = export(scenario_runs / "clean")
    anchors = doc["otherData"]["wall_clock_anchors"]
    assert set(anchors) == {"0", "1"} and doc["otherData"]["ranks_without_anchor"] == []
    assert "baseTimeNanoseconds" in doc["otherData"]["clock"]
    for rank in (0, 1):
        mine = trace.events[trace.events["rank"] == rank]
        anchor = anchors[str(rank)]
        first = int(mine["t_ns"].min()) + anchor["wall_anchor_ns"] - anchor["mono_anchor_ns"]
        starts = [e["ts"] for e in of(doc, "X", "unit") + of(doc, "i", "unit")
                  if e["pid"] == rank]
        assert min(starts) == pytest.approx(first / 1000.0, abs=0.5)
        assert min(starts) > EPOCH_2020_US
    # Both ranks ran on this host at the same time: their clocks agree to well under a second.
    firsts = [min(e["ts"] for e in of(doc, "X", "unit") if e["pid"] == r) for r in (0, 1)]
    assert abs(firsts[0] - firsts[1]) < 1e6


def test_unit_slices_end_only_where_an_end_was_recorded(scenario_runs: Path) -> None:
    trace, _, doc = export(scenario_runs / "clean")
    reshards = trace.allgathers[trace.allgathers["event"].astype(str) == "reshard"]
    forward_ends = {(int(r), str(u), epoch_us(trace, int(r), int(t))) for r, u, t in zip(
        reshards["rank"], reshards["unit"], reshards["t_ns"], strict=True)}
    grads = trace.backward_grads
    backward_ends = {(int(r), str(u), epoch_us(trace, int(r), int(t))) for r, u, t in zip(
        grads["rank"], grads["unit"], grads["t_ns"], strict=True)}
    slices = of(doc, "X", "unit")
    assert slices
    for event in slices:
        phase, end = event["args"]["phase"], event["args"]["end"]
        ends = forward_ends if phase == "forward" else backward_ends
        assert end == ("post-forward reshard" if phase == "forward" else "post-backward")
        near = [t for r, u, t in ends if r == event["pid"] and u == event["name"]
                and abs(t - (event["ts"] + event["dur"])) < 1.0]
        assert near, f"no recorded end for {event}"
    instants = of(doc, "i", "unit")
    # The root keeps its parameters after forward: nothing marks its forward's end.
    assert {(e["name"], e["args"]["phase"], e["args"]["end"]) for e in instants} == {
        ("<root>", "forward", "none recorded")}
    assert len(instants) == int(((trace.events["unit"] == "<root>")
                                 & (trace.events["phase"] == "forward")).sum())
    assert doc["otherData"]["num_unit_instants"] == len(instants)


def test_a_unit_that_never_ended_is_an_instant(scenario_runs: Path) -> None:
    """Rank 1 was killed after its forward; rank 0 entered backward and blocked there."""
    _, _, doc = export(scenario_runs / "killed-rank")
    units = of(doc, "X", "unit") + of(doc, "i", "unit")
    last = {pid: max((e for e in units if e["pid"] == pid), key=lambda e: e["ts"])
            for pid in (0, 1)}
    assert (last[0]["ph"], last[0]["args"]["phase"], last[0]["args"]["end"]) == (
        "i", "backward", "none recorded")
    assert (last[1]["ph"], last[1]["args"]["end"]) == ("X", "post-forward reshard")


def test_all_gathers_flow_from_issue_to_consume(scenario_runs: Path) -> None:
    trace, _, doc = export(scenario_runs / "wrong-forward-prefetch")
    gathers = of(doc, "X", "all-gather")
    issues = trace.allgathers[trace.allgathers["event"].astype(str) == "issue"]
    assert len(gathers) == len(issues)
    starts, ends = of(doc, "s", "all-gather"), of(doc, "f", "all-gather")
    assert len(starts) == len(ends) == doc["otherData"]["num_all_gather_flows"] > 0
    by_id = {e["id"]: e for e in ends}
    assert len(by_id) == len(ends) and {e["id"] for e in starts} == set(by_id)
    slices = of(doc, "X", "unit")
    for start in starts:
        end = by_id[start["id"]]
        assert (end["pid"], end["cat"], end["name"]) == (start["pid"], "all-gather",
                                                         "all-gather")
        gather = next(g for g in gathers if (g["pid"], g["tid"], g["ts"])
                      == (start["pid"], start["tid"], start["ts"]))
        assert gather["args"]["ended_by"] == "consume"
        assert end["ts"] == pytest.approx(gather["ts"] + gather["dur"], abs=0.5)
        consumer = [s for s in slices if (s["pid"], s["tid"], s["name"])
                    == (end["pid"], end["tid"], gather["args"]["unit"])
                    and s["ts"] <= end["ts"] <= s["ts"] + s["dur"]]
        assert len(consumer) == 1, (start, end)
    prefetched = [g for g in gathers if g["args"]["issued_by"] == "prefetch (layers.2)"]
    assert {g["name"] for g in prefetched} == {"all-gather layers.1"}
    # Gathers in flight at the same time never share a track.
    for pid in (0, 1):
        for tid in {g["tid"] for g in gathers if g["pid"] == pid}:
            lane = sorted((g["ts"], g["ts"] + g["dur"]) for g in gathers
                          if (g["pid"], g["tid"]) == (pid, tid))
            assert all(a[1] <= b[0] + 0.5 for a, b in zip(lane, lane[1:], strict=False))


def test_bytes_held_counter_per_rank(scenario_runs: Path) -> None:
    trace, _, doc = export(scenario_runs / "clean")
    counters = [e for e in of(doc, "C") if e["name"] == COUNTER]
    ledger = unsharded.timeline(trace.allgathers)
    assert {e["pid"] for e in counters} == {0, 1}
    for rank in (0, 1):
        mine = [e["args"]["bytes"] for e in counters if e["pid"] == rank]
        expected = ledger.loc[ledger["rank"] == rank, "held_bytes"].tolist()
        assert mine == expected and max(mine) > 0 and mine[-1] == 0


def test_findings_sit_on_the_event_they_name(scenario_runs: Path) -> None:
    _, findings, doc = export(scenario_runs / "wrong-forward-prefetch")
    assert len(of(doc, "i", "finding")) == len(findings)
    instants = [e for e in of(doc, "i", "finding") if e["name"].startswith("prefetch-order")]
    assert len(instants) == 12
    begins = {(e["pid"], e["ts"]) for e in of(doc, "X", "unit")
              if e["name"] == "layers.2" and e["tid"] == 1}
    assert {(e["pid"], e["ts"]) for e in instants} == begins
    assert all(e["name"] == "prefetch-order: layers.2 -> layers.1" for e in instants)


def test_stalled_rank_finding_at_its_last_event(scenario_runs: Path) -> None:
    _, findings, doc = export(scenario_runs / "killed-rank")
    stalled = [e for e in of(doc, "i", "finding") if e["name"].startswith("stalled-rank")]
    assert len(stalled) == (findings["check"] == "stalled-rank").sum() >= 1
    units = of(doc, "X", "unit") + of(doc, "i", "unit")
    last = {pid: max(e["ts"] for e in units if e["pid"] == pid) for pid in (0, 1)}
    for event in stalled:  # where it stopped: the last unit it entered
        assert event["ts"] == last[event["pid"]]


def test_run_without_provenance_has_units_and_no_gathers() -> None:
    from tests.test_report import synthetic_trace

    trace = synthetic_trace(num_ranks=2, num_units=3)
    trace.meta["wall_anchor_ns"] = 1_700_000_000 * 10**9
    trace.meta["mono_anchor_ns"] = 0
    out = io.StringIO()
    write_chrome_trace(trace, pd.DataFrame(columns=fsdptrace.analyze(trace).findings.columns), out)
    doc = json.loads(out.getvalue())
    assert of(doc, "X") == [] and len(of(doc, "i", "unit")) == len(trace.events)
    assert doc["otherData"]["num_all_gathers"] == 0


def test_a_recording_without_ends_has_instants_and_gathers_without_flows(
    scenario_runs: Path,
) -> None:
    """As from a recorder that wrote issues and consumes but no reshards or post-backwards."""
    trace = fsdptrace.load(scenario_runs / "clean")
    trace.allgathers = trace.allgathers[trace.allgathers["event"].astype(str) != "reshard"]
    trace.backward_grads = trace.backward_grads.iloc[0:0]
    out = io.StringIO()
    write_chrome_trace(trace, fsdptrace.analyze(trace).findings, out)
    doc = json.loads(out.getvalue())
    assert of(doc, "X", "unit") == [] and len(of(doc, "i", "unit")) == len(trace.events)
    assert len(of(doc, "X", "all-gather")) == doc["otherData"]["num_all_gathers"] > 0
    assert of(doc, "s") == [] and doc["otherData"]["num_all_gather_flows"] == 0


SAMPLES = sorted(p for p in (Path(__file__).resolve().parents[1] / "sample_traces").iterdir()
                 if p.is_dir())


def _missing_rank_1(tmp_path: Path) -> Path:
    """The clean sample with rank 1's files gone: its stall finding names a rank with no data."""
    run = tmp_path / "missing"
    shutil.copytree(SAMPLES[0].parent / "clean", run)
    for folder in run.glob("*/rank=1"):
        shutil.rmtree(folder)
    return run


@pytest.mark.parametrize("name", [p.name for p in SAMPLES] + ["missing-rank-1"])
def test_a_run_dir_drawn_rank_by_rank_is_its_loaded_trace_drawn(name: str, tmp_path: Path
                                                                 ) -> None:
    """``fsdptrace export`` reads a rank at a time: the same records (in rank order, not the
    loaded trace's) and the same run facts as the trace loaded whole; flow ids stay unique."""
    run = _missing_rank_1(tmp_path) if name == "missing-rank-1" else SAMPLES[0].parent / name
    trace = fsdptrace.load(run)
    findings = fsdptrace.analyze(trace).findings
    whole = io.StringIO()
    write_chrome_trace(trace, findings, whole)
    by_rank = io.StringIO()
    write_run_dir_chrome_trace(run, findings, by_rank)
    loaded, read = json.loads(whole.getvalue()), json.loads(by_rank.getvalue())
    assert read["otherData"] == loaded["otherData"]
    assert sorted(map(_canonical, read["traceEvents"])) == sorted(
        map(_canonical, loaded["traceEvents"]))
    starts = [e["id"] for e in of(read, "s")]
    assert len(starts) == len(set(starts)) == read["otherData"]["num_all_gather_flows"]
    if name == "missing-rank-1":
        assert [e["pid"] for e in of(read, "M") if e["name"] == "process_name"] == [0, 1]
        assert any(e["pid"] == 1 for e in of(read, "i", "finding"))


def test_the_written_bytes_are_the_document_as_json() -> None:
    trace = fsdptrace.load(SAMPLES[0].parent / "killed-rank")
    findings = fsdptrace.analyze(trace).findings
    out = io.StringIO()
    write_chrome_trace(trace, findings, out)
    assert out.getvalue() == json.dumps(chrome_trace(trace, findings)) + "\n"


def _canonical(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True)


def test_a_rank_without_anchor_moves_no_other_rank_by_a_rounding() -> None:
    """Shifts are ~1.8e18 ns, past a double's 2**53: a missing rank's NaN once sent every
    row through floats and moved it by up to 256 ns (found comparing exports rank by rank)."""
    shift = {0: 1_796_217_931_000_000_000 - 12_345}
    t_ns = pd.Series([1_000_000_123, 2_000_000_457, 3_000_000_001], dtype="int64")
    ranks = pd.Series([0, 5, 0], dtype="int32")
    assert wall_ns(t_ns, ranks, shift).tolist() == [
        1_000_000_123 + shift[0], 2_000_000_457, 3_000_000_001 + shift[0]]
