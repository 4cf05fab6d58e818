"""Shared fixtures: every scenario recorded once per test session from a real 2-rank job."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.jobs import assert_ok, run_scenarios
from tests.recordings import Recordings, shared_root

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
def recordings(tmp_path_factory: pytest.TempPathFactory) -> Recordings:
    """Run dirs recorded once per session (and across xdist workers), whoever asks first."""
    return Recordings(shared_root(tmp_path_factory))


def _record_scenarios(out: Path) -> list:
    results = run_scenarios(out, NORMAL_SCENARIOS)
    assert_ok(results)
    # The killed rank ends its job; the survivor blocks in a collective until we stop it.
    run_scenarios(out, ["killed-rank"], timeout_s=60)
    return results


@pytest.fixture(scope="session")
def scenario_runs(recordings: Recordings) -> Path:
    """A folder holding one real run dir per scenario of examples/scenarios.py."""
    return recordings.once("scenarios", _record_scenarios)[0]


# What starts a real multi-process job from a test module: tests/jobs.py's launchers.
LAUNCHERS = ("run_ranks", "start_ranks", "wait_ranks", "run_scenarios")


def starts_jobs(item: pytest.Item) -> bool:
    """Whether a test waits on a real multi-process job beyond the session's scenarios.

    A module that imports a launcher from tests/jobs.py starts jobs (its module fixtures and
    tests record their own); a test that reads a shared recording other than the scenarios may
    be the one that records it; a trainer test launches its trainer.
    """
    module = getattr(item, "module", None)
    if any(callable(getattr(module, name, None)) for name in LAUNCHERS):
        return True
    closure = getattr(item, "fixturenames", ())
    if "recordings" in closure and "scenario_runs" not in closure:
        return True
    return item.get_closest_marker("trainers") is not None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadfile`` as tests/scheduling.py refines it (the hostile corpus case by
    case, a lane for the waiting files); other ``--dist`` modes as xdist has them."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.scheduling import FilesThenCases

    return FilesThenCases(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``slow`` marker means "starts real multi-process jobs": set here for every test
    that does, so ``make quick`` (``-m "not slow"``) runs the CPU-only tests and those that
    read the session's scenario recordings, whatever each file remembered to mark."""
    for item in items:
        if item.get_closest_marker("slow") is None and starts_jobs(item):
            item.add_marker(pytest.mark.slow)
