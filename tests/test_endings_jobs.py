"""How a rank ended, told truly: real 2-rank FSDP2 jobs (gloo, CPU) stopped every way jobs stop.

Rank 1 stops inside ``layers.1``'s forward at step 2 (``tests/jobs_scripts/ending_job.py``,
which writes the truth before it stops). Each ending must be recorded as itself, and
``fsdptrace.analyze`` must report stalled-rank for rank 1 there with that ending and nothing
else from the cut-off pass.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fsdptrace
from fsdptrace.errors import RunDirError
from fsdptrace.reading import endings
from tests.jobs import REPO, assert_ok, free_port, kill_all, run_ranks, start_ranks
from tests.jobs_scripts.tables import read_folded, read_table


def _markers(run_dir: Path) -> object:
    """A rank stopped by a signal leaves its ending in the journal (see ``read_folded``)."""
    return read_folded(run_dir, "markers", [0, 1])

# A chunk a dead rank's writer process compacted away while we read is not damage.
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("error::fsdptrace.reading.chunk_gaps.SkippedChunkWarning")]

SCRIPT = "tests/jobs_scripts/ending_job.py"


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _start(args: list[str]) -> subprocess.Popen:
    """A launcher process (torchrun or ``mp.spawn``) in its own session, killed as a group."""
    return subprocess.Popen([sys.executable, *args], env=_env(), cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _torchrun(*args: str) -> list[str]:
    return ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), SCRIPT, *args]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the launcher's group and to the ranks it started: torchrun starts each rank
    in a session of its own, which the group's signal does not reach (ranks killed only through
    the group outlived the test, a hanging one by its 600 s sleep). The ranks' writer
    processes are left alone, as a scheduler's SIGKILL to the job's processes leaves them."""
    if proc.poll() is None:
        ranks = _children(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def _children(pid: int) -> list[int]:
    """The living processes whose parent is ``pid`` (``/proc/PID/stat``'s fourth field)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _wait_truth(out: Path, deadline_s: float = 120.0) -> tuple:
    deadline = time.monotonic() + deadline_s
    path = out / "truth.json"
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            time.sleep(1.0)  # rank 0 reaches its next collective and blocks there
            return tuple(json.loads(path.read_text()))
        time.sleep(0.2)
    raise AssertionError(f"rank 1 never reached its stop: {out}")


def _ending(run_dir: Path, rank: int) -> tuple[str, str]:
    found = endings.rank_endings(_markers(run_dir), [0, 1])
    row = found[found["rank"] == rank].iloc[0]
    return str(row["ending"]), str(row["detail"])


def _assert_stalled(run_dir: Path, truth: tuple, ending: str) -> None:
    """Stalled-rank for rank 1, at the truth when its events reached the disk; nothing else."""
    found = fsdptrace.analyze(run_dir).findings
    assert set(found["check"]) == {"stalled-rank"}, found[["check", "rank", "message"]]
    message = str(found.loc[found["rank"] == 1, "message"].iloc[0])
    assert ending in message, message
    step, micro, phase, unit, _ = truth
    assert f"stopped at step {step}, micro-step {micro}, {phase}, last unit entered {unit} " \
        in message


def test_sigterm_to_torchrun_during_a_hang_is_terminated(tmp_path: Path) -> None:
    proc = _start(_torchrun("--out", str(tmp_path), "hang"))
    try:
        truth = _wait_truth(tmp_path)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        _kill_group(proc)
    run_dir = tmp_path / "run"
    for rank in (0, 1):
        assert _ending(run_dir, rank) == ("terminated", "SIGTERM")
    _assert_stalled(run_dir, truth, "was terminated by SIGTERM")


def test_sigint_is_terminated_not_a_keyboard_interrupt_crash(tmp_path: Path) -> None:
    procs = start_ranks([SCRIPT, "--out", str(tmp_path), "hang"])
    try:
        truth = _wait_truth(tmp_path)
        procs[1].send_signal(signal.SIGINT)
        out, _ = procs[1].communicate(timeout=60)
    finally:
        kill_all(procs)
    # Python re-raises an uncaught KeyboardInterrupt's SIGINT at exit, as without fsdptrace.
    assert procs[1].returncode == -signal.SIGINT and "KeyboardInterrupt" in out
    run_dir = tmp_path / "run"
    assert _ending(run_dir, 1) == ("terminated", "SIGINT")
    _assert_stalled(run_dir, truth, "was terminated by SIGINT")


def _assert_crashed_in_layers_1(proc: subprocess.Popen, tmp_path: Path) -> None:
    """Rank 1 raised inside ``layers.1``'s forward: crashed with the exception, stalled there."""
    try:
        proc.wait(timeout=120)
    finally:
        _kill_group(proc)
    assert proc.returncode != 0
    run_dir = tmp_path / "run"
    truth = tuple(json.loads((tmp_path / "truth.json").read_text()))
    assert _ending(run_dir, 1) == ("crashed", "RuntimeError: planted failure in layers.1")
    _assert_stalled(run_dir, truth, "crashed (RuntimeError: planted failure in layers.1)")


def test_uncaught_exception_under_torchrun_is_crashed(tmp_path: Path) -> None:
    proc = _start(_torchrun("--out", str(tmp_path), "raise"))
    _assert_crashed_in_layers_1(proc, tmp_path)


def test_exception_under_mp_spawn_is_crashed(tmp_path: Path) -> None:
    """``mp.spawn`` catches the exception and exits 1: no excepthook runs in the child."""
    port = str(free_port())
    proc = subprocess.Popen([sys.executable, SCRIPT, "--out", str(tmp_path), "--spawn", "raise"],
                            env={**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                            cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    _assert_crashed_in_layers_1(proc, tmp_path)


def _killed(tmp_path: Path, sig: signal.Signals) -> tuple:
    procs = start_ranks([SCRIPT, "--out", str(tmp_path), "hang"])
    try:
        truth = _wait_truth(tmp_path)
        procs[1].send_signal(sig)
        procs[1].wait(timeout=60)
    finally:
        kill_all(procs)
    assert procs[1].returncode == -sig
    return truth


# Contract v3: SIGABRT is a fatal signal, an ending of its own (``fatal_signals``); SIGKILL
# leaves none.
_KILLS = [(signal.SIGKILL, "killed or hung", "killed, hung, or still running"),
          (signal.SIGABRT, "died by a fatal signal", "died by SIGABRT")]


@pytest.mark.parametrize(("sig", "ending", "words"), _KILLS, ids=["SIGKILL", "SIGABRT"])
def test_killed_rank_has_no_ending_and_is_stalled(tmp_path: Path, sig: signal.Signals,
                                                  ending: str, words: str) -> None:
    _killed(tmp_path, sig)
    run_dir = tmp_path / "run"
    assert _ending(run_dir, 1)[0] == ending
    found = fsdptrace.analyze(run_dir).findings
    assert set(found["check"]) == {"stalled-rank"}, found[["check", "rank", "message"]]
    message = str(found.loc[found["rank"] == 1, "message"].iloc[0])
    assert words in message


@pytest.mark.parametrize(("sig", "ending", "words"), _KILLS, ids=["SIGKILL", "SIGABRT"])
def test_killed_rank_stalled_where_it_stopped(tmp_path: Path, sig: signal.Signals,
                                              ending: str, words: str) -> None:
    """Step 2's events are in the journal the moment the hook returns, whatever kills the rank
    (the job flushes nothing: 60 s flush interval)."""
    truth = _killed(tmp_path, sig)
    _assert_stalled(tmp_path / "run", truth, words)


def _seconds_to_die(tmp_path: Path, *, plain: bool) -> float:
    args = [SCRIPT, "--out", str(tmp_path), "--flush", "0.2", "blocked"]
    procs = start_ranks(args + (["--plain"] if plain else []))
    try:
        pid_file = tmp_path / "blocked.pid"
        deadline = time.monotonic() + 120
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # rank 0 is inside gloo's all-reduce now
        start = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        procs[0].wait(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        kill_all(procs)
    assert procs[0].returncode == -signal.SIGTERM
    return elapsed


def test_sigterm_kills_a_rank_blocked_in_gloo_as_fast_as_unrecorded(tmp_path: Path) -> None:
    plain = _seconds_to_die(tmp_path / "plain", plain=True)
    recorded = _seconds_to_die(tmp_path / "recorded", plain=False)
    print(f"seconds to die from SIGTERM while blocked: plain {plain:.3f}, "
          f"recorded {recorded:.3f}")
    assert plain < 1.0 and recorded < 1.0
    assert _ending(tmp_path / "recorded" / "run", 0) == ("terminated", "SIGTERM")


# ------------------------------------------------------------------ lives as without fsdptrace
def _lifecycle(tmp_path: Path, case: str) -> dict:
    results = run_ranks(["tests/jobs_scripts/lifecycle_job.py", "--out", str(tmp_path), case],
                        nproc=1)
    assert_ok(results)
    return json.loads((tmp_path / f"{case}.json").read_text())


def test_a_forked_child_leaves_the_parents_files_byte_identical(tmp_path: Path) -> None:
    seen = _lifecycle(tmp_path, "fork")
    assert seen["child_status"] == 0 and seen["num_files"] > 0
    assert seen["same"], seen["changed"]
    assert _ending(tmp_path / "run", 0)[0] == "closed mid-step"


def test_a_closed_recorder_lets_the_model_be_collected(tmp_path: Path) -> None:
    assert _lifecycle(tmp_path, "gc")["collected"]


def test_two_models_into_one_run_dir_are_refused(tmp_path: Path) -> None:
    refused = _lifecycle(tmp_path, "two-models")["refused"]
    assert "already records another model" in refused


def test_reset_iter_state_aborts_the_open_micro_step(tmp_path: Path) -> None:
    _lifecycle(tmp_path, "reset")
    run_dir = tmp_path / "run"
    markers = read_table(run_dir, "markers")
    aborted = markers[markers["kind"] == "aborted"]
    assert [(int(s), int(m)) for s, m in zip(aborted["step"], aborted["micro_step"],
                                               strict=True)] == [(1, 0)]
    assert _ending(run_dir, 0) == ("clean", "")
    # The aborted forward is cut off: no check reads its missing backward as a finding.
    assert not len(fsdptrace.analyze(run_dir).findings)


# ------------------------------------------------------------------ one hang, read three ways
def _stalled_where(run_dir: Path) -> list[tuple]:
    """Each stalled-rank finding without its ending: where the rank stopped and the verdict."""
    found = fsdptrace.analyze(run_dir).findings
    assert set(found["check"]) == {"stalled-rank"}, found[["check", "rank", "message"]]
    return sorted((int(r["rank"]), int(r["step"]), int(r["micro_step"]), str(r["phase"]),
                   str(r["unit"]), str(r["message"]).split("; stopped at ", 1)[1])
                  for _, r in found.iterrows())


def _wait_stalled(run_dir: Path, truth: tuple, deadline_s: float = 60.0) -> list[tuple]:
    """Analyze the hanging job until rank 1's last event has reached the analysis."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            where = _stalled_where(run_dir)
        except RunDirError:  # under load the writers may not have flushed a first chunk yet
            where = []
        if any(w[0] == 1 and w[1:5] == tuple(truth[:4]) for w in where):
            return where
        assert time.monotonic() < deadline, where
        time.sleep(0.5)


def test_one_hang_reads_the_same_while_hanging_after_sigterm_and_after_sigkill(
        tmp_path: Path) -> None:
    """CHECKS.md check 6: where each rank stopped and the verdict do not depend on how the
    hang ended. FSDP2 here: rank 1 sleeps in ``layers.1``'s forward at step 2; rank 0 runs on
    into its next collective and waits in gloo. Run twice (the hang is deterministic): read
    while hanging, then after SIGTERM to torchrun; and after SIGKILL to every process."""
    proc = _start(_torchrun("--out", str(tmp_path / "a"), "hang"))
    try:
        truth = _wait_truth(tmp_path / "a")
        hanging = _wait_stalled(tmp_path / "a" / "run", truth)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        _kill_group(proc)
    after_sigterm = _stalled_where(tmp_path / "a" / "run")

    proc = _start(_torchrun("--out", str(tmp_path / "b"), "hang"))
    try:
        assert _wait_truth(tmp_path / "b") == truth
        _wait_stalled(tmp_path / "b" / "run", truth)
    finally:
        _kill_group(proc)  # SIGKILL to torchrun and both ranks
    after_sigkill = _stalled_where(tmp_path / "b" / "run")
    assert len(hanging) == 2
    assert hanging == after_sigterm == after_sigkill
