"""The benchmarks' synthetic run dirs, for tests: ``benchmarks/`` is scripts, not a package."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import generate_run  # noqa: E402

TINY = generate_run.Shape(ranks=6, steps=6, micro_steps=2, units=6, stages=2)
WHERE = ["check", "rank", "step", "micro_step", "phase", "unit", "target"]


def generate_tiny(run_dir: Path, shape: generate_run.Shape = TINY) -> set[tuple]:
    """A tiny synthetic run dir with every planted problem; returns the expected findings."""
    return generate_run.generate(run_dir, shape)


def where(findings: pd.DataFrame) -> set[tuple]:
    """Findings as (check, rank, step, micro_step, phase, unit, target), NA as None."""
    return {tuple(None if pd.isna(v) else v for v in row)
            for row in findings[WHERE].itertuples(index=False, name=None)}
