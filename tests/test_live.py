"""Live raising on real 2-rank FSDP2 (gloo): stops the optimizer on each planted problem.

One launch of ``tests/jobs_scripts/live_cases.py`` runs every case (a process group start
costs seconds on this machine) and reports what it saw as JSON; each test judges one thing:
the exception, that no parameter moved, the findings on disk, silence on clean runs, and the
trainer helpers of ``fsdptrace.record.policies``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import fsdptrace
from fsdptrace.store import schema
from tests.jobs import assert_ok, run_ranks
from tests.jobs_scripts.live_cases import CLEAN, POLICY_MICRO_STEPS, RAISING
from tests.jobs_scripts.tables import read_table

pytestmark = pytest.mark.slow

SCRIPT = "tests/jobs_scripts/live_cases.py"
# Per planted problem: the check that must fire, and fragments its message line must hold.
EXPECTED = {
    "wrong-forward-prefetch": ("prefetch-order", "layers.2 prefetched layers.1 at positions 3->2"),
    "wrong-backward-prefetch": ("prefetch-order",
                                "layers.1 prefetched layers.2 at positions 3->2"),
    "missing-target": ("prefetch-order", "layers.3 prefetched adapter, but adapter did not"),
    "bypassed-child": ("bypassed-unit", "adapter did not run forward"),
    "pending-all-gather": ("pending-all-gather", "layers.1: param_group group[0]"),
}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("live")
    results = run_ranks([SCRIPT, "--out", str(out)], timeout_s=300)
    assert_ok(results)
    line = next(x for x in results[0].output.splitlines() if x.startswith("RESULTS "))
    return out, json.loads(line.removeprefix("RESULTS "))


def test_every_planted_problem_is_covered() -> None:
    assert set(EXPECTED) == set(RAISING)


@pytest.mark.parametrize("case", RAISING)
def test_raises_lifecycle_error_naming_the_problem(job: tuple[Path, dict], case: str) -> None:
    _, results = job
    raised = results[case]["raised"]
    assert raised is not None, f"{case} did not raise"
    assert raised["is_lifecycle_error"] and raised["type"] == "LifecycleError"
    message = raised["message"]
    check, fragment = EXPECTED[case]
    assert "before optimizer step 0; the optimizer was not executed." in message
    assert "How to fix:" in message
    # The only section is the planted problem's check, and its lines name the problem.
    sections = [line.split(" (")[0] for line in message.splitlines()
                if line and not line.startswith(("  - ", "fsdptrace:", "How", "These"))]
    assert sections == [check]
    assert any(fragment in line for line in message.splitlines() if line.startswith("  - "))


@pytest.mark.parametrize("case", RAISING)
def test_optimizer_did_not_update_anything(job: tuple[Path, dict], case: str) -> None:
    _, results = job
    assert results[case]["steps_done"] == 0
    assert results[case]["changed_by_last_step"] == []
    assert results[case]["optimizer_state_size"] == 0  # AdamW never created its state


@pytest.mark.parametrize("case", RAISING)
def test_findings_are_on_disk_and_match_the_analysis(job: tuple[Path, dict], case: str
                                                      ) -> None:
    out, results = job
    on_disk = read_table(out / case, "findings")
    check, fragment = EXPECTED[case]
    assert set(on_disk["rank"]) == {0, 1}
    assert set(on_disk["check"]) == {check}
    assert set(on_disk["step"]) == {0}
    assert all(fragment in m or check == "pending-all-gather" for m in on_disk["message"])
    # Every message of rank 0 appears in the exception, and the post-mortem finds the same.
    rank0 = on_disk[on_disk["rank"] == 0]
    assert all(m in results[case]["raised"]["message"] for m in rank0["message"])
    offline = fsdptrace.analyze(out / case).findings
    errors = offline[offline["severity"] == "error"]
    # Offline messages may add all-gather provenance ("issued by ..."), a table the live
    # path does not hold; the findings themselves must be the same rows.
    assert _keys(errors) == _keys(on_disk)


def _keys(frame: Any) -> list[tuple]:
    columns = ["check", "rank", "step", "micro_step", "phase", "unit", "target"]
    return sorted(tuple(str(v) for v in row) for row in
                  frame[columns].astype(object).where(frame[columns].notna(), None)
                  .itertuples(index=False))


@pytest.mark.parametrize("case", CLEAN)
def test_clean_runs_never_raise(job: tuple[Path, dict], case: str) -> None:
    """Includes non-reentrant and reentrant checkpointing, and no-sync accumulation."""
    out, results = job
    assert results[case]["raised"] is None
    assert results[case]["steps_done"] == 3
    assert results[case]["changed_by_last_step"]  # the optimizer really ran
    assert pd.read_parquet(out / case / "findings").empty  # present from the start, empty


def test_policies_set_fsdp_per_micro_step(job: tuple[Path, dict]) -> None:
    """Sync, last backward and resharding on only in the last micro-step of each step."""
    _, results = job
    assert results["policies"].get("raised") is None
    last = POLICY_MICRO_STEPS - 1
    expected = [{"reduce_grads": m == last, "reshard_after_backward": m == last,
                 "is_last_backward": m == last} for m in range(POLICY_MICRO_STEPS)] * 2
    assert results["policies"]["observed"] == expected


def test_policies_record_what_they_set(job: tuple[Path, dict]) -> None:
    out, _ = job
    markers = read_table(out / "policies", "markers")
    for rank in (0, 1):
        notes = markers[(markers["rank"] == rank)
                        & (markers["kind"] == schema.MARKER_GRAD_SYNC)]
        sync = [d for d in notes["detail"] if "requires_gradient_sync" in d]
        reshard = [d for d in notes["detail"] if "reshard_after_backward" in d]
        per_step_sync = [
            f"micro_step={m} requires_gradient_sync={m == 2} is_last_backward={m == 2}"
            for m in range(POLICY_MICRO_STEPS)]
        assert sync == per_step_sync * 2
        assert reshard == ["micro_step=0 reshard_after_backward=False",
                           "micro_step=2 reshard_after_backward=True"] * 2
        assert list(notes["step"]) == [0] * 5 + [1] * 5
