"""A rank SIGKILLed mid-run: what was flushed before must read back, whole, with pyarrow.

Case ``killed`` of ``tests/jobs_scripts/recorder_cases.py``: both ranks flush steps 0 and 1;
rank 1 then holds back before step 2 while rank 0 blocks in the root's all-gather, and rank 1
dies at its next chunk rename, leaving a temp file on disk.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from tests.jobs import kill_all, start_ranks
from tests.jobs_scripts.recorder_cases import HOLD_S
from tests.jobs_scripts.tables import orders, read_table

pytestmark = pytest.mark.slow

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


def test_flushed_chunks_read_back(killed: Path) -> None:
    """Every finished chunk is a whole Parquet file, and the dead rank's steps 0-1 are there."""
    files = sorted(killed.glob("*/rank=1/part-*.parquet"))
    assert files
    for path in files:
        pq.read_table(path)
    recorded = {key: order for key, order in orders(killed).items() if key[0] == 1}
    expected = {
        (1, step, micro, phase): order
        for step in (0, 1)
        for micro in (0, 1)
        for phase, order in (("forward", FORWARD), ("backward", BACKWARD))
    }
    assert {key: recorded[key] for key in expected if key in recorded} == expected
    assert "close" not in set(read_table(killed, "markers").query("rank == 1")["kind"])


def test_temp_files_do_not_count(killed: Path) -> None:
    """The chunk being renamed at the kill stays a hidden temp file that readers skip."""
    temps = list(killed.glob("*/rank=1/.*.tmp"))
    assert len(temps) == 1, temps
    assert not list(killed.glob("*/rank=*/part-*.tmp"))
    listed = ds.dataset(temps[0].parent.parent, format="parquet", partitioning="hive").files
    assert listed and not any(name.endswith(".tmp") for name in listed)


def test_entry_is_on_disk_while_the_rank_is_blocked(killed: Path) -> None:
    """Rank 0's step-2 root entry was written before its all-gather could complete.

    That all-gather needs rank 1, which joined only ``HOLD_S`` later and died at once (its
    temp file's time). A chunk holding the entry that much older proves it was on disk while
    rank 0 was blocked in FSDP's collective.
    """
    died_at = next(killed.glob("*/rank=1/.*.tmp")).stat().st_mtime
    written_at = []
    for path in killed.glob("events/rank=0/part-*.parquet"):
        events = pq.read_table(path).to_pandas()
        entry = events[(events["step"] == 2) & (events["phase"] == "forward")]
        if "<root>" in set(entry["unit"].astype(str)):
            written_at.append(path.stat().st_mtime)
    assert written_at, "rank 0 never recorded entering step 2"
    assert min(written_at) < died_at - HOLD_S / 2
