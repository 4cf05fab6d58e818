"""Shared fixtures: every scenario recorded once per test session from a real 2-rank job."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.jobs import assert_ok, run_scenarios

# Scenarios that end normally share one launch (one process-group start for all).
NORMAL_SCENARIOS = [
    "clean",
    "clean-checkpoint-accumulation",
    "clean-reentrant-checkpoint",
    "wrong-forward-prefetch",
    "wrong-backward-prefetch",
    "missing-target",
    "bypassed-child",
    "rank-divergence",
    "config-divergence",
    "pending-all-gather",
    "order-instability",
]


@pytest.fixture(scope="session")
def scenario_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding one real run dir per scenario of examples/scenarios.py."""
    out = tmp_path_factory.mktemp("scenarios")
    assert_ok(run_scenarios(out, NORMAL_SCENARIOS))
    # The killed rank ends its job; the survivor blocks in a collective until we stop it.
    run_scenarios(out, ["killed-rank"], timeout_s=30)
    return out
