"""The command line through click's CliRunner: every command, exit code and bad input.

Run dirs are the real 2-rank recordings of the ``scenario_runs`` fixture; damaged ones are
copies with one file broken the way real run dirs break (killed writes, other versions).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from fsdptrace_cli.commands import COMMANDS
from fsdptrace_cli.main import cli

from fsdptrace.version import __version__
from tests.jobs import REPO
from tests.recordings import Recordings

COMMAND_NAMES = sorted(c.name for c in COMMANDS if c.name)


def invoke(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def assert_bad_input(result: Result, fragment: str) -> None:
    """Exit 2 with exactly one line on stderr naming the problem, and no traceback."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fsdptrace: error: ")
    assert fragment in lines[0]
    assert "Traceback" not in result.output


# --- help and version -----------------------------------------------------------------------

def test_every_planned_command_is_registered() -> None:
    assert {"record", "analyze", "summary", "export", "suggest"} <= set(COMMAND_NAMES)


@pytest.mark.parametrize("name", [None, *COMMAND_NAMES])
def test_help_has_an_example(name: str | None) -> None:
    result = invoke(*([name] if name else []), "--help")
    assert result.exit_code == 0
    assert "Example" in result.output


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert __version__ in result.output


# --- analyze --------------------------------------------------------------------------------

@pytest.mark.parametrize(("scenario", "code"), [("clean", 0), ("wrong-forward-prefetch", 1)])
def test_analyze_text(scenario_runs: Path, scenario: str, code: int) -> None:
    result = invoke("analyze", scenario_runs / scenario, "--jobs", "1")
    assert result.exit_code == code
    assert result.stdout.startswith("OK: " if code == 0 else "FAIL: 12 error(s)")


def test_analyze_json(scenario_runs: Path) -> None:
    result = invoke("analyze", scenario_runs / "wrong-forward-prefetch", "--format", "json",
                    "-j", "1")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert {"run_dir", "ranks", "world_size", "findings", "summary"} <= set(doc)
    assert doc["ranks"] == [0, 1] and doc["world_size"] == 2
    errors = [f for f in doc["findings"] if f["severity"] == "error"]
    assert len(errors) == 12
    assert {f["check"] for f in errors} == {"prefetch-order"}


def test_analyze_markdown_to_file(scenario_runs: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    result = invoke("analyze", scenario_runs / "wrong-forward-prefetch", "--format", "markdown",
                    "--output", report, "-j", "1")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert report.read_text().startswith("# fsdptrace: FAIL")
    assert "prefetch-order" in report.read_text()


def test_analyze_check_selects_checks(scenario_runs: Path) -> None:
    run = scenario_runs / "wrong-forward-prefetch"
    assert invoke("analyze", run, "--check", "bypassed-unit", "-j", "1").exit_code == 0
    assert invoke("analyze", run, "--check", "prefetch-order", "-j", "1").exit_code == 1


def test_analyze_unknown_check_is_bad_input(scenario_runs: Path) -> None:
    result = invoke("analyze", scenario_runs / "clean", "--check", "no-such-check", "-j", "1")
    assert_bad_input(result, "no-such-check")


@pytest.mark.parametrize(("fail_on", "code"), [("error", 0), ("warning", 1), ("never", 0)])
def test_fail_on_a_warning_only_run(scenario_runs: Path, fail_on: str, code: int) -> None:
    result = invoke("analyze", scenario_runs / "order-instability", "--check",
                    "order-instability", "--fail-on", fail_on, "-j", "1")
    assert result.exit_code == code
    assert result.stdout.startswith("WARN: no errors")


def test_fail_on_never_with_errors(scenario_runs: Path) -> None:
    result = invoke("analyze", scenario_runs / "wrong-forward-prefetch", "--fail-on", "never",
                    "-j", "1")
    assert result.exit_code == 0


# --- summary, export, suggest ---------------------------------------------------------------

def test_summary(scenario_runs: Path) -> None:
    result = invoke("summary", scenario_runs / "clean")
    assert result.exit_code == 0
    assert "world size: 2" in result.stdout
    assert "clean close: 2" in result.stdout
    assert "missing ranks: []" in result.stdout


def test_export_chrome_trace(scenario_runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.trace.json"
    result = invoke("export", scenario_runs / "wrong-forward-prefetch", "--chrome-trace", out)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    processes = [e for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert sorted(e["pid"] for e in processes) == [0, 1]
    names = [e["name"] for e in doc["traceEvents"] if e.get("cat", "").startswith("finding")]
    assert names.count("prefetch-order: layers.2 -> layers.1") == 12


def test_export_needs_a_destination(scenario_runs: Path) -> None:
    result = invoke("export", scenario_runs / "clean")
    assert result.exit_code == 2
    assert "--chrome-trace" in result.output


def test_suggest(scenario_runs: Path) -> None:
    result = invoke("suggest", scenario_runs / "wrong-forward-prefetch")
    assert result.exit_code == 0
    assert "model.layers[2].set_modules_to_forward_prefetch([model.layers[3]])" in result.stdout
    assert "- forward  'layers.2' -> 'layers.1'  (remove)" in result.stdout
    assert "+ forward  'layers.2' -> 'layers.3'  (add)" in result.stdout


def test_a_reader_that_closes_stdout_early_gets_no_traceback(scenario_runs: Path) -> None:
    # `fsdptrace analyze RUN | head -1` where head is gone before the report is written: the
    # pipe's read end is closed before the command starts, so its first write fails.
    command = [sys.executable, "-m", "fsdptrace_cli.main", "analyze",
               str(scenario_runs / "wrong-forward-prefetch"), "-j", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "cli")])}
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(command, stdout=write_end, stderr=subprocess.PIPE, env=env,
                                timeout=120, check=False)
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stderr
    assert result.stderr == b""


