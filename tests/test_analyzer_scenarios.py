"""Every check on real recordings: each planted problem found exactly where it is, nothing else.

The run dirs come from ``examples/scenarios.py`` on 2 real FSDP2 ranks (CPU, gloo), recorded
once per session by the ``scenario_runs`` fixture.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import fsdptrace
from tests.expectations import EXPECTATIONS, problems

CLEAN = ["clean", "clean-checkpoint-accumulation", "clean-reentrant-checkpoint"]


@pytest.mark.parametrize("name", sorted(EXPECTATIONS))
def test_scenario_gives_exactly_its_planted_findings(scenario_runs: Path, name: str) -> None:
    """Expectations per scenario live in tests/expectations.py, shared with the samples."""
    wrong = problems(name, fsdptrace.analyze(scenario_runs / name).findings)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", CLEAN)
def test_clean_runs_have_no_findings(scenario_runs: Path, name: str) -> None:
    findings = fsdptrace.analyze(scenario_runs / name).findings
    assert findings.empty, findings.to_string()
    assert list(findings.columns) == ["check", "severity", "rank", "step", "micro_step", "phase",
                                      "unit", "target", "message", "position", "target_position",
                                      "bytes", "held_ms", "call_index", "parameters"]


def test_findings_sorted_errors_first(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "order-instability").findings
    severities = list(findings["severity"])
    assert severities == sorted(severities, key=["error", "warning"].index)


def test_trace_and_run_dir_give_the_same_findings(scenario_runs: Path) -> None:
    for name in ("rank-divergence", "config-divergence", "killed-rank", "bypassed-child"):
        from_dir = fsdptrace.analyze(scenario_runs / name).findings
        from_trace = fsdptrace.analyze(fsdptrace.load(scenario_runs / name)).findings
        pd.testing.assert_frame_equal(from_dir, from_trace)


def test_parallel_map_gives_the_same_findings(scenario_runs: Path) -> None:
    run_dir = scenario_runs / "rank-divergence"
    pd.testing.assert_frame_equal(fsdptrace.analyze(run_dir).findings,
                                  fsdptrace.analyze(run_dir, jobs=2).findings)


def test_only_selected_checks_run(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "order-instability",
                                 checks=["order-instability"]).findings
    assert set(findings["check"]) == {"order-instability"}
    with pytest.raises(ValueError, match="unknown check"):
        fsdptrace.analyze(scenario_runs / "clean", checks=["no-such-check"])
