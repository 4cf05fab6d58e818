"""What ``fsdptrace record`` answers a newcomer: the job's own exit status, unknown options.

A recorded job is the one whose run dir ``record`` analyzes: here the command copies a real
2-rank recording of the ``scenario_runs`` fixture into it (so a job with findings costs no new
FSDP2 launch) and exits with a chosen status. The end-to-end launch of ``train_tiny.py`` is
tests/test_cli.py::test_record_end_to_end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from fsdptrace_cli.main import cli


def record(run_dir: Path, recording: Path, status: int, *options: str) -> Result:
    """``fsdptrace record`` of a command that leaves ``recording`` in the run dir."""
    script = (f"import shutil, sys; shutil.copytree({str(recording)!r}, {str(run_dir)!r}, "
              f"dirs_exist_ok=True); sys.exit({status})")
    args = ["record", "--run-dir", str(run_dir), *options, "--", sys.executable, "-c", script]
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_a_job_with_findings_keeps_its_own_exit_status(scenario_runs: Path, tmp_path: Path
                                                       ) -> None:
    """The command exited 0; the recording holds 12 errors: the scheduler still sees 0."""
    result = record(tmp_path / "r", scenario_runs / "wrong-forward-prefetch", 0)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("FAIL: 12 error(s)")  # the findings are still printed


def test_a_failed_job_keeps_its_own_exit_status(scenario_runs: Path, tmp_path: Path) -> None:
    result = record(tmp_path / "r", scenario_runs / "clean", 3, "--fail-on", "error")
    assert result.exit_code == 3, result.output


@pytest.mark.parametrize(("scenario", "fail_on", "code"), [
    ("wrong-forward-prefetch", "error", 1),
    ("wrong-forward-prefetch", "never", 0),
    ("clean", "warning", 0),
])
def test_fail_on_makes_findings_fail_a_successful_job(scenario_runs: Path, tmp_path: Path,
                                                      scenario: str, fail_on: str, code: int
                                                      ) -> None:
    result = record(tmp_path / "r", scenario_runs / scenario, 0, "--fail-on", fail_on)
    assert result.exit_code == code, result.output


@pytest.mark.parametrize(("option", "said"), [
    ("--wacth", "No such option '--wacth'. Did you mean '--watch'?"),
    ("--run-dri", "No such option '--run-dri'. Did you mean '--run-dir'?"),
    ("--nproc-per-node", "No such option '--nproc-per-node'."),
])
def test_an_unknown_option_is_no_such_option_and_creates_nothing(tmp_path: Path, option: str,
                                                                 said: str) -> None:
    """It used to become the program to run ("cannot run '--watch'"), after the run dir was
    made."""
    run_dir = tmp_path / "r"
    args = ["record", option, "--run-dir", str(run_dir), "--", sys.executable, "-c", "1"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == f"Error: {said}"
    assert not run_dir.exists()
    assert list(tmp_path.iterdir()) == []


def test_options_after_the_command_are_the_commands_own(tmp_path: Path) -> None:
    """Without `--` too: from the command's first word on, nothing is record's."""
    args = ["record", "--run-dir", str(tmp_path / "r"), sys.executable, "-c",
            "import sys; sys.exit(4)", "--watch"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 4, result.output
    assert "nothing was recorded" in result.stderr
