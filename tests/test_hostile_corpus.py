"""Every command on every hostile run dir: exit 0, 1 or 2, one line, no escape, bounded.

The corpus (``tests/hostile_corpus.py``) mutates the shipped real recordings; each case runs
all commands in a forked child under an address-space limit and an alarm, so a memory bomb
or a hang fails its case instead of the test session.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from fsdptrace_cli.main import cli, report_error

from tests.hostile_corpus import (
    CASES,
    DECODER_ONLY,
    INJECTION,
    build,
    commands_for,
    run_isolated,
)

SAMPLE = Path(__file__).resolve().parents[1] / "sample_traces" / "clean"
SEED = 16
MEMORY_LIMIT = 3 << 30  # address space beyond the test's: pyarrow reserves more than it touches
PEAK_RSS_LIMIT = 1 << 30  # what a case may really use beyond the test process
TIME_LIMIT_S = 120  # all commands of one case, on a busy 2-core CI box
COMMAND_TIME_LIMIT_S = 30

# Cases every command must refuse as bad input, with a fragment of the one line.
REFUSED = {
    "rank=01": "not a rank partition name", "rank=arabic-digit": "not a rank partition name",
    "rank=huge": "rank beyond", "rank=int32-overflow": "rank beyond",
    "world_size=5M": "column world_size", "world_size=int32-max": "column world_size",
    "world_size=0": "column world_size", "world_size=-1": "column world_size",
    "world_size=null": "column world_size has nulls",
    "drop:last_step=2e9": "last_step is 2000000000", "drop:list": "not a flat JSON object",
    "drop:deep": "not a flat JSON object", "drop:backwards": "runs backwards",
    "prefetch:null-target_index": "column target_index has nulls",
    "prefetch:unknown-phase": "column phase holds 'sideways'",
    "events:null-unit": "column unit has nulls", "events:negative-step": "column step holds -7",
    "utf8:events-unit": "UTF-8", "rows:2M-in-kilobytes": "decompression bomb",
    "row-groups:5000": "row groups", "strings:64MB-detail": "column detail decodes to",
    # what schema 2 added, and tables of no rows or no folder
    "allgathers:null-num_bytes": "column num_bytes has nulls",
    "allgathers:negative-num_bytes": "column num_bytes holds -5",
    "allgathers:huge-num_bytes": "column num_bytes holds",
    "allgathers:null-group": "column group has nulls",
    "allgathers:negative-group": "column group holds -3",
    "events:struct-unit": "column types do not match", "events:list-unit": "column types",
    "units:struct-unit": "column types do not match", "units:list-unit": "column types",
    "allgathers:struct-unit": "column types do not match",
    "settings:unknown-setting": "column setting holds 'teleport'",
    "settings:null-unit": "column unit has nulls", "settings:negative-step": "column step",
    "settings:long-value": "column value holds a text",
    "backward_grads:huge-micro_step": "column micro_step holds",
    "grads_written:null-written": "column written has nulls",
    "eval_forwards:unknown-grad_mode": "column grad_mode holds 'sideways'",
    "eval_forwards:negative-step": "column step holds -2",
    "eval_forwards:huge-step": "column step holds",
    # journal segments whose rows are no recording (as a Parquet part's would be)
    "seg:negative-step": "column step holds -7", "seg:huge-micro_step": "column micro_step",
}

# Cases whose damaged chunk is skipped with one warning (the rest of the run dir is analyzed).
SKIPPED_CASES = {"file:empty", "file:truncated", "file:symlink-passwd",
                 # a journal segment that cannot be read, whatever its size or nesting
                 "seg:sparse-3GB", "seg:sparse-1GB-markers", "seg:deep-vocab", "seg:deep-frame",
                 "seg:vocab-list", "seg:vocab-missing-column", "seg:vocab-not-json",
                 "seg:bad-magic", "seg:header-only", "seg:offset-beyond", "seg:vocab-length-4GB",
                 "seg:wrong-kind", "seg:frame-not-json", "seg:frame-not-list",
                 "seg:frame-short-rows", "seg:frame-wrong-types", "seg:unit-code-out-of-range",
                 "seg:symlink-passwd"}
SKIPPED = "fsdptrace: warning: skipping "


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_command_survives(name: str, tmp_path: Path) -> None:
    run = build(name, tmp_path, seed=SEED)
    commands = commands_for(name)
    outcomes, peak = run_isolated(run, memory_bytes=MEMORY_LIMIT, timeout_s=TIME_LIMIT_S,
                                  commands=commands)
    assert peak < PEAK_RSS_LIMIT, f"{name}: peak RSS {peak >> 20} MiB"
    assert [o.command for o in outcomes] == commands, outcomes[0].stderr
    for o in outcomes:
        where = f"{name} / {o.command}: {o.stderr!r}"
        assert o.exit_code in (0, 1, 2), where
        assert not o.traceback, where
        lines = o.stderr.splitlines()
        skipped = [line for line in lines if line.startswith(SKIPPED)]
        # An unreadable chunk is skipped, with one warning line of its own, not refused.
        assert len(skipped) == (name in SKIPPED_CASES), where
        assert len(lines) - len(skipped) <= 1, where
        assert "internal error" not in o.stderr, where  # a bug, not bad input
        assert not o.stdout_has_escape, where
        assert o.seconds < COMMAND_TIME_LIMIT_S, where
        if o.exit_code == 2:
            assert lines[-1].startswith("fsdptrace: error: "), where
        if name in REFUSED:
            assert o.exit_code == 2 and REFUSED[name] in o.stderr, where


def test_a_case_run_through_analyze_alone_is_a_skipped_segment() -> None:
    """What ``commands_for`` leaves out is only ever a segment damage whose kind every command
    still meets in another case (a typo would silently drop a case's commands)."""
    assert DECODER_ONLY <= set(CASES) and DECODER_ONLY <= SKIPPED_CASES
    every_command = {n for n in SKIPPED_CASES if n.startswith("seg:")} - DECODER_ONLY
    assert {"seg:bad-magic", "seg:vocab-not-json", "seg:frame-not-json",
            "seg:unit-code-out-of-range", "seg:sparse-3GB", "seg:symlink-passwd"} <= every_command


def test_suggest_keeps_an_injected_name_a_string_literal(tmp_path: Path) -> None:
    outcomes, _ = run_isolated(build("injection:suggest", tmp_path, seed=SEED),
                               memory_bytes=MEMORY_LIMIT, timeout_s=TIME_LIMIT_S)
    suggest = next(o for o in outcomes if o.command == "suggest")
    assert suggest.exit_code == 0, suggest.stderr
    assert repr(INJECTION) in suggest.stdout
    assert "\n__import__" not in suggest.stdout
    calls = suggest.stdout.split("(FSDP2):\n")[1].split("\n\n")[0]
    compile(calls, "<paste>", "exec")


def test_report_on_a_run_killed_in_step_0(tmp_path: Path) -> None:
    """The post-mortem case: prefetch edges whose source never ran."""
    outcomes, _ = run_isolated(build("killed-in-step-0", tmp_path, seed=SEED),
                               memory_bytes=MEMORY_LIMIT, timeout_s=TIME_LIMIT_S)
    codes = {o.command: o.exit_code for o in outcomes}
    assert codes["report"] == 0 and codes["analyze"] == 1, outcomes


def test_an_unwritable_output_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    result = CliRunner().invoke(cli, ["analyze", str(SAMPLE), "-j", "1", "--output",
                                      str(tmp_path / "file" / "x.txt")])
    assert result.exit_code == 2 and result.stderr.startswith("fsdptrace: error: cannot write")


def test_an_unexpected_exception_is_one_line_naming_a_bug(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A bug is neither bad input nor a finding: one line that says so, exit 2 (never 1)."""
    error = KeyError("1")
    assert report_error(error) == 2
    line = capsys.readouterr().err
    assert line.startswith("fsdptrace: internal error: KeyError: '1' - a bug in fsdptrace")
    assert "--debug" in line and len(line.splitlines()) == 1
    try:
        raise error
    except KeyError as raised:
        assert report_error(raised, debug=True) == 2
    shown = capsys.readouterr().err
    assert shown.startswith("Traceback") and shown.splitlines()[-1] == line.strip()


@pytest.mark.parametrize("code", [0, 3])
def test_record_keeps_the_command_status_when_nothing_was_recorded(
        tmp_path: Path, code: int) -> None:
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(cli, ["record", "--run-dir", str(run_dir), "--",
                                      sys.executable, "-c", f"raise SystemExit({code})"])
    assert result.exit_code == code, result.output
    assert "nothing was recorded" in result.stderr


def test_the_html_report_escapes_control_characters_in_names(tmp_path: Path) -> None:
    """Autoescape leaves ESC, CSI and bidi controls raw; the page shows them as the text
    outputs do (``\\x1b``), and the embedded JSON has them as ``\\u001b``."""
    run = build("escapes:unit-names", tmp_path, seed=SEED)
    page = tmp_path / "report.html"
    result = CliRunner().invoke(cli, ["report", str(run), "-j", "1", "-o", str(page)])
    assert result.exit_code == 0, result.output
    html = page.read_text(encoding="utf-8")
    assert not any(c in html for c in "\x1b\x9b\x07\u202e"), "raw control characters"
    assert "\\x1b" in html or "\\u001b" in html