# --- bad input ------------------------------------------------------------------------------

OUTPUT_COMMANDS = [("analyze", "-o"), ("analyze", "--format", "json", "-o"), ("report", "-o"),
                   ("export", "--chrome-trace")]


def unwritable_outputs(tmp_path: Path) -> list[tuple[Path, str]]:
    (tmp_path / "a-file").write_text("")
    return [(Path("/nonexistent/x.out"), "folder /nonexistent does not exist"),
            (tmp_path, "it is a directory"),
            (tmp_path / "a-file" / "x.out", f"{tmp_path / 'a-file'} is not a folder")]


@pytest.mark.parametrize("args", OUTPUT_COMMANDS, ids=lambda a: "-".join(a))
def test_an_unwritable_output_is_refused_before_any_work(scenario_runs: Path, tmp_path: Path,
                                                         args: tuple[str, ...]) -> None:
    for output, fragment in unwritable_outputs(tmp_path):
        # The run dir does not exist: refusing the output first proves no work was done.
        result = invoke(args[0], tmp_path / "no-run", *args[1:], output)
        assert_bad_input(result, f"cannot write {output}: {fragment}")
        assert_bad_input(invoke(args[0], scenario_runs / "clean", *args[1:], output), fragment)

RUN_DIR_COMMANDS = [("analyze", "-j", "1"), ("summary",), ("suggest",),
                    ("export", "--chrome-trace", "-")]


def first_part(run_dir: Path, table: str = "events") -> Path:
    return sorted((run_dir / table / "rank=0").glob("part-*.parquet"))[0]


def copy_run(scenario_runs: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(scenario_runs / "clean", tmp_path / "run"))


def truncated(run: Path) -> str:
    part = first_part(run)
    part.write_bytes(part.read_bytes()[:200])
    return "unreadable Parquet"


def other_version(run: Path) -> str:
    part = first_part(run)
    data = pq.read_table(part)
    metadata = {**(data.schema.metadata or {}), b"fsdptrace.schema_version": b"99"}
    pq.write_table(data.replace_schema_metadata(metadata), part)
    return "schema 99; this fsdptrace reads schema 1"


def wrong_schema(run: Path) -> str:
    part = first_part(run)
    metadata = pq.read_table(part).schema.metadata
    pq.write_table(pa.table({"x": [1, 2]}).replace_schema_metadata(metadata), part)
    return "not a events table (missing columns seq"


