"""Lightning (``ModelParallelStrategy``, FSDP2 on CPU/gloo as shipped), 2 ranks, on its real code.

Recorded the way its users launch it: ``fsdptrace record -- python train.py``; Lightning starts
rank 1 itself. Found by experiment (lightning 2.6.6, torch 2.13.0):

- automatic optimization runs every training forward and backward inside
  ``optimizer.step(closure)``; with ``accumulate_grad_batches=2`` the first batch of each pair
  runs its closure outside any step and the second inside ``step(closure)``. With the boundary
  at the step's pre-hook (before this fix) a clean fit ended "closed the recorder mid-step" on
  both ranks with a pending-all-gather error; with it at the closure's return it is clean;
- ``ModelParallelStrategy()``'s "auto" sizes give a (data_parallel=1, tensor_parallel=2) mesh
  on one node: FSDP over a single rank, no collective between ranks, each rank sees all the
  data. The job sets ``data_parallel_size=2``; each rank then gets 6 of the 12 batches;
- validation forwards run under ``torch.no_grad`` after the last optimizer step;
- uneven validation (``use_distributed_sampler=False``, rank 0 holding one batch more: 3 against
  2): rank 1 finishes the fit and closes cleanly; rank 0's extra batch enters ``<root>`` and
  ``layers.0`` (whose gather the planted prefetch below had already done in the batch before)
  and waits in ``layers.1``'s all-gather until rank 1's exit closes the connection ("Connection
  closed by peer"); the command exits 1.

Each job is recorded once per module and shared by the tests that read it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import fsdptrace
from fsdptrace.reading import endings
from tests.jobs_scripts.trainer_launch import (
    SCRIPTS,
    assert_clean_endings,
    launch,
    rank_endings,
    steps_and_micro_steps,
)

pytestmark = [pytest.mark.slow, pytest.mark.trainers]
pytest.importorskip("lightning", reason="the trainers extra is not installed")

UNITS = {"<root>", "layers.0", "layers.1", "layers.2"}
NUM_BATCHES, NUM_VAL_BATCHES = 6, 2
ACCUMULATED = [(s, 2) for s in range(NUM_BATCHES // 2)]


def _launch(out: Path, case: str, *args: str, zero_code: bool = True, fails: bool = False
            ) -> Path:
    """``python trainer_lightning.py CASE``: Lightning starts rank 1 itself."""
    command = [sys.executable, str(SCRIPTS / "trainer_lightning.py"), case, "--out", str(out),
               *args]
    return launch(out, command, zero_code=zero_code, fails=fails)


def _steps_and_micro_steps(run_dir: Path) -> dict[int, list[tuple[int, int]]]:
    return steps_and_micro_steps(run_dir, UNITS)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory.mktemp("lightning_clean"), "clean")


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``accumulate_grad_batches=2``, a wrong prefetch wired from a callback, and uneven
    validation batches (rank 0 has one more)."""
    return _launch(tmp_path_factory.mktemp("lightning_faulty"), "bad_prefetch", "--accumulate",
                   "2", "--uneven-val", fails=True)


def test_clean_fit_with_validation(clean_run: Path) -> None:
    """One step per batch, one micro-step each, validation recorded as eval after the last
    boundary (2 batches x 4 units per rank), and no finding at all."""
    assert _steps_and_micro_steps(clean_run) == {r: [(s, 1) for s in range(NUM_BATCHES)]
                                                 for r in (0, 1)}
    evals = fsdptrace.load(clean_run).eval_forwards
    for rank in (0, 1):
        mine = evals[evals["rank"] == rank]
        assert set(mine["step"]) == {NUM_BATCHES}
        assert mine["unit"].value_counts().to_dict() == {u: NUM_VAL_BATCHES for u in UNITS}
    assert_clean_endings(clean_run)
    found = fsdptrace.analyze(clean_run).findings
    assert found.empty, found[["check", "rank", "message"]]


def test_wrong_prefetch_from_a_callback_with_accumulation(faulty_run: Path) -> None:
    """``accumulate_grad_batches=2``: 3 steps of 2 micro-steps; the prefetch a callback wired
    (``layers.2`` -> ``layers.0``, which ran first) is found in every step, the last included,
    with the unused gathers it caused reported as the same cause."""
    assert _steps_and_micro_steps(faulty_run) == {r: ACCUMULATED for r in (0, 1)}
    found = fsdptrace.analyze(faulty_run).findings
    for check in ("prefetch-order", "wasted-prefetch"):
        rows = found[found["check"] == check]
        assert set(zip(rows["unit"], rows["target"], strict=True)) == {("layers.2", "layers.0")}
        assert sorted(set(zip(rows["step"], rows["micro_step"], strict=True))) == [
            (s, m) for s, n in ACCUMULATED for m in range(n)]
    assert set(found["check"]) == {"prefetch-order", "wasted-prefetch", "stalled-rank"}


def test_uneven_validation_names_the_rank_with_the_extra_batch(faulty_run: Path) -> None:
    """Rank 1 validated 2 batches and closed cleanly; rank 0 ran a third and stopped in it. The
    stalled-rank verdict places rank 0 exactly (eval interval 3, after step 2, in ``layers.1``)
    and names the eval divergence as the root cause: rank 0 ran ``<root>`` where rank 1 ended."""
    ends = rank_endings(faulty_run)
    assert ends[1][0] == endings.CLEAN
    assert ends[0][0] == endings.CRASHED and "Connection closed by peer" in ends[0][1]
    evals = fsdptrace.load(faulty_run).eval_forwards
    per_rank = evals.groupby("rank")["unit"].size().to_dict()
    assert per_rank == {0: 2 * len(UNITS) + 3, 1: 2 * len(UNITS)}
    found = fsdptrace.analyze(faulty_run).findings
    stalled = found[found["check"] == "stalled-rank"]
    assert list(stalled["rank"]) == [0]
    message = stalled.iloc[0]["message"]
    assert (stalled.iloc[0]["step"], stalled.iloc[0]["unit"]) == (NUM_BATCHES // 2, "layers.1")
    assert "stopped at eval forward 10 of eval interval 3 (after optimizer step 2)" in message
    assert "root cause: the ranks diverged before the stop" in message
    assert "first inside the stopped eval interval" in message
    assert "rank 0 ran <root> at index 8 where rank 1" in message and "ran <end>" in message


def test_attach_with_the_lightning_optimizer(tmp_path: Path) -> None:
    """``attach(module, optimizer=module.optimizers())`` gets a ``LightningOptimizer`` (no step
    hooks of its own): the job trains, and boundaries come from the SGD inside it."""
    run_dir = _launch(tmp_path, "attach", "--accumulate", "2", zero_code=False)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result.rank{rank}.json").read_text())
        assert result["optimizer_type"] == "LightningSGD"
    assert _steps_and_micro_steps(run_dir) == {r: ACCUMULATED for r in (0, 1)}
    assert_clean_endings(run_dir)
    assert fsdptrace.analyze(run_dir).findings.empty
