"""Every rank's stack at hang time, taken while the ranks live (issue 25, CHECKS.md v3 watching).

Found by experiment on torch 2.13, gloo, 2 ranks (``tests/jobs_scripts/stacks_job.py``): rank 1
sleeps in a forward pre-hook of ``layers.1`` at step 2; rank 0's main thread then waits inside
C++, in ``work.wait()`` of ``all_gather_single`` (``distributed_c10d.py``), called from FSDP2's
``foreach_all_gather`` (``_fsdp_collectives.py``) for the next unit's prefetch. The stack signal
(``SIGRTMIN+9``) reaches the main thread of both; faulthandler writes all three threads (the
main one, fsdptrace's signal thread, the writer's status reader) at once, and the signal
thread, free to run while the main one waits in C++, saves the Flight Recorder's dump (gloo:
the one all-gather rank 0 waits in is not completed). A Python handler that was on the signal
before runs too, on rank 1 (its main thread returns to Python at once: ``time.sleep`` is
interrupted, runs the handler and goes on sleeping); both ranks stay alive.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from fsdptrace_cli.main import cli

import fsdptrace
from fsdptrace.errors import FsdptraceError, SkippedDumpWarning
from fsdptrace.reading import flight_recorder
from fsdptrace.record.stack_dump import configured_signal
from fsdptrace.render.stack_view import stack_blocks
from fsdptrace.store import stack_dumps
from fsdptrace.store.fatal_signals import FR_PATTERN
from fsdptrace.watch.stacks import SETTLE_S, capture_stacks, read_stacks
from tests.jobs import REPO, kill_all, run_scenarios, start_ranks
from tests.jobs_scripts.tables import read_folded
from tests.test_endings_jobs import _wait_truth

SCRIPT = str(REPO / "tests" / "jobs_scripts" / "stacks_job.py")
# A capture is a few KB (three threads, ~25 frames on the training thread); the bound is
# what a dump that grew without limit would break.
MAX_CAPTURE_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The hang, its capture, and what it cost: taken once while both ranks are alive."""
    out = tmp_path_factory.mktemp("stacks")
    procs = start_ranks([SCRIPT, "--out", str(out), "--previous-handler"],
                        env={"TORCH_FR_BUFFER_SIZE": "2000"})
    try:
        _wait_truth(out, deadline_s=180.0)
        started = time.monotonic()
        paths = capture_stacks(out / "run", timeout_s=20.0)
        took_s = time.monotonic() - started
        time.sleep(0.5)  # a signal that killed a rank would have by now
        alive = [proc.poll() is None for proc in procs]
        # Before any ending: the Flight Recorder dumps are the capture's own.
        dumps = {r: sorted((out / "run" / "dumps" / f"rank={r}").glob(FR_PATTERN)) for r in (0, 1)}
        dump_sizes = {r: [p.stat().st_size for p in paths] for r, paths in dumps.items()}
        dump_entries = {r: [len(json.loads(p.read_bytes())["entries"]) for p in paths]
                        for r, paths in dumps.items()}
        previous = {r: (out / f"previous-{r}").read_text() if (out / f"previous-{r}").exists()
                    else "" for r in (0, 1)}
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=60)
    finally:
        kill_all(procs)
    return {"run_dir": out / "run", "paths": paths, "took_s": took_s, "alive": alive,
            "previous": previous,
            "dump_sizes": dump_sizes, "dump_entries": dump_entries}


@pytest.mark.slow
def test_each_rank_shows_where_it_hung(hung: dict) -> None:
    """The sleeping rank's training thread is in the job's own frame; the waiting rank's in
    FSDP's all-gather, inside gloo's wait. Both ranks survive the signal."""
    assert hung["alive"] == [True, True]
    assert sorted(hung["paths"]) == [0, 1]
    stacks = read_stacks(hung["run_dir"])
    assert sorted(stacks) == [0, 1] and all(len(c) == 1 for c in stacks.values())
    sleeper, waiter = stacks[1][0], stacks[0][0]
    assert sleeper.complete and waiter.complete
    assert sleeper.main_frames[0].startswith("stop (ending_job.py:")
    assert waiter.main_frames[0].startswith("all_gather_single (distributed_c10d.py:")
    assert any(f.startswith("foreach_all_gather (_fsdp_collectives.py:")
               for f in waiter.main_frames)
    assert all(len(c.threads) >= 2 for c in (sleeper, waiter))  # every thread, not only main
    for rank, path in hung["paths"].items():
        assert path.parent == hung["run_dir"] / "dumps" / f"rank={rank}"
        assert 0 < path.stat().st_size < MAX_CAPTURE_BYTES
    assert hung["took_s"] < 10.0
    sizes = {r: p.stat().st_size for r, p in sorted(hung["paths"].items())}
    print(f"\nstacks: capture {hung['took_s'] * 1000:.0f} ms for 2 ranks; capture bytes per rank "
          f"{sizes}; Flight Recorder dump bytes per rank {hung['dump_sizes']} "
          f"(entries {hung['dump_entries']})")


