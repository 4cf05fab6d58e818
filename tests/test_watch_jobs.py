"""The watcher on real FSDP2 jobs (gloo, CPU, 2 ranks; ``tests/jobs_scripts/watch_job.py``):
the verdict while the ranks hang, and no hang for a pause between steps or a straggler.

Measured on torch 2.13 CPU: when rank 1 sleeps in ``layers.2``'s forward, rank 0 finishes that
unit and records ``layers.3``'s forward begin, then waits in its all-gather; nothing else is
recorded by either rank (no writer heartbeat lands in a segment), so the silence the rule
times starts at rank 0's last event. The hang time is 4 s and a poll 0.5 s here; on a machine
with 2 cores and a load of 14 a rank took up to 5 s to reach its last record after the other
stopped, which is why latencies are measured from the last record, not from the sleep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fsdptrace
from fsdptrace.checks.kernel import stops
from fsdptrace.checks.kernel.tables import RankTables
from fsdptrace.checks.stalled_rank import NAME as STALLED
from fsdptrace.store import watch_records
from tests.jobs import REPO, how_terminated, kill_all, start_ranks

pytestmark = [pytest.mark.slow]

SCRIPT = "tests/jobs_scripts/watch_job.py"
HANG_AFTER = 4.0
POLL = 0.5
CLI = [sys.executable, "-m", "fsdptrace_cli.main"]
# Where the latencies of every hang below are collected (benchmarks/watch_poll.py reads none
# of it; the closing note quotes them): seconds from the last record to the printed verdict.
LATENCIES: list[float] = []


def _job(run_dir: Path, case: str, *args: str, nproc: int = 2) -> list[subprocess.Popen]:
    """The job, recording; its ranks train once ``_go`` (the watcher is watching)."""
    procs = start_ranks([SCRIPT, "--out", str(run_dir), "--case", case, "--go",
                         str(run_dir.parent / "go"), *args], nproc=nproc)
    deadline = time.monotonic() + 180
    while not (run_dir / "journal").is_dir():
        assert time.monotonic() < deadline, "the job never started recording"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.2)
    return procs


def _watcher(run_dir: Path, *options: str, env: dict[str, str] | None = None
             ) -> subprocess.Popen:
    """``fsdptrace watch`` in a process of its own, once it watches (its first line)."""
    watcher = subprocess.Popen([*CLI, "watch", str(run_dir), "--hang-after", str(HANG_AFTER),
                                "--poll", str(POLL), *options], cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, **(env or {})})
    assert watcher.stderr is not None
    assert watcher.stderr.readline().startswith("fsdptrace: watching ")
    return watcher


def _go(run_dir: Path) -> None:
    (run_dir.parent / "go").touch()


def _watched_to_the_end(run_dir: Path, case: str, *args: str) -> tuple[str, str]:
    """A job that ends normally, watched throughout: the watcher's stdout and stderr, once it
    returned 0 (the run ended) and every rank exited 0."""
    procs = _job(run_dir, case, *args)
    try:
        watcher = _watcher(run_dir)
        _go(run_dir)
        out, err = watcher.communicate(timeout=240)
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    finally:
        kill_all(procs)
    assert watcher.returncode == 0, out + err
    return out, err


def _read_verdict(watcher: subprocess.Popen, procs: list[subprocess.Popen]) -> list[str]:
    """The watcher's stdout up to the end of the verdict, checking the ranks live meanwhile."""
    assert watcher.stdout is not None
    lines: list[str] = []
    for line in watcher.stdout:
        lines.append(line)
        if len([x for x in lines[:-1] if x.startswith("  - rank ")]) == len(procs):
            break  # the second finding's message line is in
    alive = [p.poll() is None for p in procs]
    assert all(alive), f"a rank ended before the verdict was printed: {lines}"
    return lines


