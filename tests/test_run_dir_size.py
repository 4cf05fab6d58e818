"""Files and bytes follow what was recorded: 400 steps whole, and 120 steps with
``steps="100:110"`` (``tests/jobs_scripts/long_run.py``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from fsdptrace.reading.reader import read_rank
from fsdptrace.store import schema
from tests.recordings import Recordings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(recordings: Recordings) -> Path:
    """``long_run.py``'s whole and windowed run dirs, from the session's catalogue."""
    return recordings.catalogue("long_run")


def _bytes(run_dir: Path, rank: int) -> int:
    return sum(p.stat().st_size for p in run_dir.glob(f"*/rank={rank}/*") if p.is_file())


@pytest.mark.parametrize("name", ["whole", "window"])
def test_one_file_per_table_per_rank_and_every_table_reads(runs: Path, name: str) -> None:
    run_dir = runs / name
    for table in schema.TABLES:
        for rank in (0, 1):
            assert len(list((run_dir / table / f"rank={rank}").glob("part-*.parquet"))) == 1
        frame = pd.read_parquet(run_dir / table)  # hive partitions, even when empty
        assert set(frame.columns) >= set(schema.TABLES[table].names)
    assert not list(run_dir.glob("journal/rank=*/*.seg"))  # close converted everything


def test_unrecorded_steps_cost_almost_nothing(runs: Path) -> None:
    for rank in (0, 1):
        whole, window = _bytes(runs / "whole", rank), _bytes(runs / "window", rank)
        assert window * 3 < whole, (window, whole)
        steps = set(read_rank(runs / "window", "markers", rank).column("step").to_pylist())
        assert steps <= set(range(100, 111)) | {120}, sorted(steps)  # 120: its close
        events = read_rank(runs / "whole", "events", rank)
        assert set(events.column("step").to_pylist()) == set(range(400))
