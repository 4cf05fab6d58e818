"""Recordings made once per test session, whoever asks first, shared by every test that reads them.

The problem this solves: a real 2-rank FSDP2 job costs 10-25 s on 2 cores, and several test
files recorded the same job (the four ``divergence_job.py`` scenarios were launched twice a
session, ``uneven_eval`` three times). Here each recording has one name and one folder; the
first test that asks records it and the others read it.

Also under ``pytest -n`` (pytest-xdist): the folder is the session's shared temp root, not a
worker's, and a file lock makes one worker record while the others wait, so a session fixture
is not recorded once per worker. What a job's ranks printed and returned is kept beside the run
dir (``NAME.done.json``), so a test that asserts on the ranks' exit codes, or on what a command
printed, still can.

Tests must only read a shared recording: one that changes a run dir copies it first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from tests.jobs import REPO, RankResult, assert_ok, run_ranks

JOBS = REPO / "tests" / "jobs_scripts"
# The catalogue: the normal-ending cases of the batched job scripts, recorded by one launch of
# ``catalogue.py`` for the whole session. Each test file names its cases here, by script.
CATALOGUE: dict[str, list[str]] = {
    "check_cases": ["skipped_unit", "bypass_kept_buffers", "accumulate_unsharded",
                    "reshard_after_backward_left_off", "dead_edge", "eval_before_step",
                    "even_eval", "same_sync", "skipped_unit_live", "bypass_kept_buffers_live"],
    "provenance_cases": ["clean-chained", "embed-twice", "redundant-prefetch", "manual-unshard",
                         "direct-group-unshard",
                         *(f"wrapped-{level}-{when}" for level in ("class", "instance", "prefetch")
                           for when in ("before", "after"))],
    "recorder_cases": ["clean", "clean-checkpoint-accumulation", "clean-reentrant-checkpoint",
                       "pending-all-gather", "two-parts", "grouped", "forward-method",
                       "no-sync-boundary", "pending-unshard", "pending-async-unshard",
                       "step-window", "healthy-backend", "failing-gradients", "failing-hook"],
    "reused_block_cases": ["mid-prefetches-shared", "late-prefetches-shared"],
    "ledger_job": ["default", "keep"],
    "long_run": [],  # its two run dirs, whole and windowed
    "diff_variants": [],  # all its variants
}
# The scripts' own deadlines were 150 + 300 + 180 + 300 + 2 x 120 + 240 + 120 s.
CATALOGUE_TIMEOUT_S = 1500.0
# A job that must die or hang ends by itself or by this deadline; no scenario takes longer.
DIVERGENCE_TIMEOUT_S = 240.0


def shared_root(factory: pytest.TempPathFactory) -> Path:
    """The session's folder for shared recordings, the same for every xdist worker."""
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # each worker's basetemp is <session root>/popen-gwN
    root = base / "recordings"
    root.mkdir(exist_ok=True)
    return root


class Recordings:
    """Named recordings under one folder, each made once by ``once``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def once(self, name: str, record: Callable[[Path], list[RankResult]]
             ) -> tuple[Path, list[RankResult]]:
        """The run dir ``name`` and its ranks' results, recording it with ``record(run_dir)``
        the first time it is asked for in this session (by any worker)."""
        kept = self._made_once(name, lambda run_dir: [asdict(r) for r in record(run_dir)])
        return self.root / name, [RankResult(**r) for r in kept]

    def demo(self) -> tuple[Path, subprocess.CompletedProcess[str]]:
        """``make demo``'s recording: ``fsdptrace record -- torchrun`` of examples/train_tiny.py
        on 2 ranks (its planted prefetch bug, one step), fresh interpreters as a newcomer's,
        and what the command printed and returned. Three test files read the same job."""
        def record(run_dir: Path) -> dict[str, object]:
            bin_dir = Path(sys.executable).parent
            done = subprocess.run(
                [str(bin_dir / "fsdptrace"), "record", "--run-dir", str(run_dir), "--",
                 str(bin_dir / "torchrun"), "--nproc-per-node", "2",
                 str(REPO / "examples" / "train_tiny.py"), "--steps", "1"],
                cwd=REPO, capture_output=True, text=True, timeout=240,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
            return {"args": done.args, "returncode": done.returncode, "stdout": done.stdout,
                    "stderr": done.stderr}

        return self.root / "demo", subprocess.CompletedProcess(**self._made_once("demo", record))

    def _made_once(self, name: str, make: Callable[[Path], Any]) -> Any:
        """``make(run_dir)``'s result (kept as JSON beside the run dir), made the first time
        ``name`` is asked for in this session; every later ask, by any worker, reads it."""
        run_dir = self.root / name
        done = self.root / f"{name}.done.json"
        failed = self.root / f"{name}.failed"
        with FileLock(str(self.root / f"{name}.lock")):
            if failed.exists():  # recorded once, badly: do not launch again into its folder
                pytest.fail(f"recording {name} failed earlier in this session:\n"
                            f"{failed.read_text()}", pytrace=False)
            if not done.exists():
                run_dir.mkdir(parents=True, exist_ok=True)
                try:
                    kept = make(run_dir)
                except BaseException as error:
                    failed.write_text(f"{type(error).__name__}: {error}"[-20000:])
                    raise
                done.write_text(json.dumps(kept))
        return json.loads(done.read_text())

    def catalogue(self, script: str) -> Path:
        """The folder of ``script``'s catalogue cases (one run dir per case): the whole
        catalogue is recorded by one launch, the first time any script's is asked for."""
        def record(out: Path) -> list[RankResult]:
            batches = [f"{name}:{','.join(cases)}" for name, cases in CATALOGUE.items()]
            results = run_ranks([str(JOBS / "catalogue.py"), "--out", str(out), *batches],
                                timeout_s=CATALOGUE_TIMEOUT_S)
            assert_ok(results)
            return results

        return self.once("catalogue", record)[0] / script

    def divergence(self, scenario: str) -> tuple[Path, list[RankResult]]:
        """A ``divergence_job.py`` scenario: jobs whose ranks diverge, some die or hang."""
        return self.once(f"divergence/{scenario}", lambda run_dir: run_ranks(
            [str(JOBS / "divergence_job.py"), "--out", str(run_dir), scenario],
            timeout_s=DIVERGENCE_TIMEOUT_S))
