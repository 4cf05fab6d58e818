"""torchtitan (``torchtitan.train``, llama3, FSDP2) on CPU/gloo, 2 ranks, on its real code.

Recorded the way its users launch it, ``fsdptrace record -- torchrun ... --module M --config C``,
through ``trainer_torchtitan.py`` (torchtitan's own ``main`` plus the CPU shims it says why it
needs). Found by experiment (torchtitan 0.3.0, torch 2.13.0):

- torchtitan shards ``tok_embeddings``, each of ``layers.<i>``, ``norm`` with ``lm_head`` (one
  grouped unit) and the root; one micro-step per step without ``global_batch_size``;
- the recording of a clean 4-step run is clean on both ranks;
- a forward prefetch wired in ``ModelSpec.parallelize_fn`` from ``layers.1`` to ``layers.0``
  (which ran first) is found in every step the ranks completed, with the unused gathers it
  caused (wasted-prefetch, reported as the same cause);
- when rank 1 raises in its forward of step 2, torchtitan closes its trainer and re-raises;
  rank 0, waiting in that step's all-gather, crashes ("Connection closed by peer") or is
  stopped by torchrun's agent (SIGTERM).
"""

from __future__ import annotations

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
pytest.importorskip("torchtitan", reason="torchtitan is not installed (it is not in the trainers "
                    "extra: pip install torchtitan~=0.3.0 triton~=3.9.0; see pyproject.toml)")

UNITS = {"<root>", "tok_embeddings", "layers.0", "layers.1", "norm,lm_head"}
NUM_STEPS, CRASH_STEP = 4, 2


def _launch(out: Path, case: str, *, fails: bool = False) -> Path:
    command = [str(BIN / "torchrun"), "--nproc-per-node", "2",
               str(SCRIPTS / "trainer_torchtitan.py"), "--module", "__main__", "--config", case,
               "--dump_folder", str(out / "titan")]
    return launch(out, command, fails=fails, env={"TITAN_ASSETS": str(out / "assets")})


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory.mktemp("titan_clean"), "clean")


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wrong prefetch wired in ``parallelize_fn``, and rank 1 raising in step 2."""
    return _launch(tmp_path_factory.mktemp("titan_faulty"), "bad_prefetch_then_crash",
                   fails=True)


def test_clean_run(clean_run: Path) -> None:
    assert steps_and_micro_steps(clean_run, UNITS) == {
        r: [(s, 1) for s in range(NUM_STEPS)] for r in (0, 1)}
    assert fsdptrace.load(clean_run).eval_forwards.empty
    assert_clean_endings(clean_run)
    found = fsdptrace.analyze(clean_run).findings
    assert found.empty, found[["check", "rank", "message"]]


def test_wrong_prefetch_is_found_in_every_complete_step(faulty_run: Path) -> None:
    found = fsdptrace.analyze(faulty_run).findings
    order = found[found["check"] == "prefetch-order"]
    assert set(order["unit"]) == {"layers.1"} and set(order["target"]) == {"layers.0"}
    assert set(order["rank"]) == {0, 1}
    assert sorted(set(order["step"])) == list(range(CRASH_STEP))


def test_rank_that_aborts_is_named(faulty_run: Path) -> None:
    """Rank 1 crashed with its exception and is named the likely culprit; rank 0 stopped in
    step 2's forward (its first unit's all-gather) with rank 1 named from there too."""
    ends = rank_endings(faulty_run)
    assert ends[1] == (endings.CRASHED, "RuntimeError: planted bad batch on rank 1")
    assert (ends[0][0] == endings.CRASHED and "Connection closed by peer" in ends[0][1]
            ) or ends[0] == (endings.TERMINATED, "SIGTERM"), ends[0]
    found = fsdptrace.analyze(faulty_run).findings
    stalled = found[found["check"] == "stalled-rank"].set_index("rank")
    assert "crashed (RuntimeError: planted bad batch on rank 1)" in stalled.loc[1, "message"]
    assert "it is furthest behind (likely culprit" in stalled.loc[1, "message"]
    assert "rank 1 is further behind (likely culprit)" in stalled.loc[0, "message"]
    assert list(stalled.loc[[0, 1], "step"]) == [CRASH_STEP, CRASH_STEP]
    # The wrong edge's unused gathers are reported with it (one cause), nothing else.
    wasted = found[found["check"] == "wasted-prefetch"]
    assert set(zip(wasted["unit"], wasted["target"], strict=True)) == {("layers.1", "layers.0")}
    assert set(found["check"]) == {"stalled-rank", "prefetch-order", "wasted-prefetch"}