@pytest.mark.slow
def test_a_handler_already_on_the_signal_still_runs(hung: dict) -> None:
    """Chained: rank 1's own handler saw the stack signal (rank 0's runs only when its main
    thread returns from C++, which it never did)."""
    assert hung["previous"][1].split() == [str(configured_signal())]


@pytest.mark.slow
def test_flight_recorder_dump_saved_at_capture(hung: dict) -> None:
    """Each capture names the Flight Recorder dump saved beside it while the ranks hung (one
    per rank before any ending); the all-gather rank 0 waits in is the one not completed."""
    run_dir = hung["run_dir"]
    assert all(len(sizes) == 1 and sizes[0] > 0 for sizes in hung["dump_sizes"].values())
    for rank, captures in read_stacks(run_dir).items():
        name = captures[0].flight_recorder
        assert name is not None and (run_dir / "dumps" / f"rank={rank}" / name).is_file()
    entries = flight_recorder.read_dumps(run_dir)
    named = flight_recorder.not_completed(entries, read_folded(run_dir, "collectives", [0, 1]))
    assert list(named["rank"]) == [0] and list(named["kind"]) == ["all_gather"]
    # The verdict quotes it: the capture, taken before the verdict, is what names the collective.
    found = fsdptrace.analyze(run_dir, ["stalled-rank"]).findings
    waiter = found[found["rank"] == 0]["message"].iloc[0]
    assert "; Flight Recorder: rank 0 never completed collective " in waiter, waiter


@pytest.mark.slow
def test_load_and_report_show_the_stacks(hung: dict, tmp_path: Path) -> None:
    """``fsdptrace.load(...).stacks`` holds the captures; the report shows each distinct
    training-thread stack as a collapsed block, the odd rank first."""
    trace = fsdptrace.load(hung["run_dir"])
    assert sorted(trace.stacks) == [0, 1]
    assert trace.stacks[1][0].main_frames == read_stacks(hung["run_dir"])[1][0].main_frames
    blocks = stack_blocks(trace.stacks)
    assert [b["ranks"] for b in blocks] == ["0", "1"]  # one rank each: by rank
    page = tmp_path / "report.html"
    result = CliRunner().invoke(cli, ["report", str(hung["run_dir"]), "-o", str(page)])
    assert result.exit_code == 0, result.output
    html = page.read_text()
    assert '<section id="stacks">' in html and '<details class="stack">' in html
    assert "stop (ending_job.py:" in html and "foreach_all_gather" in html