def _latency(run_dir: Path) -> float:
    """Seconds from the last record of any rank to the printed verdict (same host: the ranks'
    ``t_ns`` and the watcher's ``printed_mono_ns`` are one monotonic clock)."""
    [record] = watch_records.read_hangs(run_dir)
    trace = fsdptrace.load(run_dir)
    steps = trace.markers[trace.markers["kind"].astype(str).isin(["micro_step_begin",
                                                                  "optimizer_step"])]
    last = max(int(trace.events["t_ns"].max()), int(steps["t_ns"].max()),
               int(trace.eval_forwards["t_ns"].max()) if len(trace.eval_forwards) else 0)
    latency = (record["printed_mono_ns"] - last) / 1e9
    detected = (record["detected_mono_ns"] - last) / 1e9
    LATENCIES.append(latency)
    print(f"latency: detected {detected:.2f} s, printed {latency:.2f} s after the last record "
          f"(hang time {HANG_AFTER} s, poll {POLL} s)")
    return latency


def _stalled(run_dir: Path) -> dict[int, str]:
    found = fsdptrace.analyze(run_dir, [STALLED]).findings
    return dict(zip(found["rank"].astype(int), found["message"], strict=True))


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_rank_asleep_in_a_forward(tmp_path: Path, nproc: int) -> None:
    """Rank 1 sleeps in ``layers.2``'s forward at step 2. The watcher reading the hot folders
    prints the stalled-rank verdict (rank 1 furthest behind) while both ranks are alive, within
    the hang time plus a poll and the analysis's own time; a second watcher reading only the
    mirror (``FSDPTRACE_HOT_DIR=off``, as on another host) finds the claim taken and stays
    quiet. The watcher's record is in the run dir, with every rank's stack taken while it hung.
    With 4 ranks, ranks 0, 2 and 3 wait."""
    run_dir = tmp_path / "run"
    procs = _job(run_dir, "sleep_forward", nproc=nproc)
    try:
        hot = _watcher(run_dir)
        mirror = _watcher(run_dir, env={"FSDPTRACE_HOT_DIR": "off"})
        _go(run_dir)
        lines = _read_verdict(hot, procs)
        text = "".join(lines)
        assert "fsdptrace: hang detected at " in text
        assert "rank 1 | step 2 | micro-step 0 | forward | layers.2" in text
        assert "it is furthest behind (likely culprit of a hang)" in text
        assert hot.wait(timeout=120) == 1
        assert mirror.wait(timeout=120) == 1
        assert "hang detected" not in mirror.communicate()[0]
    finally:
        kill_all(procs)
        kill_all([hot, mirror])
    record = watch_records.read_hangs(run_dir)[0]
    assert record["acted"] and record["quiet_s"] >= HANG_AFTER
    # The probe places each rank as the analysis's stop points do (one definition).
    points = stops.stop_points(RankTables.from_trace(fsdptrace.load(run_dir)))
    assert {str(r): k for r, k in zip(points["rank"], points["kind"], strict=True)} == {
        r: s["where"] for r, s in record["ranks"].items()} == {str(r): "pass"
                                                               for r in range(nproc)}
    assert record["verdict"]["findings"], record
    # Every rank's stack was taken while it hung: the sleeper in the job's own frame.
    assert sorted(record["stacks"]) == [str(r) for r in range(nproc)], record
    assert "_sleep_in_forward" in Path(record["stacks"]["1"]).read_text()
    assert sorted(fsdptrace.load(run_dir).stacks) == list(range(nproc))
    assert _latency(run_dir) < HANG_AFTER + 2 * POLL + 15  # the analysis on a loaded machine


