"""The commands that analyze hold pandas' text in Python objects (``fsdptrace_cli.strings``):
the same outputs, byte for byte, as with pandas' default Arrow storage, and the option left as
the command found it (a test process or a notebook that runs a command keeps its own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from fsdptrace_cli import strings
from fsdptrace_cli.main import cli

from fsdptrace.analysis import run as analysis_run
from tests.jobs import REPO

SAMPLES = REPO / "sample_traces"
# Every command that analyzes, on findings of several checks; the verdict of a rank that did
# not end clean.
CASES = [*((command, "rank-divergence") for command in (
    "analyze", "analyze-json", "summary-json", "suggest", "diff", "report", "export")),
    ("analyze-json", "killed-rank"), ("report", "killed-rank")]
COMMANDS = {
    "analyze": ["analyze", "{run}", "-j", "1"],
    "analyze-json": ["analyze", "{run}", "-j", "1", "--format", "json"],
    "summary-json": ["summary", "{run}", "--format", "json"],
    "suggest": ["suggest", "{run}"],
    "diff": ["diff", str(SAMPLES / "clean"), "{run}", "--format", "json"],
    "report": ["report", "{run}", "-j", "1", "-o", "{out}/report.html"],
    "export": ["export", "{run}", "--chrome-trace", "{out}/trace.json"],
}


def _outputs(args: list[str], run: Path, out: Path, storage: str,
             monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, dict[str, bytes]]:
    """A command's exit code, what it printed and the files it wrote, with pandas' text
    stored as ``storage`` while it runs."""
    out.mkdir()
    before = pd.get_option("mode.string_storage")
    with monkeypatch.context() as patch:
        patch.setattr(strings, "STORAGE", storage)
        result = CliRunner().invoke(cli, [a.format(run=run, out=out) for a in args])
    assert pd.get_option("mode.string_storage") == before  # as the command found it
    files = {p.name: p.read_bytes().replace(str(out).encode(), b"OUT") for p in out.iterdir()}
    return result.exit_code, result.output.replace(str(out), "OUT"), files


@pytest.mark.parametrize(("command", "run"), CASES)
def test_the_same_outputs_whatever_the_text_storage(
        command: str, run: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arrow = _outputs(COMMANDS[command], SAMPLES / run, tmp_path / "arrow", "pyarrow",
                     monkeypatch)
    python = _outputs(COMMANDS[command], SAMPLES / run, tmp_path / "python", "python",
                      monkeypatch)
    assert arrow[0] in (0, 1), arrow[1]
    assert arrow == python


def test_an_analysis_command_runs_with_python_text(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    analyze = analysis_run.analyze

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(pd.get_option("mode.string_storage"))
        return analyze(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(analysis_run, "analyze", spy)
    result = CliRunner().invoke(cli, ["analyze", str(SAMPLES / "clean"), "-j", "1"])
    assert result.exit_code == 0, result.output
    assert seen == ["python"]
    assert pd.get_option("mode.string_storage") != "python"


# A fresh process (the kept frames and dtypes are made by whoever comes first): a command run
# through click, then the library on the same run dir.
_COMMAND_THEN_LIBRARY = """
import json, sys
import pandas as pd
from click.testing import CliRunner
from fsdptrace_cli.main import cli
import fsdptrace
run = sys.argv[1]
assert CliRunner().invoke(cli, ["analyze", run, "-j", "1"]).exit_code == 1
storages = {}
for frame in (fsdptrace.analyze(run, jobs=1).findings, fsdptrace.analyze(run, jobs=1,
              checks=["stalled-rank"]).findings):
    for name, dtype in frame.dtypes.items():
        if isinstance(dtype, pd.StringDtype):
            storages.setdefault(name, set()).add(dtype.storage)
print(json.dumps({name: sorted(kept) for name, kept in storages.items()}))
"""


def test_the_library_after_a_command_holds_pandas_default_text() -> None:
    """The findings frames and dtypes kept across calls follow the storage of each call: a
    notebook that ran a command keeps getting pandas' own from ``fsdptrace.analyze``."""
    result = subprocess.run([sys.executable, "-c", _COMMAND_THEN_LIBRARY,
                             str(SAMPLES / "rank-divergence")],
                            capture_output=True, text=True, timeout=120, check=True)
    storages = json.loads(result.stdout)
    default = pd.Series([], dtype="string").dtype.storage
    assert {"check", "message", "unit"} <= set(storages)
    assert all(kept == [default] for kept in storages.values()), storages
