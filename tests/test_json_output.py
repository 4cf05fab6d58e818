"""``--format json`` of analyze, summary and suggest: real output against the JSON Schemas the
package ships, and the fields CI scripts read (verdict, counts, every finding's figures)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fsdptrace_cli.main import cli

import fsdptrace
from fsdptrace.checks import CHECKS
from fsdptrace.checks.findings import COLUMNS
from fsdptrace.render import as_json
from fsdptrace.render.formats import SUGGEST_FORMATS, SUMMARY_FORMATS, write
from fsdptrace.version import __version__
from fsdptrace.views.suggest import suggest
from fsdptrace.views.summary import summarize

jsonschema = pytest.importorskip("jsonschema")


def run_json(*args: str | Path, code: int = 0) -> dict[str, Any]:
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def assert_valid(doc: dict[str, Any], kind: str) -> None:
    schema = json.loads(as_json.schema_path(kind).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(doc, schema)
    assert (doc["schema_version"], doc["fsdptrace_version"], doc["kind"]) == (
        as_json.JSON_SCHEMA_VERSION, __version__, kind)


@pytest.mark.parametrize(("scenario", "checks", "code", "verdict"), [
    ("clean", (), 0, "clean"), ("order-instability", ("order-instability",), 0, "warnings"),
    ("wrong-forward-prefetch", (), 1, "errors")])
def test_analyze_json_has_a_verdict_and_counts(scenario_runs: Path, scenario: str,
                                               checks: tuple[str, ...], code: int,
                                               verdict: str) -> None:
    selection = [arg for name in checks for arg in ("--check", name)]
    doc = run_json("analyze", scenario_runs / scenario, "--format", "json", "-j", "1",
                   *selection, code=code)
    assert_valid(doc, "analysis")
    assert doc["verdict"] == verdict
    assert doc["checks"] == (list(checks) or list(CHECKS))
    counts, found = doc["counts"], doc["findings"]
    assert counts["total"] == len(found) == doc["summary"]["num_findings"]
    for severity in ("error", "warning"):
        assert counts["by_severity"][severity] == sum(f["severity"] == severity for f in found)
        for name, per in counts["by_check"].items():
            assert per[severity] == sum(f["check"] == name and f["severity"] == severity
                                        for f in found)
    assert all(list(f) == [*COLUMNS, "group"] for f in found)  # group: the finding's cause
    assert sorted({f["group"] for f in found}) == [c["group"] for c in doc["causes"]]


def test_analyze_json_carries_the_figures(scenario_runs: Path) -> None:
    doc = run_json("analyze", scenario_runs / "wrong-forward-prefetch", "--format", "json",
                   "--check", "prefetch-order", "-j", "1", code=1)
    assert doc["checks"] == ["prefetch-order"]
    assert list(doc["counts"]["by_check"]) == ["prefetch-order"]
    first = doc["findings"][0]
    assert (first["unit"], first["target"], first["position"], first["target_position"]) == (
        "layers.2", "layers.1", 3, 2)
    assert first["bytes"] is None and first["parameters"] is None


def test_summary_json(scenario_runs: Path) -> None:
    doc = run_json("summary", scenario_runs / "clean", "--format", "json")
    assert_valid(doc, "summary")
    assert (doc["ranks"], doc["world_size"], doc["clean_close"]) == (2, 2, 2)
    assert [r["rank"] for r in doc["per_rank"]] == [0, 1]
    assert {r["ended"] for r in doc["per_rank"]} == {"clean close"}


SAMPLES = sorted(p for p in (Path(__file__).resolve().parents[1] / "sample_traces").iterdir()
                 if p.is_dir())


@pytest.mark.parametrize("run_dir", SAMPLES, ids=lambda p: p.name)
def test_analyze_json_says_the_run_in_the_numbers_summary_says(run_dir: Path) -> None:
    """The run in numbers under ``analyze --format json`` is counted a rank at a time; the same
    numbers as ``summary``'s, which loads the whole run (killed ranks' journal tails too)."""
    result = CliRunner().invoke(cli, ["analyze", str(run_dir), "--format", "json", "-j", "1"])
    assert result.exit_code in (0, 1), result.output  # 1: the sample's findings
    analysis = json.loads(result.stdout)
    summary = run_json("summary", run_dir, "--format", "json")
    numbers = {k: v for k, v in analysis["summary"].items() if k != "num_findings"}
    assert numbers == {k: summary[k] for k in numbers}
    assert numbers["events"] > 0 and numbers["ranks"] == len(summary["per_rank"])


@pytest.fixture
def never_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fsdptrace.load`` made to fail: what reads a rank at a time never calls it."""
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("fsdptrace.load called")

    monkeypatch.setattr("fsdptrace.reading.trace.load", refuse)


