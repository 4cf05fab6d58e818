"""What the trainer tests share: launching a trainer's job the way its users do, and reading
the step structure a run dir holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fsdptrace
from fsdptrace.reading import endings

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "jobs_scripts"
BIN = Path(sys.executable).parent
# The ``fsdptrace`` console script's own entry point, run by this interpreter: the same command,
# and it does not depend on the environment's scripts folder being installed.
FSDPTRACE = [sys.executable, "-m", "fsdptrace_cli.main"]
# Generous: a trainer's import alone takes 10-20 s per rank on a loaded 2-core machine.
TIMEOUT_S = 420


def launch(out: Path, command: list[str], *, zero_code: bool = True, fails: bool = False,
           env: dict[str, str] | None = None) -> Path:
    """Run ``command`` (under ``fsdptrace record`` when ``zero_code``, with ``env`` added) and
    return the run dir, ``out/run``; the job must fail exactly when ``fails``."""
    run_dir = out / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if zero_code:
        command = [*FSDPTRACE, "record", "--run-dir", str(run_dir), "--fail-on", "never",
                   "--", *command]
    else:
        env["FSDPTRACE_RUN_DIR"] = str(run_dir)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert (done.returncode != 0) == fails, done.stdout[-4000:] + done.stderr[-4000:]
    return run_dir


def steps_and_micro_steps(run_dir: Path, units: set[str]) -> dict[int, list[tuple[int, int]]]:
    """Per rank, (step, number of micro-steps) in order; every pass must hold every unit."""
    events = fsdptrace.load(run_dir).events
    found: dict[int, list[tuple[int, int]]] = {}
    for (rank, step), rows in events.groupby(["rank", "step"]):
        for (micro_step, phase), pass_rows in rows.groupby(["micro_step", "phase"]):
            assert set(pass_rows["unit"]) == units, (rank, step, micro_step, phase)
        found.setdefault(int(rank), []).append((int(step), rows["micro_step"].nunique()))
    return found


def assert_clean_endings(run_dir: Path, ranks: tuple[int, ...] = (0, 1)) -> None:
    ends = endings.rank_endings(fsdptrace.load(run_dir).markers, list(ranks))
    assert list(ends["ending"]) == [endings.CLEAN] * len(ranks), ends


def rank_endings(run_dir: Path, ranks: tuple[int, ...] = (0, 1)) -> dict[int, tuple[str, str]]:
    ends = endings.rank_endings(fsdptrace.load(run_dir).markers, list(ranks))
    return {int(r): (str(e), str(d)) for r, e, d in
            zip(ends["rank"], ends["ending"], ends["detail"], strict=True)}
