"""Every check on real recordings: each planted problem found exactly where it is, nothing else.

The run dirs come from ``examples/scenarios.py`` on 2 real FSDP2 ranks (CPU, gloo), recorded
once per session by the ``scenario_runs`` fixture.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import fsdptrace

CLEAN = ["clean", "clean-checkpoint-accumulation", "clean-reentrant-checkpoint"]
STEPS = {0, 1, 2}


def where(findings: pd.DataFrame) -> set[tuple]:
    cols = ["check", "rank", "step", "micro_step", "phase", "unit", "target"]
    return {tuple(None if pd.isna(v) else v for v in row) for row in findings[cols].itertuples(
        index=False, name=None)}


@pytest.mark.parametrize("name", CLEAN)
def test_clean_runs_have_no_findings(scenario_runs: Path, name: str) -> None:
    findings = fsdptrace.analyze(scenario_runs / name)
    assert findings.empty, findings.to_string()
    assert list(findings.columns) == ["check", "severity", "rank", "step", "micro_step", "phase",
                                      "unit", "target", "message"]


def test_wrong_forward_prefetch(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "wrong-forward-prefetch")
    expected = {("prefetch-order", r, s, m, "forward", "layers.2", "layers.1")
                for r in (0, 1) for s in STEPS for m in (0, 1)}
    assert where(findings) == expected
    assert "positions 3->2" in findings["message"].iloc[0]


def test_wrong_backward_prefetch(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "wrong-backward-prefetch")
    expected = {("prefetch-order", r, s, m, "backward", "layers.1", "layers.2")
                for r in (0, 1) for s in STEPS for m in (0, 1)}
    assert where(findings) == expected


def test_target_that_never_runs(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "missing-target")
    expected = {("prefetch-order", r, s, m, "forward", "layers.3", "adapter")
                for r in (0, 1) for s in STEPS for m in (0, 1)}
    assert where(findings) == expected
    assert findings["message"].str.contains("did not execute").all()


def test_bypassed_child(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "bypassed-child")
    assert where(findings) == {("bypassed-unit", r, s, 1, None, "adapter", None)
                               for r in (0, 1) for s in STEPS}
    assert findings["message"].str.contains("adapter.fc1.weight").all()


def test_rank_dependent_order(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "rank-divergence")
    forward = {("rank-divergence", 1, s, m, "forward", "layers.2", "layers.1")
               for s in STEPS for m in (0, 1)}
    backward = {("rank-divergence", 1, s, m, "backward", "layers.1", "layers.2")
                for s in STEPS for m in (0, 1)}
    assert where(findings) == forward | backward


def test_prefetch_configured_differently_per_rank(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "config-divergence")
    assert where(findings) == {("prefetch-config-divergence", 1, 0, 0, None, None, None)}
    assert "layers.0 forward -> [layers.2] (rank 0: [layers.1])" in findings["message"].iloc[0]


def test_pending_all_gather_at_the_boundary(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "pending-all-gather")
    assert {(c, r, s, u) for c, r, s, _, _, u, _ in where(findings)} == {
        ("pending-all-gather", r, s, "layers.1") for r in (0, 1) for s in STEPS}


def test_order_instability(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "order-instability")
    warnings = findings[findings["check"] == "order-instability"]
    assert where(warnings) == {("order-instability", r, 1, m, "forward", "layers.2", "layers.1")
                               for r in (0, 1) for m in (0, 1)}
    assert set(findings["check"]) == {"order-instability", "prefetch-order"}
    assert set(findings.loc[findings["check"] == "prefetch-order", "step"]) == {1}


def test_killed_rank_is_reported_where_it_stopped(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "killed-rank")
    stalled = findings[findings["check"] == "stalled-rank"]
    killed = stalled[stalled["rank"] == 1].iloc[0]
    assert (killed["step"], killed["micro_step"], killed["phase"], killed["unit"]) == (
        2, 0, "forward", "layers.3")
    assert "furthest behind" in killed["message"]
    # The cut-off micro-step is not a prefetch finding.
    assert set(findings["check"]) == {"stalled-rank"}


def test_findings_sorted_errors_first(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "order-instability")
    severities = list(findings["severity"])
    assert severities == sorted(severities, key=["error", "warning"].index)


def test_trace_and_run_dir_give_the_same_findings(scenario_runs: Path) -> None:
    for name in ("rank-divergence", "config-divergence", "killed-rank", "bypassed-child"):
        from_dir = fsdptrace.analyze(scenario_runs / name)
        from_trace = fsdptrace.analyze(fsdptrace.load(scenario_runs / name))
        pd.testing.assert_frame_equal(from_dir, from_trace)


def test_parallel_map_gives_the_same_findings(scenario_runs: Path) -> None:
    run_dir = scenario_runs / "rank-divergence"
    pd.testing.assert_frame_equal(fsdptrace.analyze(run_dir),
                                  fsdptrace.analyze(run_dir, jobs=2))


def test_only_selected_checks_run(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "order-instability",
                                 checks=["order-instability"])
    assert set(findings["check"]) == {"order-instability"}
    with pytest.raises(ValueError, match="unknown check"):
        fsdptrace.analyze(scenario_runs / "clean", checks=["no-such-check"])