@pytest.mark.usefixtures("never_loaded")
def test_analyze_json_never_loads_the_whole_run() -> None:
    """Loading every table of a 64-rank run of 10M events took 5 GB for these numbers."""
    doc = run_json("analyze", SAMPLES[0].parent / "killed-rank", "--format", "json", "-j", "1",
                   code=1)
    numbers = doc["summary"]
    assert (numbers["ranks"], numbers["steps"], numbers["events"]) == (2, 2, 51)


# Outputs that read a run dir a rank at a time, and what they print for a loaded trace.
RANK_BY_RANK = {"summary": (SUMMARY_FORMATS, summarize), "suggest": (SUGGEST_FORMATS, suggest)}


@pytest.mark.parametrize(("command", "fmt"), [
    (command, fmt) for command, (formats, _) in RANK_BY_RANK.items() for fmt in formats])
@pytest.mark.parametrize("run_dir", SAMPLES, ids=lambda p: p.name)
def test_a_run_dir_read_rank_by_rank_prints_what_its_loaded_trace_prints(
        run_dir: Path, command: str, fmt: str) -> None:
    """``summary`` and ``suggest`` count a rank at a time; what they print is what the same
    output of the whole run loaded in memory (``fsdptrace.load``) prints."""
    result = CliRunner().invoke(cli, [command, str(run_dir), "--format", fmt])
    assert result.exit_code == 0, result.output
    formats, view = RANK_BY_RANK[command]
    page = io.StringIO()
    write(formats[fmt].render, view(fsdptrace.load(run_dir)), page)
    assert result.stdout == page.getvalue()


@pytest.mark.usefixtures("never_loaded")
def test_summary_and_suggest_never_load_the_whole_run() -> None:
    """Loading every table of a 64-rank run of 10M events took 9.3 GB for ``summary``, 4.9 GB
    for ``suggest``."""
    run_dir = SAMPLES[0].parent / "killed-rank"
    doc = run_json("summary", run_dir, "--format", "json")
    assert (doc["ranks"], doc["events"], len(doc["per_rank"])) == (2, 51, 2)
    doc = run_json("suggest", run_dir, "--format", "json")
    assert doc["forward_order"] == ["<root>", "layers.0", "layers.1", "layers.2", "layers.3"]


def test_suggest_json(scenario_runs: Path) -> None:
    doc = run_json("suggest", scenario_runs / "wrong-forward-prefetch", "--format", "json")
    assert_valid(doc, "suggest")
    assert "model.layers[2].set_modules_to_forward_prefetch([model.layers[3]])" in doc["calls"]
    assert {"phase": "forward", "unit": "layers.2", "target": "layers.1",
            "action": "remove"} in doc["edges"]


def test_the_schemas_ship_with_the_package() -> None:
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    # That the wheel holds them: tests/test_newcomer_packaging.py.
    assert '"fsdptrace.schemas" = ["*.schema.json"]' in pyproject
    for kind in ("analysis", "summary", "suggest"):
        assert as_json.schema_path(kind).is_file()
