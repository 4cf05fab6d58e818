"""What a newcomer reads after ``make demo``: one cause told once, names and sizes a person can
read, suggest apart from FSDP2's defaults, and the small things that must agree.

One real recording serves every test here: ``fsdptrace record`` of examples/train_tiny.py (the
demo, 2 ranks, 1 step of 2 micro-steps), exactly as ``make demo`` runs it. What FSDP2 did in
it, found by instrumenting that run (its ``allgathers`` table): layer 3 of the
``nn.Sequential`` (``layers[2]``) prefetches layer 2 in forward after 2 already ran, so 2's
gather is held into backward; no backward targets are configured, and FSDP2 prefetches
``<root> -> 4``, ``4 -> 3``, ``3 -> 2``, ``2 -> 1`` implicitly (``3 -> 2`` as a no-op: 2 was
still gathered). Units are named ``1``..``4`` by the Sequential; their module type is Block.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner, Result
from fsdptrace_cli.main import cli

from fsdptrace.checks import findings as findings_table
from fsdptrace.reading import unsharded
from fsdptrace.reading.sizes import human_bytes
from fsdptrace.reading.trace import load
from fsdptrace.reading.unit_names import is_positional, labeller, module_types
from fsdptrace.render import as_json, told
from fsdptrace.views import causes
from tests.recordings import Recordings

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def tiny(recordings: Recordings) -> tuple[Path, subprocess.CompletedProcess]:
    """``fsdptrace record`` of the demo job, as ``make demo`` runs it (no --fail-on)."""
    return recordings.demo()


def invoke(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


# --- record -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_record_of_a_job_that_trained_fine_exits_0_with_its_findings(tiny) -> None:
    _, done = tiny
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAIL: 4 error(s), 4 warning(s) across 2 of 2 ranks" in done.stdout
    assert "command exited with 0" in done.stderr


# --- one cause, told once -------------------------------------------------------------------

@pytest.mark.slow
def test_text_tells_the_planted_line_as_one_cause_with_one_fix(tiny) -> None:
    run_dir, _ = tiny
    text = invoke("analyze", run_dir, "-j", "1").stdout
    assert text.count("[error] cause: the forward prefetch edge 3 (Block) -> 2 (Block): "
                      "8 finding(s) from 2 checks, one cause") == 1
    assert text.count("fix: ") == 1
    assert "fix: remove 2 (Block) from 3 (Block)'s forward prefetch targets" in text
    assert "\n  wasted-prefetch (" in text and "which followed from it: 4 finding(s)" in text
    # No check is told on its own beside the cause, and no block headed by a check.
    assert "\n[warning]" not in text and "\n[error] prefetch-order" not in text
    # Every unit runs once per pass: no call of a unit is named.
    assert "call of" not in text and "the call that" not in text


@pytest.mark.slow
def test_markdown_tells_one_cause(tiny) -> None:
    run_dir, _ = tiny
    text = invoke("analyze", run_dir, "-j", "1", "--format", "markdown").stdout
    assert text.count("## ") == 1
    assert "## Cause: the forward prefetch edge 3 (Block) -\\> 2 (Block)" in text
    assert text.count("**Fix:**") == 1


@pytest.mark.slow
def test_json_keeps_every_finding_and_names_its_group(tiny) -> None:
    run_dir, _ = tiny
    doc = json.loads(invoke("analyze", run_dir, "-j", "1", "--format", "json").stdout)
    jsonschema.validate(doc, json.loads(as_json.schema_path("analysis").read_text()))
    assert len(doc["findings"]) == 8
    assert {f["group"] for f in doc["findings"]} == {1}
    [cause] = doc["causes"]
    assert cause == {"group": 1, "kind": "edge", "severity": "error",
                     "checks": ["prefetch-order", "wasted-prefetch"], "num_findings": 8,
                     "shared": True, "unit": "3", "target": "2"}


def _finding(check: str, rank: int, step: int | None, **where: object) -> dict:
    return {"check": check, "severity": "error" if check != "wasted-prefetch" else "warning",
            "rank": rank, "step": step, "message": "worded any way at all", **where}


def test_a_divergence_and_the_stalls_after_it_are_one_cause_from_fields_alone() -> None:
    """Messages are not read: the verdict and the cross-rank checks may reword them freely."""
    found = findings_table.combine([findings_table.from_records([
        _finding("stalled-rank", 0, 0, micro_step=1, phase="backward", unit="<root>"),
        _finding("stalled-rank", 1, 0, micro_step=1, phase="backward", unit="b"),
        _finding("setting-divergence", 1, 0, micro_step=1, unit="a",
                 target="requires_gradient_sync"),
        _finding("eval-divergence", 1, 1, unit="<root>", target="<end>"),
        _finding("bypassed-unit", 0, 0, unit="adapter"),
    ])])
    groups, told_causes = causes.group(found)
    by_check = dict(zip(found["check"], groups, strict=True))
    assert by_check["stalled-rank"] == by_check["setting-divergence"]  # the earliest one
    assert by_check["eval-divergence"] != by_check["setting-divergence"]
    shared = [c for c in told_causes if c.is_shared]
    assert [(c.kind, c.checks) for c in shared] == [
        ("divergence", ("setting-divergence", "stalled-rank"))]
    [block] = [b for b in told.blocks(found) if b.title]
    assert block.title == "setting-divergence on rank(s) 1 and the stop it caused"
    assert [p.check for p in block.parts] == ["setting-divergence", "stalled-rank"]


def test_a_wasted_prefetch_alone_is_told_by_its_check() -> None:
    found = findings_table.combine([findings_table.from_records([
        _finding("wasted-prefetch", 0, 0, micro_step=0, phase="forward", unit="a", target="b",
                 bytes=4096, held_ms=1.5, call_index=1)])])
    [block] = told.blocks(found)
    assert block.title is None and block.parts[0].check == "wasted-prefetch"


# --- names and sizes ------------------------------------------------------------------------

@pytest.mark.slow
def test_positional_names_get_their_module_type(tiny) -> None:
    run_dir, _ = tiny
    label = labeller(module_types(load(run_dir).units))
    assert [label(u) for u in ("3", "<root>", None)] == ["3 (Block)", "<root>", ""]
    assert [is_positional(u) for u in ("3", "1.0", "part[1].2", "layers.3", "<root>")] == [
        True, True, True, False, False]


@pytest.mark.parametrize(("num_bytes", "text"), [
    (0, "0 bytes"), (1, "1 byte"), (1023, "1,023 bytes"), (1024, "1.00 KiB"),
    (8448, "8.25 KiB"), (41984, "41.0 KiB"), (int(2.1 * 2**20), "2.10 MiB"),
    (3 * 2**30 // 2, "1.50 GiB")])
def test_sizes_fit_their_size(num_bytes: int, text: str) -> None:
    assert human_bytes(num_bytes) == text


@pytest.mark.slow
def test_summary_has_every_ranks_memory_line_in_kib(tiny) -> None:
    run_dir, _ = tiny
    text = invoke("summary", run_dir).stdout
    lines = [line.strip() for line in text.splitlines() if "peak unsharded parameters" in line]
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"]
    assert all(" KiB at step " in line and "0.00 MiB" not in line for line in lines)


@pytest.mark.slow
def test_summary_and_report_break_peak_ties_the_same_way(tiny) -> None:
    """Equal peaks in several passes (the demo's micro-steps hold the same bytes): both name
    the earliest pass."""
    from fsdptrace.render.memory_view import memory_view

    run_dir, _ = tiny
    gathers = load(run_dir).allgathers
    peaks = unsharded.peaks(gathers)
    view = {row["rank"]: row["where"] for row in memory_view(gathers)["rows"]}
    for rank in (0, 1):
        line = unsharded.summary_line(peaks, rank)
        assert line is not None and view[rank] in line
    tied = pd.DataFrame({"rank": [0, 0, 0], "step": [0, 1, 2], "micro_step": [0, 0, 0],
                         "phase": ["forward"] * 3, "peak_bytes": [5, 9, 9]})
    assert unsharded.worst_passes(tied)["step"].tolist() == [1]


# --- suggest --------------------------------------------------------------------------------

@pytest.mark.slow
def test_suggest_keeps_fsdp2s_implicit_backward_prefetch_apart(tiny) -> None:
    run_dir, _ = tiny
    text = invoke("suggest", run_dir).stdout
    calls, implicit = text.split("# FSDP2 already does these by default")
    pasted = calls.split("# prefetch matching the observed order (FSDP2):")[1]
    assert "backward" not in pasted.split("# against what is configured now:")[0]
    assert "+ backward" not in calls
    assert "+ forward  '3' (Block) -> '4' (Block)  (add)" in calls
    assert "- forward  '3' (Block) -> '2' (Block)  (remove)" in calls
    assert sorted(re.findall(r"'([^']*)'", line) for line in implicit.splitlines()[1:]
                  if line) == [["2", "1"], ["3", "2"], ["4", "3"], ["<root>", "4"]]
    doc = json.loads(invoke("suggest", run_dir, "--format", "json").stdout)
    jsonschema.validate(doc, json.loads(as_json.schema_path("suggest").read_text()))
    assert sum(e["action"] == "implicit" for e in doc["edges"]) == 4
    assert not any("backward" in call for call in doc["calls"])


# --- the small things -----------------------------------------------------------------------

@pytest.mark.slow
def test_export_says_what_it_wrote_and_instants_name_steps(tiny, tmp_path: Path) -> None:
    run_dir, _ = tiny
    out = tmp_path / "t.json"
    result = invoke("export", run_dir, "--chrome-trace", out)
    assert result.exit_code == 0
    assert result.stderr.strip() == f"wrote {out}"
    names = [e["name"] for e in json.loads(out.read_text())["traceEvents"]
             if e.get("cat") == "boundary"]
    assert "micro_step_begin step 0, micro-step 1" in names
    assert not [n for n in names if "." in n]
    assert invoke("export", run_dir, "--chrome-trace", "-").stderr == ""


@pytest.mark.slow
def test_prefetch_edges_target_index_is_an_integer(tiny) -> None:
    run_dir, _ = tiny
    trace = load(run_dir)
    assert trace.prefetch["target"].isna().any()  # units without targets: null rows
    for edges in (trace.prefetch_edges(), trace.prefetch_edges(step=0)):
        assert edges["target_index"].dtype == "int64"


@pytest.fixture(scope="module")
def uneven_eval(recordings: Recordings) -> Path:
    """tests/jobs_scripts/divergence_job.py ``uneven_eval``: 2 validation batches on rank 0, 3
    on rank 1; rank 1 waits in the third's all-gather until rank 0 exits, then crashes.
    Recorded once a session (``test_recorded_for_checks`` reads the same job)."""
    return recordings.divergence("uneven_eval")[0]


def test_a_real_divergence_and_the_stop_it_caused_are_told_once(uneven_eval: Path) -> None:
    """Found on this job: rank 1 crashed inside eval interval 1 when rank 0 left. Contract v3
    cuts off the interval a rank stopped in, so eval-divergence reports nothing of it; the
    stall itself carries the cause (the stopped intervals compared): one cause, told once, in
    every output, with no second finding repeating it."""
    text = invoke("analyze", uneven_eval, "-j", "1").stdout
    assert "eval-divergence" not in text.split("\n[error] stalled-rank")[0]
    assert "root cause" in text and "eval interval 1" in text
    doc = json.loads(invoke("analyze", uneven_eval, "-j", "1", "--format", "json").stdout)
    assert {f["check"] for f in doc["findings"]} == {"stalled-rank"}
    assert all("root cause" in f["message"] for f in doc["findings"])
    markdown = invoke("analyze", uneven_eval, "-j", "1", "--format", "markdown").stdout
    assert markdown.count("eval interval 1") >= 1
