"""Recorder v2 under failure: the writer process killed, a job killed with its writers, a full
hot folder. Real 2-rank FSDP2 jobs (``tests/jobs_scripts/failure_job.py``, 30 steps of one
micro-step on ``plain_train``'s model: 3 layers and the root).

Found by instrumenting the job before writing these: a step records 8 events per rank (4 unit
forwards, 4 backwards), so 240 per rank in 30 steps, and one ``micro_step_begin`` and one
``optimizer_step`` marker per step. On this 2-core machine the writer process (``python -m``,
importing pyarrow) may start several steps after training did; the ``hang`` case waits for
its first parts before it stops, so the kill finds a writer that did write. A writer process
SIGSTOPped stays in state ``T`` (``/proc/<pid>/stat``) and says nothing more; before this
change the rank's close() then returned after its timeout with rank 1's rows after step 5 in
the hot folder only.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

import fsdptrace
from fsdptrace.reading import incomplete
from fsdptrace.render import text
from fsdptrace.store import journal_hot
from fsdptrace.store.run_mark import read_launch
from fsdptrace.views.summary import overview
from tests.jobs import assert_ok, kill_all, run_ranks, start_ranks

pytestmark = pytest.mark.slow

SCRIPT = "tests/jobs_scripts/failure_job.py"
STEPS = 30
EVENTS_PER_STEP = 8
TIMEOUT_S = 400.0


def _run(run_dir: Path, case: str, env: dict[str, str] | None = None) -> list[dict]:
    assert_ok(run_ranks([SCRIPT, "--run-dir", str(run_dir), "--case", case], env=env,
                        timeout_s=TIMEOUT_S))
    return [json.loads((run_dir.parent / f"{case}.rank{r}.json").read_text()) for r in (0, 1)]


def _cold(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> fsdptrace.Trace:
    """The run dir alone, as another host (or this one after a reboot) reads it."""
    with monkeypatch.context() as remote:
        remote.setenv(journal_hot.HOT_DIR_ENV, "off")
        return fsdptrace.load(run_dir)


def _counts(markers: pd.DataFrame, rank: int) -> dict[str, int]:
    mine = markers[markers["rank"] == rank]
    return mine["kind"].astype(str).value_counts().to_dict()


def _hold(folder: Path) -> int:
    """A shared lock on a hot folder's owner file, as its rank and writers hold: no sweep
    settles the folder while the descriptor is open."""
    fd = os.open(folder / journal_hot.OWNER_FILE, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _hot_folders(run_dir: Path, launch: str | None) -> list[Path]:
    return [journal_hot.hot_dir(run_dir / "journal" / f"rank={r}", create=False, launch=launch)
            for r in (0, 1)]


@pytest.mark.parametrize(("case", "how"), [("kill-writer", "was killed by SIGKILL"),
                                           ("stop-writer", "was stopped (SIGSTOP) and killed")],
                         ids=["SIGKILL", "SIGSTOP"])
def test_a_lost_writer_is_replaced_and_the_run_dir_alone_holds_every_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, how: str) -> None:
    """Rank 1 SIGKILLs (the OOM killer's pick) or SIGSTOPs its writer process at step 5 and
    trains on: the next optimizer boundary notices, records ``writer_lost`` and starts a new
    writer (a stopped one is killed first), which converts the segments the old one left;
    after close the run dir alone holds every row."""
    run_dir = tmp_path / "run"
    reports = _run(run_dir, case)
    first, last = reports[1]["writers"]
    assert first != last  # rank 1 runs a new writer process
    assert reports[0]["writers"][0] == reports[0]["writers"][1]
    message = f"writer process {first} {how}; restarted as {last}"
    assert reports[1]["warnings"] == [f"fsdptrace: rank 1: {message}"]
    trace = _cold(run_dir, monkeypatch)
    assert trace.events.groupby("rank").size().to_dict() == {
        0: STEPS * EVENTS_PER_STEP, 1: STEPS * EVENTS_PER_STEP}
    for rank in (0, 1):
        counts = _counts(trace.markers, rank)
        assert counts["optimizer_step"] == STEPS and counts["close"] == 1
    lost = trace.markers[trace.markers["kind"].astype(str) == "writer_lost"]
    assert list(lost["rank"]) == [1] and list(lost["detail"]) == [message]
    assert not list(run_dir.glob("journal/rank=*/*.seg"))
    # summary counts it, and says what it means for the findings (issue 30).
    said = overview(trace)
    assert re.fullmatch(r"rank 1 at step \d+: its writer process died and was restarted.*",
                        said["writers_lost"]), said
    assert said["writers_stalled"] == "none"
    # analyze says it under its verdict, in summary's words.
    told = io.StringIO()
    text.render(fsdptrace.analyze(run_dir), told)
    assert f"writers lost: {said['writers_lost']}\n" in told.getvalue()
    assert "writers stalled" not in told.getvalue()


def test_a_job_killed_with_its_writers_leaves_nothing_a_rerun_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks and writer processes SIGKILLed together (a cgroup kill) leave their segments in
    the hot folder. ``rm -rf`` and a clean rerun into the same path: the rerun has a new
    launch, so a folder of its own; it reads whole on this host, and its writers' sweep
    removed the killed job's folders (their run dir is gone)."""
    run_dir = tmp_path / "run"
    procs = start_ranks([SCRIPT, "--run-dir", str(run_dir), "--case", "hang"])
    reports = [tmp_path / f"hang.rank{r}.json" for r in (0, 1)]
    held: list[int] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not all(p.exists() for p in reports):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        writers = [pid for p in reports for pid in json.loads(p.read_text())["writers"]]
        killed = _hot_folders(run_dir, read_launch(run_dir))
        # Until the rm -rf is done no sweep may settle the killed folders: any writer process
        # starting on this host sweeps (another test's, under xdist), and one that settled
        # them into the run dir while rm ran made rm fail, "Directory not empty" (CI, once).
        # A shared lock, taken while the job lives, keeps every sweep off, as a live rank's.
        held = [_hold(folder) for folder in killed if folder is not None]
        # As a cgroup kill: the ranks are stopped first, or one of them could replace its
        # killed writer before its own kill, and the replacement (its child, which kill_all
        # does not reach) empties the hot folder into the run dir (seen once in CI).
        for proc in procs:
            os.kill(proc.pid, signal.SIGSTOP)
        for pid in writers:
            os.kill(pid, signal.SIGKILL)
    finally:
        kill_all(procs)
    try:
        assert all(folder is not None and journal_hot.segment_files(folder)
                   for folder in killed)
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    finally:
        for fd in held:
            os.close(fd)
    _run(run_dir, "clean")
    trace = fsdptrace.load(run_dir)  # on this host: the hot folders are looked at too
    assert trace.events.groupby("rank").size().to_dict() == {
        0: STEPS * EVENTS_PER_STEP, 1: STEPS * EVENTS_PER_STEP}
    assert not any(folder.exists() for folder in killed if folder is not None)


def test_a_job_killed_mid_training_with_its_writers_reads_incomplete_not_wrong(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks stopped and killed with their writer processes while training (a cgroup kill):
    the run dir holds each table as its writer last copied it, tables copied moments apart.
    Found by experiment before this: read alone, one run's events ended at step 271 and its
    gradients at 273, and ``analyze`` said "FAIL: 8 error(s)": 6 ``bypassed-unit`` (units
    with gradients and no forward), and in another run a false root cause ("the ranks
    diverged ... first collective count"). Now each pass of the writer says where the run
    dir's copy ends (``record.unwritten.mark_position``): every row the run dir lacks is in an
    incomplete range, and the only findings are the ranks that stopped."""
    run_dir = tmp_path / "run"
    procs = start_ranks([SCRIPT, "--run-dir", str(run_dir), "--case", "run-on",
                         "--steps", "100000"])
    reports = [tmp_path / f"run-on.rank{r}.json" for r in (0, 1)]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not all(p.exists() for p in reports):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        time.sleep(3.0)  # some passes of the writers while the ranks train on
        for proc in procs:
            os.kill(proc.pid, signal.SIGSTOP)
        for pid in [pid for p in reports for pid in json.loads(p.read_text())["writers"]]:
            os.kill(pid, signal.SIGKILL)
    finally:
        kill_all(procs)
    whole = fsdptrace.load(run_dir)  # with the hot folders, as on the recording host
    alone = _cold(run_dir, monkeypatch)
    # Rows the run dir lacks before the last micro-step it holds of that rank (in any table)
    # are in incomplete ranges. From there on the rank simply stops (and is said to): a pass
    # that found every row copied leaves no mark, so the rows recorded after it and before
    # the kill are missing from every table alike, the tail a rank killed then leaves.
    tables = ("events", "gradients", "backward_grads", "collectives", "markers")
    reached = pd.concat([getattr(alone, t)[["rank", "step", "micro_step"]] for t in tables])
    reached = (reached["step"].astype("int64") * 2**20 + reached["micro_step"]).groupby(
        reached["rank"].astype("int64")).max()
    ranges = incomplete.parse(alone.markers)
    for table in tables[:-1]:
        mine = [c for c in ("rank", "step", "micro_step", "seq")
                if c in getattr(whole, table).columns]
        lacking = getattr(whole, table)[mine].merge(getattr(alone, table)[mine], how="left",
                                                    indicator=True)
        lacking = lacking[lacking["_merge"] == "left_only"]
        where = lacking["step"].astype("int64") * 2**20 + lacking["micro_step"]
        lacking = lacking[where.to_numpy() < reached.reindex(lacking["rank"]).to_numpy()]
        assert incomplete.in_micro_steps(ranges, (table,), lacking["rank"].to_numpy(),
                                         lacking["step"].to_numpy(),
                                         lacking["micro_step"].to_numpy()).all(), table
    with monkeypatch.context() as remote:
        remote.setenv(journal_hot.HOT_DIR_ENV, "off")
        findings = fsdptrace.analyze(run_dir).findings
    assert set(findings["check"]) <= {"stalled-rank"}, findings[["check", "message"]]
    for folder in _hot_folders(run_dir, read_launch(run_dir)):
        if folder is not None:
            subprocess.run(["rm", "-rf", str(folder)], check=False)


@pytest.fixture
def tiny_hot_root(tmp_path: Path) -> Iterator[Path]:
    """A 200 KB tmpfs as the hot root (a crowded /dev/shm); unmounted whatever happens."""
    root = tmp_path / "hot"
    root.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(root)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'not root'})")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def test_a_full_hot_root_falls_back_to_the_run_dir_and_loses_no_row(
        tmp_path: Path, tiny_hot_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """13 tables' first segments (64 KB each) do not fit in 200 KB: the table that finds it
    full, and every later segment, go to the run dir's journal, with one warning per rank
    naming the hot folder, not the run dir."""
    run_dir = tmp_path / "run"
    reports = _run(run_dir, "clean", env={journal_hot.HOT_DIR_ENV: str(tiny_hot_root)})
    for rank, report in enumerate(reports):
        [warning] = report["warnings"]
        assert warning.startswith(f"fsdptrace: rank {rank}: the hot journal folder "
                                  f"{tiny_hot_root}/fsdptrace-{os.getuid()}/")
        assert f"(ENOSPC: No space left on device); recording goes on in {run_dir}" in warning
    trace = _cold(run_dir, monkeypatch)
    assert trace.events.groupby("rank").size().to_dict() == {
        0: STEPS * EVENTS_PER_STEP, 1: STEPS * EVENTS_PER_STEP}
    for rank in (0, 1):
        counts = _counts(trace.markers, rank)
        assert counts["optimizer_step"] == STEPS and counts["close"] == 1
        assert "recording_disabled" not in counts
    assert not list(run_dir.glob("journal/rank=*/*.seg"))
    assert not list((tiny_hot_root / f"fsdptrace-{os.getuid()}").iterdir())