def test_a_skipped_layer_terminated_by_record_watch(tmp_path: Path) -> None:
    """``fsdptrace record --watch --on-hang terminate -- torchrun ...``: rank 1 skips
    ``layers.2`` at step 1, both ranks hang in that step's backward (mismatched all-gathers
    that gloo pairs silently). The verdict names the divergence (root cause first) live; then
    SIGTERM ends the ranks, their endings read terminated, and the offline analysis gives the
    same stop points plus the watcher's record."""
    run_dir = tmp_path / "run"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    job = subprocess.run(
        [*CLI, "record", "--run-dir", str(run_dir), "--watch", "--hang-after", str(HANG_AFTER),
         "--poll", str(POLL), "--on-hang", "terminate", "--", torchrun, "--nproc-per-node", "2",
         SCRIPT, "--out", str(run_dir), "--case", "skip_layer"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    live = job.stdout.split("fsdptrace: hang detected at ", 1)[1]
    assert "root cause: the ranks diverged before the stop with no majority" in live
    assert "rank 0 ran layers.2 at index 3 of step 1, micro-step 0 forward" in live
    assert "sent SIGTERM to rank(s) 0, 1 on this host" in job.stderr
    after = _stalled(run_dir)
    ended = how_terminated(after)  # SIGTERM goes to both ranks at once
    assert sorted(ended) == [0, 1] and "terminated" in ended.values(), ended
    assert set(ended.values()) <= {"terminated", "peer gone"}, ended
    for message in after.values():
        assert message.split("; stopped at ", 1)[1] in live
    [record] = watch_records.read_hangs(run_dir)
    assert record["settings"]["on_hang"] == "terminate" and record["terminated"] == [0, 1]
    # The post-mortem's text tells what the watcher saw and did, and where each rank stood.
    report = subprocess.run([*CLI, "analyze", str(run_dir)], cwd=REPO, capture_output=True,
                            text=True, timeout=300).stdout
    assert f"watcher: hang detected at {record['detected_at']}: no rank recorded" in report
    assert "it sent SIGTERM to rank(s) 0, 1" in report
    assert "rank 0 stack at " in report and "rank 1 stack at " in report, report
    _latency(run_dir)


def test_an_extra_eval_batch_named_through_the_mirror_and_exec(tmp_path: Path) -> None:
    """Rank 0 runs a 3rd eval batch after step 1; its eval all-gathers pair with rank 1's
    training ones and both wait. A watcher reading only the mirror (``FSDPTRACE_HOT_DIR=off``)
    calls the hang at most one flush interval later, and ``--on-hang exec`` hands the command
    the verdict JSON naming eval interval 2 as the root cause."""
    run_dir = tmp_path / "run"
    received = tmp_path / "verdict.json"
    procs = _job(run_dir, "extra_eval")
    try:
        watcher = _watcher(run_dir, "--on-hang", f"exec cat > {received}",
                           env={"FSDPTRACE_HOT_DIR": "off"})
        _go(run_dir)
        out, err = watcher.communicate(timeout=180)
        assert watcher.returncode == 1, out + err
        assert all(p.poll() is None for p in procs), "a rank ended before the hook ran"
    finally:
        kill_all(procs)
    sent = json.loads(received.read_text())
    messages = [f["message"] for f in sent["verdict"]["findings"]]
    assert len(messages) == 2, sent["verdict_text"]
    assert all("eval interval 2" in m for m in messages), sent["verdict_text"]
    assert sent["verdict_text"] in out
    assert "--on-hang exec cat > " in err and "exited 0" in err
    _latency(run_dir)  # the mirror's lag included


def test_a_pause_between_steps_is_no_hang(tmp_path: Path) -> None:
    """Every rank sleeps three times the hang time after step 1's optimizer step (a
    checkpoint): their last record is the boundary, so the idle time holds, and the watcher
    returns 0 when the job ends."""
    run_dir = tmp_path / "run"
    out, err = _watched_to_the_end(run_dir, "pause", "--seconds", str(3 * HANG_AFTER),
                                   "--steps", "3")
    assert "hang" not in out and not watch_records.read_hangs(run_dir)
    assert all((run_dir / f"stopping.rank{r}").exists() for r in (0, 1))


def test_a_straggler_is_a_warning(tmp_path: Path) -> None:
    """Rank 1 sleeps 1 s before each forward (slow data loading): rank 0 waits for it in the
    first all-gather of every step, so both ranks' micro-steps last as long, but rank 1 begins
    each about 1 s after rank 0. One warning names rank 1; no hang."""
    run_dir = tmp_path / "run"
    out, err = _watched_to_the_end(run_dir, "straggler", "--seconds", "1", "--steps", "8")
    assert err.count("straggles") == 1 and "warning: rank 1 straggles" in err, err
    assert "hang" not in out
