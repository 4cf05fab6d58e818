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

The rows between the writer's last good write and that marker stayed in the hot folder: read
from the run dir alone, a rank's events stopped steps before its marker (one run: rank 0 had
none of its 128 events, its gradients were there), and ``analyze`` said "FAIL: 32 error(s)"
(``bypassed-unit``: units with gradients and no forward). Now the writer, after moving what it
can, says in the run dir which rows of each table only the hot folder holds
(``record.unwritten``): those micro-steps are incomplete, not findings.

A disk that fills only at close (the writer's last conversion is its first write to fail):
before, the run dir alone held none of the 960 events, and ``summary`` said "clean close: 2,
dropped rows: 0, incomplete steps: none", ``analyze`` "OK: no findings".

Real: a tmpfs mounted on a temporary folder, which needs root; skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from fsdptrace_cli.main import cli

import fsdptrace
from fsdptrace.reading import incomplete
from fsdptrace.record import hot_sweep, writer
from fsdptrace.record.journal import open_table
from fsdptrace.record.part_writer import PartWriter
from fsdptrace.store import journal_hot, journal_read, schema
from fsdptrace.store.journal_format import LOSS_WRITER
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
def tiny_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A 300 KB tmpfs: room for a few steps of Parquet, not thirty. Always unmounted.

    The hot folders go to a root of this test's own (in ``/dev/shm`` as by default): the
    ranks leave rows there that the full disk could not take, and any writer process that
    starts on the host settles such stale folders into their run dirs. Another test's writer
    did, in the middle of this one's checks (a temporary part on the full disk; reproduced by
    sweeping in a loop beside the test: 2 failures in 3 runs).
    """
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    mounted = _sh("mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mount))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()[:200]}")
    shm = Path("/dev/shm")
    hot = Path(tempfile.mkdtemp(prefix="fsdptrace-test-", dir=shm if shm.is_dir() else tmp_path))
    monkeypatch.setenv(journal_hot.HOT_DIR_ENV, str(hot))
    try:
        yield mount
    finally:
        _drop_hot_folders(mount)
        _sh("umount", str(mount))
        shutil.rmtree(hot, ignore_errors=True)


def _drop_hot_folders(mount: Path) -> None:
    """The hot folders the writers could not empty into the full disk."""
    for rank in range(2):
        hot = journal_hot.hot_dir(mount / "run" / "journal" / f"rank={rank}", create=False)
        if hot is not None:
            shutil.rmtree(hot, ignore_errors=True)


_ALONE = {journal_hot.HOT_DIR_ENV: "off"}  # the run dir alone: another host, after a reboot


def _summary(run_dir: Path, env: dict[str, str] | None = None) -> dict:
    summary = CliRunner().invoke(cli, ["summary", str(run_dir), "--format", "json"], env=env)
    assert summary.exit_code == 0, summary.output
    return json.loads(summary.stdout)


def _analyze(run_dir: Path, env: dict[str, str] | None = None) -> list[str]:
    analyze = CliRunner().invoke(cli, ["analyze", str(run_dir), "-j", "1"], env=env)
    return analyze.stdout.splitlines()


def _load_alone(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> fsdptrace.Trace:
    with monkeypatch.context() as remote:
        remote.setenv(journal_hot.HOT_DIR_ENV, "off")
        return fsdptrace.load(run_dir)


def test_a_full_run_dir_disk_is_reported_incomplete(tiny_disk: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
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
        assert f"-{NUM_STEPS} (" in where, where
        assert where.endswith("every table: recording stopped)"), where

    analyze = CliRunner().invoke(cli, ["analyze", str(run_dir), "-j", "1"])
    lines = analyze.stdout.splitlines()
    assert lines[0].startswith("INCOMPLETE: no findings"), analyze.stdout  # no false finding
    named = [line for line in lines if "stopped recording in steps" in line]
    assert len(named) == 2, analyze.stdout

    # The run dir alone (copied elsewhere): the markers reached it through the disk room the
    # writer process set aside, so it too says where each rank stopped, and which rows before
    # that only the hot folder had: every event the run dir lacks is in an incomplete range.
    whole = fsdptrace.load(run_dir)
    alone = _load_alone(run_dir, monkeypatch)
    keys = ["rank", "step", "micro_step", "seq"]
    lacking = whole.events[keys].merge(alone.events[keys], how="left", indicator=True)
    lacking = lacking[lacking["_merge"] == "left_only"]
    ranges = incomplete.parse(alone.markers)
    assert incomplete.in_micro_steps(ranges, ("events",), lacking["rank"].to_numpy(),
                                     lacking["step"].to_numpy(),
                                     lacking["micro_step"].to_numpy()).all(), (lacking, ranges)
    _drop_hot_folders(tiny_disk)
    said = _summary(run_dir)
    assert {int(r) for r in said["incomplete_steps"]} == {0, 1}, said
    assert said["recording_stopped"] == numbers["recording_stopped"], said
    if len(lacking):
        assert said["dropped_rows"] >= len(lacking), said
    assert _analyze(run_dir)[0].startswith("INCOMPLETE: no findings")  # no false finding


def test_a_disk_that_fills_at_close_says_what_the_run_dir_lacks(
        tiny_disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing reaches the run dir during training but the empty tables (and the events
    segments an optimizer boundary found full); then its disk is filled to the last byte and
    the ranks close: the writer's final conversion fails. It deletes nothing already written,
    moves what fits, and says in the disk room it kept which rows of each table are not
    there, so the run dir alone is incomplete, not OK."""
    run_dir = tiny_disk / "run"
    results = run_ranks([str(SCRIPT), str(NUM_STEPS), "0", "at-close"],
                        env={"FSDPTRACE_RUN_DIR": str(run_dir)}, timeout_s=400)
    assert_ok(results)
    for table in schema.TABLES:  # the first parts, written at start, are all still there
        for rank in (0, 1):
            assert list((run_dir / table / f"rank={rank}").glob("part-*.parquet")), table
    assert not list(run_dir.rglob("*" + schema.TEMP_SUFFIX))  # no half-written part holds room
    assert len(list(run_dir.glob("journal/rank=*/markers-*" + LOSS_WRITER.format(writer="")
                                 + "-*.seg"))) == 2

    alone = _summary(run_dir, env=_ALONE)
    assert alone["events"] < 2 * NUM_STEPS * 16, alone
    assert alone["dropped_rows"] >= 2 * NUM_STEPS * 16 - alone["events"], alone
    assert {int(r) for r in alone["incomplete_steps"]} == {0, 1}, alone
    # Every event the run dir alone lacks is in an incomplete range of its rank. Which ranks
    # lack events depends on timing: in one run one rank's events had all reached the run dir
    # and no range named its events; in another a range named 480 events of a rank whose
    # events the run dir alone held (a loss said too wide reads as incomplete, never wrong).
    keys = ["rank", "step", "micro_step", "seq"]
    whole_events = fsdptrace.load(run_dir).events[keys]
    lacking = whole_events.merge(_load_alone(run_dir, monkeypatch).events[keys], how="left",
                                 indicator=True)
    lacking = lacking[lacking["_merge"] == "left_only"]
    assert len(lacking), "the disk filled only after every event reached the run dir"
    ranges = incomplete.parse(_load_alone(run_dir, monkeypatch).markers)
    assert incomplete.in_micro_steps(ranges, ("events",), lacking["rank"].to_numpy(),
                                     lacking["step"].to_numpy(),
                                     lacking["micro_step"].to_numpy()).all(), (lacking, ranges)
    for rank, where in alone["incomplete_steps"].items():
        assert where.startswith("steps 0-"), where
        if int(rank) in set(lacking["rank"]):
            assert "events: " in where, where
    lines = _analyze(run_dir, env=_ALONE)
    assert lines[0].startswith("INCOMPLETE: no findings"), lines
    named = [line for line in lines if "could not write" in line and "to its run dir" in line]
    assert len(named) == 2, lines

    # Room again (the ballast goes), and the next writer on this host settles the dead
    # recording's hot folders: every row reaches the run dir, and the loss markers go.
    (tiny_disk / "ballast").unlink()
    for rank in (0, 1):
        assert _settled(run_dir / "journal" / f"rank={rank}"), rank
    whole = _summary(run_dir, env=_ALONE)
    assert whole["events"] == 2 * NUM_STEPS * 16 and whole["dropped_rows"] == 0, whole
    assert _analyze(run_dir, env=_ALONE)[0].startswith("OK: no findings")


