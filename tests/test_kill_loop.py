"""SIGKILL at 30 random instants of a 2-rank FSDP2 job: every file reads, nothing recorded is lost.

The victim rank writes a truth file synchronously right after the hook that recorded its
last event returns, then SIGKILLs itself (``tests/jobs_scripts/kill_loop.py``); its last event
on disk must be that one. The peer is SIGKILLed a random instant later, wherever it is
(unless the vanished peer's gloo error ended it first).

Read twice: right away (a reader on the same host folds the killed rank's hot journal folder,
even while its writer process is still writing), then once the writer processes have finished,
when plain Parquet readers must see every row and no journal segment is left.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fsdptrace.reading.reader import discover_ranks, read_rank
from fsdptrace.store import journal_hot, schema
from tests.jobs import free_port, run_ranks

# A chunk a dead rank's writer process compacted away while we read is not damage.
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("error::fsdptrace.reading.chunk_gaps.SkippedChunkWarning")]

NUM_RUNS = 30


def test_sigkill_loses_nothing_the_rank_recorded(tmp_path: Path) -> None:
    ports = ",".join(str(free_port()) for _ in range(NUM_RUNS))
    for res in run_ranks(["tests/jobs_scripts/kill_loop.py", "--out", str(tmp_path),
                          "--ports", ports], timeout_s=240):
        assert res.returncode == 0, res.output
    results = {r: json.loads((tmp_path / f"results.rank{r}.json").read_text()) for r in (0, 1)}
    for index in range(NUM_RUNS):
        run_dir, victim = tmp_path / f"run{index:02d}", results[0][index]["victim"]
        # The peer may die of the gloo error first: its files must read all the same.
        assert results[victim][index]["signal"] == 9, index
        truth = json.loads((tmp_path / f"truth{index:02d}.json").read_text())
        expected = (truth["seq"], truth["step"], truth["micro_step"], truth["phase"],
                    truth["unit"])
        assert _last_event(run_dir, victim) == expected, index  # maybe mid-write
        for rank in (0, 1):
            assert journal_hot.wait_salvaged(run_dir / "journal" / f"rank={rank}", 30.0)
        for path in run_dir.rglob("*.parquet"):
            pq.read_table(path)
        assert discover_ranks(run_dir) == [0, 1]
        for rank in (0, 1):
            for table in schema.TABLES:
                read_rank(run_dir, table, rank)
        assert _last_event(run_dir, victim) == expected, index
        assert not list(run_dir.glob("journal/rank=*/*.seg")), index
        plain = pq.read_table(run_dir / "events" / f"rank={victim}").column("seq").to_pylist()
        assert max(plain) == truth["seq"] and len(plain) == len(set(plain)), index


def _last_event(run_dir: Path, rank: int) -> tuple:
    events = read_rank(run_dir, "events", rank).to_pandas().sort_values("seq")
    assert len(events) == events["seq"].nunique()
    last = events.iloc[-1]
    return (int(last["seq"]), int(last["step"]), int(last["micro_step"]), str(last["phase"]),
            str(last["unit"]))
