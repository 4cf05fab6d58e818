"""The transformers ``Trainer`` on FSDP2 (``fsdp_config={"fsdp_version": 2}``), 2 gloo ranks, on
its real code with a tiny Llama built from its config.

Recorded the way its users launch it: ``fsdptrace record -- torchrun ... train.py``. Found by
experiment (transformers 5.24.0, accelerate 1.16.0, torch 2.13.0):

- on CPU the Trainer's accelerator ignores the FSDP plugin; ``trainer_hf.py`` sets the two fields
  accelerate sets on GPU, and the Trainer's own FSDP2 path then shards ``model.embed_tokens``,
  each ``LlamaDecoderLayer``, ``model.norm`` with ``lm_head`` (one grouped unit) and the root;
- ``gradient_accumulation_steps=2`` over 6 batches per rank: 3 steps of 2 micro-steps;
- ``eval_steps=2``: evaluation after step 2 and at the end (eval intervals 2 and 3);
- after the first evaluation, FSDP2's implicit backward prefetch (reverse post-forward order,
  which the eval forward extended) makes ``model.embed_tokens`` re-gather ``model.norm,lm_head``
  in the next backward; FSDP2 drops it unused at the end of that backward. The wasted-prefetch
  warning there is true and is the only finding of a clean run;
- a wrong prefetch and a crashed rank in one job: the prefetch is found in the 2 steps both
  ranks completed; rank 1, raising in ``on_step_begin`` of step 2 (after the evaluation), is
  placed in that evaluation (eval interval 2) and named the likely culprit.

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
pytest.importorskip("transformers", reason="the trainers extra is not installed")

UNITS = {"<root>", "model.embed_tokens", "model.layers.0", "model.layers.1",
         "model.norm,lm_head"}
STEPS = [(s, 2) for s in range(3)]


def _launch(out: Path, case: str, *, fails: bool = False) -> Path:
    command = [str(BIN / "torchrun"), "--nproc-per-node", "2",
               str(SCRIPTS / "trainer_hf.py"), case, "--out", str(out)]
    return launch(out, command, fails=fails)


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``TrainerCallback.on_train_begin`` wires ``model.layers.1`` to forward-prefetch
    ``model.layers.0`` (which ran first); another makes rank 1 raise as step 2 begins."""
    return _launch(tmp_path_factory.mktemp("hf_faulty"), "bad_prefetch+crash", fails=True)


def test_clean_training_with_evaluation(tmp_path: Path) -> None:
    run_dir = _launch(tmp_path, "clean")
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result.rank{rank}.json").read_text())
        assert result["model_type"] == "FSDPLlamaForCausalLM" and result["global_step"] == 3
    assert steps_and_micro_steps(run_dir, UNITS) == {0: STEPS, 1: STEPS}
    evals = fsdptrace.load(run_dir).eval_forwards
    for rank in (0, 1):
        mine = evals[evals["rank"] == rank]
        assert set(mine["step"]) == {2, 3} and set(mine["unit"]) == UNITS
    assert_clean_endings(run_dir)
    found = fsdptrace.analyze(run_dir).findings
    assert set(found["severity"]) == {"warning"}, found[["check", "rank", "message"]]
    post_eval = found[["check", "step", "micro_step", "phase", "unit", "target"]]
    assert post_eval.drop_duplicates().values.tolist() == [
        ["wasted-prefetch", 2, 0, "backward", "model.embed_tokens", "model.norm,lm_head"]]


def test_wrong_prefetch_from_a_callback_is_found(faulty_run: Path) -> None:
    """In every micro-step of the steps both ranks completed, with the unused gathers it caused
    (wasted-prefetch) reported as the same cause."""
    found = fsdptrace.analyze(faulty_run).findings
    for check in ("prefetch-order", "wasted-prefetch"):
        rows = found[found["check"] == check]
        assert set(zip(rows["unit"], rows["target"], strict=True)) == {
            ("model.layers.1", "model.layers.0")}
        assert sorted(set(zip(rows["step"], rows["micro_step"], strict=True))) == [
            (s, m) for s in range(2) for m in range(2)]
    assert set(found["check"]) == {"prefetch-order", "wasted-prefetch", "stalled-rank"}


def test_rank_that_aborts_is_named(faulty_run: Path) -> None:
    """Rank 1 raises in ``on_step_begin`` of step 2; rank 0 crashes in its next all-gather
    ("Connection closed by peer"), as measured, unless torchrun's agent stops it first."""
    ends = rank_endings(faulty_run)
    assert ends[1] == (endings.CRASHED, "RuntimeError: planted bad batch on rank 1")
    # Measured: the crash. torchrun's agent SIGTERMs rank 0 too; on a loaded machine that can
    # come first, when rank 0 is between collectives.
    assert (ends[0][0] == endings.CRASHED and "Connection closed by peer" in ends[0][1]
            ) or ends[0] == (endings.TERMINATED, "SIGTERM"), ends[0]
    found = fsdptrace.analyze(faulty_run).findings
    stalled = found[found["check"] == "stalled-rank"].set_index("rank")
    # It never ran a unit of step 2: its exact stop (CHECKS.md v3) is its last eval forward,
    # in the evaluation after step 1's boundary.
    assert stalled.loc[1, "step"] == 2 and stalled.loc[0, "step"] >= 1
    assert "crashed (RuntimeError: planted bad batch on rank 1)" in stalled.loc[1, "message"]
    assert "of eval interval 2 (after optimizer step 1)" in stalled.loc[1, "message"]
    assert "it is furthest behind (likely culprit" in stalled.loc[1, "message"]