def _settled(cold: Path, timeout_s: float = 30.0) -> bool:
    """Settle the dead recording's hot folder for ``cold``, as the next writer on this host
    would, until none is left. Before the hot folders had a root of the test's own, another
    job's writer could hold it (its start-up sweep) and fail while the disk was still full
    (seen in a three-worker CI run); the folder is taken again until it is gone all the same."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        folder = journal_hot.hot_dir(cold, create=False)
        if folder is None or not folder.exists():
            return True
        held = journal_hot.lock_if_stale(folder)
        if held is not None:
            try:
                hot_sweep.settle(folder, held[1])
            finally:
                os.close(held[0])
        journal_hot.wait_salvaged(cold, timeout_s=0.5)
    return journal_hot.wait_salvaged(cold, timeout_s=0)


def test_a_short_mirror_write_is_a_failure_not_a_hole(tiny_disk: Path) -> None:
    """The run dir's disk has room for part of a mirror pass: ``pwrite`` takes what fits and
    returns the count. Before, the pass took it for the whole and moved on; the next pass
    copied from that offset, leaving a hole of zeros that reads as rows never written (here
    rows 303 to 1,000 of 1,000 were missing from the run dir alone, with no sign). Now the
    pass fails (the recorder disables itself, as for any failed write) and the next one,
    once there is room, copies the segment whole."""
    run_dir = tiny_disk / "run"
    chunks = writer.ChunkWriter(run_dir, rank=0, version="test", writer_id="j1_000000001")
    assert chunks.segment_dir != chunks.journal_dir, "no hot folder on this host"
    events = chunks.buffer("events", {"phase": schema.PHASES, "unit": ["<root>"]})
    for seq in range(1, 1001):  # 44 KB of slots in the open segment
        events.append((seq, seq, seq // 100, 0, 0, 0))
    part_writer = PartWriter(run_dir, rank=0, version="test", writer_id=chunks.writer_id,
                             segment_dir=chunks.segment_dir)
    ballast = tiny_disk / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)  # the disk full to the last page
    with contextlib.suppress(OSError):
        while os.write(fd, b"\1" * 4096) == 4096:
            pass
    os.close(fd)
    os.truncate(ballast, ballast.stat().st_size // 4096 * 4096 - 12 * 1024)  # room: 12 KB
    with pytest.raises(OSError, match="No space left"):
        part_writer.mirror()
    assert "events" not in part_writer.mirrored
    ballast.unlink()
    part_writer.mirror()
    cold = chunks.journal_dir / next(chunks.segment_dir.glob("events-*.seg")).name
    seqs = journal_read.read_segment(cold, "events").column("seq").to_pylist()
    assert seqs == list(range(1, 1001))
    chunks.abandon()


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
