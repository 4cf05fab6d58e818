"""A rank SIGKILLed mid-run: everything it recorded reads back, whole, from Parquet and journal.

Case ``killed`` of ``tests/jobs_scripts/recorder_cases.py``: rank 1 holds back before step 2
while rank 0 blocks in the root's all-gather, then dies of SIGKILL; rank 0 is killed while
still blocked (or fails on the vanished peer).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pandas as pd
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from fsdptrace.reading.reader import read_rank
from fsdptrace.store import journal_hot, schema
from tests.jobs import kill_all, start_ranks

# A chunk a dead rank's writer process compacted away while we read is not damage.
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("error::fsdptrace.reading.chunk_gaps.SkippedChunkWarning")]

SCRIPT = "tests/jobs_scripts/recorder_cases.py"
FORWARD = ["<root>", "layers.0", "layers.1"]
BACKWARD = ["<root>", "layers.1", "layers.0"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of the job; fails unless rank 1 really died of SIGKILL."""
    out = tmp_path_factory.mktemp("killed")
    procs = start_ranks([SCRIPT, "--out", str(out), "killed"])
    try:
        procs[1].wait(timeout=90)
        # Rank 0 sees the peer vanish (gloo error) or stays blocked; either way, stop it.
        try:
            procs[0].wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    finally:
        kill_all(procs)
    assert procs[1].returncode == -9, procs[1].stdout.read() if procs[1].stdout else ""
    return out / "killed"


def _events(run_dir: Path, rank: int) -> pd.DataFrame:
    return read_rank(run_dir, "events", rank).to_pandas()


def test_recorded_steps_read_back(killed: Path) -> None:
    """Every Parquet file reads, and the dead rank's steps 0-1 come back through the reader."""
    for path in killed.glob("*/rank=*/part-*.parquet"):
        pq.read_table(path)
    events = _events(killed, 1)
    for (step, micro, phase), group in events.groupby(["step", "micro_step", "phase"],
                                                      observed=True):
        order = FORWARD if phase == "forward" else BACKWARD
        assert list(group.sort_values("seq")["unit"].astype(str)) == order, (step, micro)
    assert {(s, m) for s, m in zip(events["step"], events["micro_step"], strict=True)} == {
        (0, 0), (0, 1), (1, 0), (1, 1)}
    assert "close" not in set(read_rank(killed, "markers", 1).to_pandas()["kind"].astype(str))


def test_hive_readers_see_every_row_once_the_writer_finished(killed: Path) -> None:
    """The journal lies outside the table folders, and a dead rank's writer process turns its
    tail into Parquet: once it is done, a hive glob reads every row the reader folds in."""
    for rank in (0, 1):
        assert journal_hot.wait_salvaged(killed / "journal" / f"rank={rank}", 30.0)
    for table in schema.TABLES:
        ds.dataset(killed / table, format="parquet", partitioning="hive").to_table()
        assert not list((killed / table).rglob("*.seg"))
    assert not list(killed.glob("journal/rank=*/*.seg"))
    hive = ds.dataset(killed / "events", format="parquet", partitioning="hive").to_table()
    for rank in (0, 1):
        plain = sorted(s for s, r in zip(hive.column("seq").to_pylist(),
                                         hive.column("rank").to_pylist(), strict=True)
                       if int(r) == rank)
        assert plain == sorted(_events(killed, rank)["seq"]), rank


def test_entry_is_on_disk_while_the_rank_is_blocked(killed: Path) -> None:
    """Rank 0's step-2 root entry is on disk though rank 0 died blocked in that all-gather."""
    events = _events(killed, 0)
    entry = events[(events["step"] == 2) & (events["phase"] == "forward")]
    assert list(entry["unit"].astype(str))[:1] == ["<root>"]
