"""The shipped ``sample_traces/`` still read and still give exactly their planted findings.

They are what a newcomer opens first (README, notebook), so a schema or analyzer change that
breaks them must fail here; ``make samples`` regenerates them. No job is launched.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import fsdptrace
from tests.expectations import SAMPLE_STEPS, SAMPLES, problems

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "sample_traces"


def test_every_sample_is_shipped_and_listed() -> None:
    shipped = {path.name for path in SAMPLES_DIR.iterdir() if path.is_dir()}
    assert shipped == set(SAMPLES)
    readme = (SAMPLES_DIR / "README.md").read_text()
    assert [name for name in SAMPLES if f"`{name}`" not in readme] == []


@pytest.mark.parametrize("name", SAMPLES)
def test_sample_gives_exactly_its_planted_findings(name: str) -> None:
    wrong = problems(name, fsdptrace.analyze(SAMPLES_DIR / name).findings, steps=SAMPLE_STEPS)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", SAMPLES)
def test_sample_holds_both_ranks_and_every_step(name: str) -> None:
    """A sample cut short by a bad regeneration would pass a check that finds nothing."""
    trace = fsdptrace.load(SAMPLES_DIR / name)
    assert trace.ranks == [0, 1]
    assert trace.steps == list(range(SAMPLE_STEPS))


def test_samples_are_tiny() -> None:
    """They live in git: a recorder change that bloats them should be a decision."""
    size = sum(path.stat().st_size for path in SAMPLES_DIR.rglob("*") if path.is_file())
    assert size < 1_000_000, f"sample_traces/ holds {size:,} bytes"
