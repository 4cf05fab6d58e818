"""A run dir on a full disk: the analysis says which steps were not recorded, never "OK".

Found by experiment (2 ranks, 30 optimizer steps of 2 micro-steps with a 0.25 s pause each,
run dir on a 300 KB tmpfs, hot segments in ``/dev/shm``): the writer process's first write that
needs a new page of the run dir's disk (a mirror pass or a Parquet part) fails with ENOSPC at
steps 8-10 (17-28 without the pause, on a loaded machine; at close, on a fast one), each rank
warns once, disables recording and writes a ``recording_disabled`` marker at the step it
stopped; its ``close`` marker is still recorded at step 30. This was flaky: the failure is
noticed on the status thread, which first forbade new segments and only then wrote the
marker, and the stopping marker could be lost. Now the markers table keeps 16 KB of each
segment for it, and the writer process sets 32 KB of the run dir's disk aside at its start
and frees it to copy the markers into the run dir first: measured here, both ranks' markers
reach the run dir alone. (Other tables' rows after the last good write stay in the hot folder
only: read elsewhere, the run dir lacks them.)
Before, ``summary`` said "dropped rows: 0, incomplete steps: none" (it counted a marker kind
nothing writes) and ``analyze`` gave a clean verdict for the steps that were recorded. Now the
stopped range is an incomplete range of every table, from the marker to the rank's last step.

Real: a tmpfs mounted on a temporary folder, which needs root; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from fsdptrace_cli.main import cli

from fsdptrace.record import writer
from fsdptrace.record.journal import open_table
from fsdptrace.store import journal_hot, journal_read, schema
from tests.jobs import assert_ok, run_ranks

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "jobs_scripts" / "full_disk_job.py"
NUM_STEPS = 30
DISK = "300k"
# After each step: the writer's passes (every 2 s) run while the job trains, so the disk
# fills while recording on a fast machine too (else the first failed write may be at close).
PAUSE_S = 0.25


def _sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 300 KB tmpfs: room for a few steps of Parquet, not thirty. Always unmounted."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    mounted = _sh("mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mount))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()[:200]}")
    try:
        yield mount
    finally:
        _drop_hot_folders(mount)
        _sh("umount", str(mount))


def _drop_hot_folders(mount: Path) -> None:
    """The hot folders the writers could not empty into the full disk."""
    for rank in range(2):
        hot = journal_hot.hot_dir(mount / "run" / "journal" / f"rank={rank}", create=False)
        if hot is not None:
            shutil.rmtree(hot, ignore_errors=True)


def _summary(run_dir: Path) -> dict:
    summary = CliRunner().invoke(cli, ["summary", str(run_dir), "--format", "json"])
    assert summary.exit_code == 0, summary.output
    return json.loads(summary.stdout)


def test_a_full_run_dir_disk_is_reported_incomplete(tiny_disk: Path) -> None:
    run_dir = tiny_disk / "run"
    results = run_ranks([str(SCRIPT), str(NUM_STEPS), str(PAUSE_S)],
                        env={"FSDPTRACE_RUN_DIR": str(run_dir)}, timeout_s=400)
    assert_ok(results)  # training goes on
    assert all(r.output.count("recording disabled") == 1 for r in results), results

    # On the recording's host (its hot folders are read too): every rank says where it
    # stopped, in the room its markers table kept for that marker.
    numbers = _summary(run_dir)
    stopped = {int(r) for r in numbers["incomplete_steps"]}
    assert stopped == {0, 1}, numbers
    assert numbers["recording_stopped"].count("rank ") == 2, numbers
    for where in numbers["incomplete_steps"].values():
        assert where.endswith(f"-{NUM_STEPS} (every table: recording stopped)"), where

    analyze = CliRunner().invoke(cli, ["analyze", str(run_dir), "-j", "1"])
    lines = analyze.stdout.splitlines()
    assert lines[0].startswith("INCOMPLETE: no findings"), analyze.stdout  # no false finding
    named = [line for line in lines if "stopped recording in steps" in line]
    assert len(named) == 2, analyze.stdout

    # The run dir alone (copied elsewhere): the markers reached it through the disk room the
    # writer process set aside, so it too says where each rank stopped.
    _drop_hot_folders(tiny_disk)
    alone = _summary(run_dir)
    assert {int(r) for r in alone["incomplete_steps"]} == {0, 1}, alone
    assert alone["recording_stopped"] == numbers["recording_stopped"], alone


def test_the_stop_marker_fits_in_the_room_kept_for_it(tmp_path: Path) -> None:
    """No new segment can be made (here its folder is gone: ENOENT, as ENOSPC on a full disk)
    while the markers segment is full for ordinary rows: the marker that stops recording,
    written from inside the failed segment creation (the recorder's ``disable``), lands in the
    bytes the table kept free, and nothing deadlocks on the table's lock."""
    folder = tmp_path / "segments"
    folder.mkdir()
    stopped: list[str] = []

    def on_failure(error: BaseException) -> None:  # what ChunkWriter._fail does, in order
        table.release_reserve()
        stopped.append(f"{type(error).__name__}")
        table.append((10_000, 1, 7, 0, schema.MARKER_DISABLED, 0, "disk full " * 30))

    table = open_table(folder, "markers", "j1_1", {}, on_failure, (4096, 4096),
                       reserve=writer.MARKER_RESERVE_BYTES)
    row = (1, 1, 0, 0, schema.MARKER_MICRO_STEP, 0, "x" * 200)
    table.append(row)
    segment = next(folder.iterdir())
    moved = tmp_path / "kept.seg"
    segment.rename(moved)  # the mapping stays valid; the folder goes, so the next create fails
    folder.rmdir()
    for seq in range(2, 200):  # past the ordinary room of the first segment
        table.append((seq, *row[1:]))
    assert stopped == ["FileNotFoundError"]
    kinds = journal_read.read_segment(moved, "markers").column("kind").to_pylist()
    assert kinds[-1] == schema.MARKER_DISABLED
    assert kinds.count(schema.MARKER_DISABLED) == 1