def wrong_types(run: Path) -> str:
    part = first_part(run)
    data = pq.read_table(part)
    index = data.column_names.index("t_ns")
    data = data.set_column(index, "t_ns", pa.array(["late"] * data.num_rows))
    pq.write_table(data, part)
    return "column types do not match the events table"


@pytest.mark.parametrize("damage", [other_version, wrong_schema, wrong_types])
@pytest.mark.parametrize("args", RUN_DIR_COMMANDS, ids=lambda a: a[0])
def test_damaged_file(scenario_runs: Path, tmp_path: Path, damage, args: tuple[str, ...]
                      ) -> None:
    run = copy_run(scenario_runs, tmp_path)
    fragment = damage(run)
    result = invoke(args[0], run, *args[1:])
    assert_bad_input(result, fragment)
    assert str(first_part(run)) in result.stderr


@pytest.mark.parametrize("args", RUN_DIR_COMMANDS, ids=lambda a: a[0])
def test_a_truncated_chunk_is_skipped_with_one_warning(scenario_runs: Path, tmp_path: Path,
                                                       args: tuple[str, ...]) -> None:
    run = copy_run(scenario_runs, tmp_path)
    fragment = truncated(run)
    result = invoke(args[0], run, *args[1:])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith(f"fsdptrace: warning: skipping {first_part(run)}: "
                                    f"{fragment}")
    assert len(result.stderr.splitlines()) == 1


def not_a_run_dir(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("not a run\n")
    return tmp_path, "is this a fsdptrace run dir?"


@pytest.mark.parametrize("make", [
    lambda tmp: (tmp / "missing", "does not exist"),
    lambda tmp: (tmp, "is this a fsdptrace run dir?"),
    not_a_run_dir,
], ids=["missing", "empty", "not-a-run-dir"])
@pytest.mark.parametrize("args", RUN_DIR_COMMANDS, ids=lambda a: a[0])
def test_not_a_run_dir(tmp_path: Path, make, args: tuple[str, ...]) -> None:
    path, fragment = make(tmp_path)
    assert_bad_input(invoke(args[0], path, *args[1:]), fragment)


def test_missing_rank_is_a_finding_not_bad_input(scenario_runs: Path, tmp_path: Path) -> None:
    run = copy_run(scenario_runs, tmp_path)
    for partition in run.glob("*/rank=1"):
        shutil.rmtree(partition)
    result = invoke("analyze", run, "--format", "json", "-j", "1")
    assert result.exit_code == 1
    found = json.loads(result.stdout)["findings"]
    assert [(f["check"], f["rank"]) for f in found] == [("stalled-rank", 1)]
    assert "no data on disk" in found[0]["message"]
    for args in RUN_DIR_COMMANDS[1:]:
        assert invoke(args[0], run, *args[1:]).exit_code == 0


# --- one real job, end to end ---------------------------------------------------------------

def record_tiny(run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    bin_dir = Path(sys.executable).parent
    command = [str(bin_dir / "fsdptrace"), "record", "--run-dir", str(run_dir), "--",
               str(bin_dir / "torchrun"), "--nproc-per-node", "2",
               str(REPO / "examples" / "train_tiny.py"), "--steps", "1", *extra]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_record_end_to_end(tmp_path: Path, recordings: Recordings) -> None:
    _, planted = recordings.demo()  # record_tiny's launch without --fixed, made once a session
    # The job trained fine: record says so, whatever the findings (--fail-on makes them fail).
    assert planted.returncode == 0, planted.stdout + planted.stderr
    # One wrong line, one cause: its prefetch-order and wasted-prefetch findings told under it.
    assert "[error] cause: the forward prefetch edge 3 (Block) -> 2 (Block)" in planted.stdout
    assert "  prefetch-order (prefetch target missing or out of order)" in planted.stdout
    assert "3 (Block) prefetched 2 (Block) at positions 3->2" in planted.stdout
    fixed = record_tiny(tmp_path / "fixed", "--fixed")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "OK: no findings across 2 of 2 ranks" in fixed.stdout
