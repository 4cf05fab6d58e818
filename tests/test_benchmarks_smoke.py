"""Scale paths on synthetic run dirs: every planted finding, nothing else, at any size.

``benchmarks/generate_run.py`` plants one problem of each check at known places, in a run
with repeated calls, units without parameters, two pipeline stages with disjoint units,
dictionaries ordered differently per rank, a stalled rank and a rank missing on disk.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

import fsdptrace
from fsdptrace import analysis, last_step, reader
from fsdptrace.checks import CHECKS
from tests.synthetic import TINY, generate_run, generate_tiny, where

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[tuple]]:
    path = tmp_path_factory.mktemp("synthetic") / "run"
    return path, generate_tiny(path)


def test_every_planted_finding_and_nothing_else(tiny: tuple[Path, set[tuple]]) -> None:
    run_dir, expected = tiny
    checks = {row[0] for row in expected}
    # The generator writes no provenance (checks 8, 9, 13) and none of the tables checks
    # 10-12 read.
    assert checks == set(CHECKS) - {"wasted-prefetch", "redundant-prefetch",
                                    "gradient-divergence", "eval-divergence",
                                    "setting-divergence", "unsharded-excess"}
    assert where(fsdptrace.analyze(run_dir)) == expected


def test_run_dir_trace_and_processes_agree(tiny: tuple[Path, set[tuple]]) -> None:
    run_dir, _ = tiny
    serial = fsdptrace.analyze(run_dir)
    pd.testing.assert_frame_equal(serial, fsdptrace.analyze(run_dir, jobs=2))
    pd.testing.assert_frame_equal(serial, fsdptrace.analyze(fsdptrace.load(run_dir)))


def test_repeated_analysis_is_identical(tiny: tuple[Path, set[tuple]]) -> None:
    run_dir, _ = tiny
    pd.testing.assert_frame_equal(fsdptrace.analyze(run_dir), fsdptrace.analyze(run_dir))


def test_larger_shape_scales_the_same_findings(tmp_path: Path) -> None:
    shape = generate_run.Shape(ranks=9, steps=13, micro_steps=3, units=7, stages=3)
    expected = generate_run.generate(tmp_path / "run", shape)
    assert where(fsdptrace.analyze(tmp_path / "run", jobs=2)) == expected


def test_generator_writes_the_real_format(tiny: tuple[Path, set[tuple]]) -> None:
    run_dir, _ = tiny
    trace = fsdptrace.load(run_dir)
    assert trace.ranks == [r for r in range(TINY.ranks) if r != TINY.ranks - 1]
    assert trace.world_size == TINY.ranks
    assert len(trace.events) == TINY.num_events * 5 // 6 - (
        TINY.per_micro_step - generate_run.Plan().stall_position - 1)


def test_quick_benchmark_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "analyzer_throughput.py"), "--quick",
         "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "| events | ranks |" in result.stdout


def test_batches_of_any_size_give_the_same_findings(tiny: tuple[Path, set[tuple]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The map step batches ranks; one rank per batch, a row limit that splits the run, one
    batch for all and two processes must all give the same table."""
    run_dir, _ = tiny
    whole = fsdptrace.analyze(run_dir)
    monkeypatch.setattr(analysis, "BATCH_RANKS", 1)
    pd.testing.assert_frame_equal(whole, fsdptrace.analyze(run_dir))
    done: list[int] = []
    pd.testing.assert_frame_equal(whole, fsdptrace.analyze(run_dir, jobs=2,
                                                           progress=done.append))
    assert done == sorted(set(done)) and done[-1] == TINY.ranks - 1  # one missing on disk
    monkeypatch.setattr(analysis, "BATCH_RANKS", 256)
    monkeypatch.setattr(analysis, "BATCH_ROWS", TINY.num_events // TINY.ranks * 2)
    pd.testing.assert_frame_equal(whole, fsdptrace.analyze(run_dir))


def test_triage_reads_endings_and_agrees(tmp_path: Path) -> None:
    """``--check stalled-rank`` reads each rank's ending and last step only (row-group
    statistics), and says exactly what the full analysis says of the stalls."""
    run_dir = tmp_path / "run"
    generate_tiny(run_dir)
    # Small row groups: the stalled rank's last step spans several, its history many more.
    for path in sorted((run_dir / "events").glob("rank=*/part-*.parquet")):
        data = pq.read_table(path)
        pq.write_table(data, path, row_group_size=7)
    full = fsdptrace.analyze(run_dir)
    stalled = full[full["check"] == "stalled-rank"].reset_index(drop=True)
    pd.testing.assert_frame_equal(stalled, fsdptrace.analyze(run_dir, checks=["stalled-rank"]))
    rank = generate_run.Plan().stalled
    last = last_step.read_last_step(run_dir, rank)
    assert TINY.steps - 1 in set(last.column("step").to_pylist())
    assert last.num_rows < reader.read_rank(run_dir, "events", rank).num_rows // 2
