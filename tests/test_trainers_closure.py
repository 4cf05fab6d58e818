"""The optimizer boundary of closure steps (CHECKS.md v3) on real FSDP2, 2 gloo ranks.

``optimizer.step(closure)`` runs the forward and backward inside the step; the boundary is
when the closure returns, right before the update. Found by experiment (torch 2.13): step
pre-hooks get ``args == (optimizer, closure)`` or ``kwargs == {"closure": ...}`` and may return
new arguments; ``LBFGS(max_iter=3)`` calls its closure three times per ``step()`` with an
update after each (9 calls for 3 steps here), ``max_iter=1`` once. Before this boundary the
recorder took it at the pre-hook: the last closure's micro-step stayed open ("closed the
recorder mid-step") and each forward landed one step late.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import fsdptrace
from fsdptrace.reading import endings
from tests.jobs import assert_ok, run_ranks

pytestmark = pytest.mark.slow

SCRIPT = "tests/jobs_scripts/trainer_closure.py"
UNITS = {"<root>", "layers.0", "layers.1", "layers.2"}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("closure")
    results = run_ranks([SCRIPT, "--out", str(out)], timeout_s=300)
    assert_ok(results)
    line = next(x for x in results[0].output.splitlines() if x.startswith("RESULTS "))
    return out, json.loads(line.removeprefix("RESULTS "))


@pytest.mark.parametrize("case", ["lbfgs", "lbfgs_inner"])
def test_each_closure_return_is_one_boundary(job: tuple[Path, dict], case: str) -> None:
    """One optimizer step per closure evaluation (each is followed by an update), one
    micro-step in each, every unit's forward and backward in it, and a clean close."""
    out, results = job
    calls = results[case]["closure_calls"]
    assert calls == (3 if case == "lbfgs" else 9)
    assert results[case]["recorder_steps"] == calls
    trace = fsdptrace.load(out / case)
    assert trace.steps == list(range(calls))
    events = trace.events
    for (rank, step), rows in events.groupby(["rank", "step"]):
        assert set(rows["micro_step"]) == {0}, (rank, step)
        for phase in ("forward", "backward"):
            assert set(rows.loc[rows["phase"] == phase, "unit"]) == UNITS, (rank, step, phase)
    ends = endings.rank_endings(trace.markers, [0, 1])
    assert list(ends["ending"]) == [endings.CLEAN, endings.CLEAN]
    assert fsdptrace.analyze(out / case).findings.empty


def test_eval_after_a_closure_step_is_in_the_next_interval(job: tuple[Path, dict]) -> None:
    """The no-grad forward after ``step(closure)`` i comes after boundary i: interval i+1."""
    out, _ = job
    evals = fsdptrace.load(out / "lbfgs").eval_forwards
    for rank in (0, 1):
        mine = evals[evals["rank"] == rank]
        assert sorted(set(mine["step"])) == [1, 2, 3]
        assert mine.groupby("step")["unit"].apply(set).tolist() == [UNITS] * 3


def test_live_raising_in_a_closure_step_stops_before_the_update(job: tuple[Path, dict]) -> None:
    """A pending all-gather left by the closure: raised after it returned, nothing updated."""
    out, results = job
    result = results["closure_pending"]
    assert result["closure_calls"] == 1
    assert result["raised"] == ("fsdptrace: unsafe FSDP lifecycle on rank 0 before optimizer "
                                "step 0; the optimizer was not executed.")
    assert result["changed"] is False
    found = fsdptrace.analyze(out / "closure_pending").findings
    assert set(found["check"]) == {"pending-all-gather"}, found[["check", "message"]]
    assert set(found["unit"]) == {"layers.1"}
