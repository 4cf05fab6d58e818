"""``fsdptrace.analyze`` returns one ``Analysis``, and every command and format renders it.

Run dirs are the real 2-rank recordings of the ``scenario_runs`` fixture.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from fsdptrace_cli.commands import analyze as analyze_command
from fsdptrace_cli.commands import suggest as suggest_command
from fsdptrace_cli.commands import summary as summary_command
from fsdptrace_cli.main import cli

import fsdptrace
from fsdptrace.analysis.result import FAIL_ON
from fsdptrace.render.formats import FORMATS, SUGGEST_FORMATS, SUMMARY_FORMATS


def invoke(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.stdout


def test_the_command_line_offers_every_library_format() -> None:
    # The CLI spells the names so that --help imports no pandas; they must stay the same.
    assert analyze_command.FORMATS == tuple(FORMATS)
    assert analyze_command.FAIL_ON == tuple(FAIL_ON)
    assert summary_command.FORMATS == tuple(SUMMARY_FORMATS)
    assert suggest_command.FORMATS == tuple(SUGGEST_FORMATS)


def test_an_analysis_holds_the_facts_around_its_findings(scenario_runs: Path) -> None:
    analysis = fsdptrace.analyze(scenario_runs / "wrong-forward-prefetch", jobs=1)
    assert isinstance(analysis, fsdptrace.Analysis)
    assert (analysis.run_dir, analysis.ranks, analysis.world_size) == (
        scenario_runs / "wrong-forward-prefetch", (0, 1), 2)
    assert analysis.checks == tuple(fsdptrace.analysis.run.CHECKS)
    assert list(analysis.endings["ending"]) == ["clean", "clean"]
    assert analysis.incomplete.empty and analysis.missing_ranks == []
    assert analysis.verdict == "errors"
    assert analysis.fails("error") and analysis.fails("warning") and not analysis.fails("never")
    assert "errors" in repr(analysis) and "2 of 2 ranks" in repr(analysis)
    assert "<table" in analysis._repr_html_()
    with pytest.raises(AttributeError):
        analysis.world_size = 3  # type: ignore[misc]  # frozen


def test_an_analysis_of_the_loaded_trace_is_the_same(scenario_runs: Path) -> None:
    run_dir = scenario_runs / "order-instability"
    from_dir = fsdptrace.analyze(run_dir, jobs=2)
    from_trace = fsdptrace.analyze(fsdptrace.load(run_dir))
    pd.testing.assert_frame_equal(from_dir.findings, from_trace.findings)
    pd.testing.assert_frame_equal(from_dir.endings, from_trace.endings)
    assert (from_dir.ranks, from_dir.world_size, from_dir.verdict) == (
        from_trace.ranks, from_trace.world_size, from_trace.verdict)
    assert (from_dir.ranks, from_dir.world_size) == ((0, 1), 2)
    assert from_trace.trace is from_trace.source  # nothing loaded twice


def test_a_missing_rank_and_its_ending(scenario_runs: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(scenario_runs / "clean", run_dir)
    for table in run_dir.iterdir():
        shutil.rmtree(table / "rank=1", ignore_errors=True)
    analysis = fsdptrace.analyze(run_dir, jobs=1)
    assert (analysis.ranks, analysis.world_size, analysis.missing_ranks) == ((0,), 2, [1])
    assert list(analysis.endings["rank"]) == [0]


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_format_renders_to_a_path_by_name(scenario_runs: Path, tmp_path: Path,
                                                name: str) -> None:
    analysis = fsdptrace.analyze(scenario_runs / "wrong-forward-prefetch", jobs=1)
    out = tmp_path / "out"
    fsdptrace.write(analysis, out, format=name)
    stream = io.StringIO()
    FORMATS[name].render(analysis, stream)
    assert out.read_text() == stream.getvalue() != ""


@pytest.mark.parametrize(("file_name", "starts"), [
    ("report.html", "<!doctype html>"), ("findings.json", "{"), ("findings.md", "# fsdptrace"),
    ("run.trace.json", '{"traceEvents"'), ("findings.txt", "FAIL")])
def test_render_picks_the_format_from_the_file_name(scenario_runs: Path, tmp_path: Path,
                                                   file_name: str, starts: str) -> None:
    analysis = fsdptrace.analyze(scenario_runs / "wrong-forward-prefetch", jobs=1)
    fsdptrace.write(analysis, tmp_path / file_name)
    assert (tmp_path / file_name).read_text().lower().startswith(starts.lower())


def test_render_refuses_an_unknown_format_or_a_bad_path(scenario_runs: Path) -> None:
    analysis = fsdptrace.analyze(scenario_runs / "clean", jobs=1)
    with pytest.raises(fsdptrace.FsdptraceError, match="unknown format 'pdf'"):
        fsdptrace.write(analysis, "x.pdf", format="pdf")
    with pytest.raises(fsdptrace.FsdptraceError, match="does not exist"):
        fsdptrace.write(analysis, "/nonexistent/report.html")


# --- every command with every format ---------------------------------------------------------

@pytest.mark.parametrize("fmt", list(FORMATS))
def test_analyze_in_every_format(scenario_runs: Path, fmt: str) -> None:
    code, out = invoke("analyze", scenario_runs / "wrong-forward-prefetch", "--format", fmt,
                       "-j", "1")
    assert code == 1
    if fmt in ("json", "chrome-trace"):
        doc = json.loads(out)
        assert doc["verdict"] == "errors" if fmt == "json" else "traceEvents" in doc
    else:
        assert {"text": "FAIL:", "markdown": "# fsdptrace: FAIL", "html": "<!doctype html>"}[
            fmt].lower() in out.lower()


def test_analyze_json_says_how_each_rank_ended(scenario_runs: Path) -> None:
    code, out = invoke("analyze", scenario_runs / "clean", "--format", "json", "-j", "1")
    doc = json.loads(out)
    assert code == 0 and doc["verdict"] == "clean"
    assert [(e["rank"], e["ending"]) for e in doc["endings"]] == [(0, "clean"), (1, "clean")]
    assert doc["incomplete"] == []


@pytest.mark.parametrize(("command", "fmt"), [
    (c, f) for c, formats in (("summary", SUMMARY_FORMATS), ("suggest", SUGGEST_FORMATS))
    for f in formats])
def test_summary_and_suggest_in_every_format(scenario_runs: Path, command: str,
                                             fmt: str) -> None:
    code, out = invoke(command, scenario_runs / "wrong-forward-prefetch", "--format", fmt)
    assert code == 0
    if fmt == "json":
        assert json.loads(out)["kind"] == {"summary": "summary", "suggest": "suggest"}[command]
    else:
        assert out.startswith({"summary": "run dir:", "suggest": "observed forward order"}[
            command])


@pytest.mark.parametrize("args", [("report", "-o"), ("export", "--chrome-trace")])
def test_report_and_export_write_what_analyze_writes(scenario_runs: Path, tmp_path: Path,
                                                     args: tuple[str, str]) -> None:
    run_dir = scenario_runs / "wrong-forward-prefetch"
    code, _ = invoke(args[0], run_dir, args[1], tmp_path / "a", "-j", "1")
    assert code == 0  # written; findings do not fail a report
    fmt = "html" if args[0] == "report" else "chrome-trace"
    code, _ = invoke("analyze", run_dir, "--format", fmt, "-o", tmp_path / "b", "-j", "1")
    assert code == 1
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text()