@pytest.mark.slow
def test_damaged_capture_files_are_skipped_with_their_name(hung: dict, tmp_path: Path) -> None:
    """A capture cut short is read as far as it goes; one without our header, or a link
    planted under a capture's name, is skipped with a warning naming it; the report still
    writes, without a traceback."""
    run_dir = tmp_path / "run"
    subprocess.run(["cp", "-r", str(hung["run_dir"]), str(run_dir)], check=True)
    cut = sorted((run_dir / "dumps" / "rank=0").glob(stack_dumps.CAPTURE_PATTERN))[0]
    cut.write_bytes(cut.read_bytes()[:900])
    bad = run_dir / "dumps" / "rank=1" / "stacks-20000101T000000.000000Z.txt"
    bad.write_bytes(b"\x00\xff garbage")
    link = run_dir / "dumps" / "rank=1" / "stacks-20000101T000001.000000Z.txt"
    link.symlink_to("/dev/zero")
    with pytest.warns(SkippedDumpWarning) as warned:
        stacks = read_stacks(run_dir)
    assert sorted(str(w.message).split(":")[0].rsplit("/", 1)[1] for w in warned) == [
        bad.name, link.name]
    assert stacks[0][0].threads and len(stacks[1]) == 1
    result = CliRunner().invoke(cli, ["report", str(run_dir), "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    # One line each, as every warning of fsdptrace's (no source line of ours beneath it).
    said = [line for line in result.stderr.splitlines() if not line.startswith("wrote ")]
    assert len(said) == 2 and all(line.startswith("fsdptrace: warning: ") and
                                  "not an fsdptrace stack capture" in line for line in said), said


@pytest.mark.slow
def test_clean_run_leaves_no_stack_file(tmp_path: Path) -> None:
    """The live stack file, opened at attach, is removed by the writer process when nothing
    was dumped into it: a clean run's dumps folder holds no file (its rank folders go too)."""
    results = run_scenarios(tmp_path, ["clean"], timeout_s=180)
    assert all(r.returncode == 0 for r in results), results[0].output[-2000:]
    assert not list((tmp_path / "clean").rglob("*stacks*"))
    assert not list((tmp_path / "clean" / "dumps").rglob("*"))


def test_capture_without_live_ranks_is_empty(tmp_path: Path) -> None:
    """A run dir with no process to signal (another host's, or all ended) captures nothing;
    a live file whose pid now belongs to another process is never signalled."""
    folder = tmp_path / "dumps" / "rank=0"
    folder.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        header = stack_dumps.LIVE_HEADER.format(
            rank=0, pid=sleeper.pid, host=socket.gethostname(),
            signal=int(signal.SIGTERM), start=1, main=0)
        (folder / stack_dumps.LIVE_FILE.format(pid=sleeper.pid)).write_text(header)
        assert capture_stacks(tmp_path, timeout_s=0.5) == {}
        assert sleeper.poll() is None  # its start time is not the header's: left alone
    finally:
        sleeper.kill()
        sleeper.wait()
    assert capture_stacks(tmp_path / "missing", timeout_s=0.1) == {}


@pytest.mark.parametrize(("setting", "expected"), [
    ("", signal.SIGRTMIN + 9), ("SIGRTMIN+3", signal.SIGRTMIN + 3),
    ("sigrtmax-2", signal.SIGRTMAX - 2), ("SIGUSR2", signal.SIGUSR2), ("50", 50),
    ("off", None)])
def test_stack_signal_setting(setting: str, expected: int | None) -> None:
    assert configured_signal(setting) == expected


@pytest.mark.parametrize("setting", ["SIGRTMIN+99", "SIGRTMIN-1", "SIGNOPE", "SIG_DFL", "x"])
def test_bad_stack_signal_setting_says_how(setting: str) -> None:
    with pytest.raises(FsdptraceError, match="FSDPTRACE_STACK_SIGNAL.*SIGRTMIN\\+<n>"):
        configured_signal(setting)


_PLAIN_PROCESS = """
import faulthandler, os, signal, socket, sys, threading, time
from fsdptrace.store import stack_dumps
from fsdptrace.record.stack_dump import configured_signal, process_start
signum = configured_signal()
fd = os.open(os.path.join(sys.argv[1], stack_dumps.LIVE_FILE.format(pid=os.getpid())),
             os.O_WRONLY | os.O_CREAT | os.O_APPEND)
os.write(fd, stack_dumps.LIVE_HEADER.format(
    rank=3, pid=os.getpid(), host=socket.gethostname(), signal=signum,
    start=process_start(os.getpid()), main=threading.main_thread().ident).encode())
faulthandler.register(signum, file=fd, all_threads=True, chain=False)
def waiting_here():
    print("ready", flush=True)  # from inside: the signal may come at once
    time.sleep(60)
waiting_here()
"""


def test_dump_without_end_line_is_kept_once_it_settles(tmp_path: Path) -> None:
    """A process whose signal thread cannot end the dump (here: faulthandler alone, no
    fsdptrace signal thread) still gets its stacks kept, once the file stops growing, marked
    incomplete; the report says so."""
    folder = tmp_path / "dumps" / "rank=3"
    folder.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", _PLAIN_PROCESS, str(folder)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        started = time.monotonic()
        paths = capture_stacks(tmp_path, timeout_s=15.0)
        took_s = time.monotonic() - started
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    assert sorted(paths) == [3] and SETTLE_S <= took_s < 15.0
    (capture,) = read_stacks(tmp_path)[3]
    assert not capture.complete and capture.flight_recorder is None
    assert capture.main_frames[0].startswith("waiting_here (<string>:")
    (block,) = stack_blocks({3: [capture]})
    assert block["ranks"] == "3" and not block["complete"]
