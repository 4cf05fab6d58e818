"""HF accelerate driving FSDP2 through its plugin, 2 gloo ranks, on its real code.

Recorded the way its users launch it: ``fsdptrace record -- accelerate launch ...``. Found by
experiment (accelerate 1.16.0, torch 2.13.0):

- on CPU accelerate ignores its FSDP plugin (``MULTI_CPU``: ``prepare`` wraps the model in
  DDP); the job sets the two fields it would set on GPU (``trainer_accelerate.py`` says why)
  and ``prepare`` then shards each ``Block`` and the root (``FSDPNet``);
- ``accelerate launch --multi_gpu`` on a host without GPUs starts 2 processes that each think
  they run alone unless the script asks ``Accelerator(cpu=True)``;
- with ``gradient_accumulation_steps=2``, ``AcceleratedOptimizer.step()`` runs on every batch
  but steps the real optimizer only on the second: boundaries are at the real optimizer's step
  (3 steps of 2 micro-steps for 6 batches);
- the no-grad evaluation batch after the second step is recorded as eval in interval 2;
- ``attach(model, optimizer=<AcceleratedOptimizer>)`` crashed every rank before (it has no
  step-hook table: ``AttributeError: ... '_optimizer_step_pre_hooks'``); now the torch
  optimizer inside it is hooked;
- a wrong prefetch and a crashed rank in one job: the prefetch is found in the 2 steps both
  ranks completed, and rank 1, raising on its first batch after the evaluation, is placed
  there (eval interval 2) and named the likely culprit.

Each job is recorded once per module and shared by the tests that read it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fsdptrace
from fsdptrace.reading import endings
from tests.jobs_scripts.trainer_launch import (
    BIN,
    SCRIPTS,
    assert_clean_endings,
    launch,
    rank_endings,
    steps_and_micro_steps,
)

pytestmark = [pytest.mark.slow, pytest.mark.trainers]
pytest.importorskip("accelerate", reason="the trainers extra is not installed")

UNITS = {"<root>", "layers.0", "layers.1", "layers.2"}
STEPS = [(s, 2) for s in range(3)]


def _launch(out: Path, case: str, *, zero_code: bool = True, fails: bool = False) -> Path:
    command = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               str(SCRIPTS / "trainer_accelerate.py"), case, "--out", str(out)]
    return launch(out, command, zero_code=zero_code, fails=fails)


def _results(out: Path) -> list[dict]:
    return [json.loads((out / f"result.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``layers.2`` wired after ``prepare`` to forward-prefetch ``layers.0`` (which ran first),
    and rank 1 raising on its batch of step 2."""
    return _launch(tmp_path_factory.mktemp("accelerate_faulty"), "bad_prefetch+crash",
                   fails=True)


def test_clean_loop_with_accumulation_and_eval(tmp_path: Path) -> None:
    run_dir = _launch(tmp_path, "clean")
    for result in _results(tmp_path):
        assert result["model_type"] == "FSDPNet" and result["num_steps"] == 3
    assert steps_and_micro_steps(run_dir, UNITS) == {0: STEPS, 1: STEPS}
    evals = fsdptrace.load(run_dir).eval_forwards
    for rank in (0, 1):
        mine = evals[evals["rank"] == rank]
        assert set(mine["step"]) == {2} and sorted(mine["unit"]) == sorted(UNITS)
    assert_clean_endings(run_dir)
    found = fsdptrace.analyze(run_dir).findings
    assert found.empty, found[["check", "rank", "message"]]


def test_wrong_prefetch_is_found(faulty_run: Path) -> None:
    """In every micro-step of the steps both ranks completed, with the unused gathers it caused
    (wasted-prefetch) reported as the same cause."""
    found = fsdptrace.analyze(faulty_run).findings
    for check in ("prefetch-order", "wasted-prefetch"):
        rows = found[found["check"] == check]
        assert set(zip(rows["unit"], rows["target"], strict=True)) == {("layers.2", "layers.0")}
        assert sorted(set(zip(rows["step"], rows["micro_step"], strict=True))) == [
            (s, m) for s in range(2) for m in range(2)]
        assert set(rows["rank"]) == {0, 1}
    assert set(found["check"]) == {"prefetch-order", "wasted-prefetch", "stalled-rank"}


def test_rank_that_aborts_is_named(faulty_run: Path) -> None:
    """Rank 1 raises on its batch of step 2; rank 0 crashes in its next all-gather ("Connection
    closed by peer"), as measured, unless torchrun's agent stops it first (SIGTERM)."""
    ends = rank_endings(faulty_run)
    assert ends[1] == (endings.CRASHED, "RuntimeError: planted bad batch on rank 1")
    # Measured: the crash. torchrun's agent SIGTERMs rank 0 too; on a loaded machine that can
    # come first, when rank 0 is between collectives.
    assert (ends[0][0] == endings.CRASHED and "Connection closed by peer" in ends[0][1]
            ) or ends[0] == (endings.TERMINATED, "SIGTERM"), ends[0]
    found = fsdptrace.analyze(faulty_run).findings
    stalled = found[found["check"] == "stalled-rank"].set_index("rank")
    # It never ran a unit of step 2: its exact stop (CHECKS.md v3) is its last eval forward,
    # in the eval interval after step 1's boundary.
    assert stalled.loc[1, "step"] == 2 and stalled.loc[0, "step"] >= 1
    assert "crashed (RuntimeError: planted bad batch on rank 1)" in stalled.loc[1, "message"]
    assert "of eval interval 2 (after optimizer step 1)" in stalled.loc[1, "message"]
    assert "it is furthest behind (likely culprit" in stalled.loc[1, "message"]


def test_attach_with_the_accelerated_optimizer(tmp_path: Path) -> None:
    """The one-liner with the optimizer ``prepare`` returned: the job trains and records."""
    run_dir = _launch(tmp_path, "attach", zero_code=False)
    for result in _results(tmp_path):
        assert result["optimizer_type"] == "AcceleratedOptimizer" and result["num_steps"] == 3
    assert steps_and_micro_steps(run_dir, UNITS) == {0: STEPS, 1: STEPS}
    assert_clean_endings(run_dir)
    assert fsdptrace.analyze(run_dir).findings.empty
