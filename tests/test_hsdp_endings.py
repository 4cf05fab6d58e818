"""How an HSDP rank ended, and where: real hyper_parallel jobs (2 ranks, gloo, CPU) stopped the
ways jobs stop, read as on FSDP2.

``tests/jobs_scripts/hsdp_cases.py --ending``: rank 1 stops inside ``layers.1``'s forward at
step 2, micro-step 0 (hangs or raises; FSDP2's twin: ``ending_job.py`` and
``test_endings_jobs.py``), or skips ``layers.2`` there. The tests assert structured fields,
each rank's ending (``endings.rank_endings``) and each stalled-rank finding's rank and stop
point, not message text (the verdict's wording is its own).

What hyper_parallel does here, observed in these jobs: rank 0 runs on to ``layers.3``'s
forward of the same pass and waits there for the gather of ``layers.3`` that ``layers.2``
prefetched and rank 1 never issued. When rank 1's process ends (SIGKILL, an exception), gloo
closes its connection and rank 0's wait raises ("Connection closed by peer"): rank 0 crashes
where it waited. A rank that skips ``layers.2`` hangs both: the forward gathers pair up (equal
shapes), rank 0 waits in its backward for a reduce-scatter rank 1 never issues (at
``layers.0``) while rank 1 runs on into the next micro-step's forward. A rank that gathers a
unit once more than the other (``extra-gather``) hangs both too, a step later: every later
collective meets the wrong partner, and at step 2 rank 0's backward reduce-scatters wait for
rank 1's forward all-gathers. SIGABRT sent to rank 0 while it waits for its gather kills it with
that signal, its main thread's stack inside hyper_parallel's wait.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from subprocess import Popen

import pytest

import fsdptrace
from fsdptrace.errors import RunDirError
from fsdptrace.reading import endings, flight_recorder
from fsdptrace.store import fatal_signals, watch_records
from fsdptrace.store.fatal_signals import FR_PATTERN
from tests.jobs import kill_all, start_ranks
from tests.jobs_scripts.tables import read_folded, read_table
from tests.test_hsdp import BACKWARD, FORWARD, real_hsdp

pytestmark = [real_hsdp, pytest.mark.slow,
              pytest.mark.filterwarnings("error::fsdptrace.reading.chunk_gaps.SkippedChunkWarning")]

SCRIPT = "tests/jobs_scripts/hsdp_cases.py"
STOP = (2, 0, "forward", "layers.1")  # where rank 1 stops (hsdp_cases.STOP_STEP)
WAITED = (2, 0, "forward", "layers.3")  # where rank 0 waits for it
KILLED = ("killed or hung", "")
Stop = tuple[int, int, str, str]


def _start(out: Path, case: str) -> list[Popen]:
    return start_ranks([SCRIPT, "--out", str(out), "--ending", case])


def _wait_truth(out: Path, deadline_s: float = 180.0) -> Stop:
    deadline = time.monotonic() + deadline_s
    path = out / "truth.json"
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return tuple(json.loads(path.read_text()))  # type: ignore[return-value]
        time.sleep(0.2)
    raise AssertionError(f"rank 1 never reached its stop: {out}")


def _endings(run_dir: Path) -> dict[int, tuple[str, str]]:
    found = endings.rank_endings(read_folded(run_dir, "markers", [0, 1]), [0, 1])
    return {int(r): (str(e), str(d)) for r, e, d in
            zip(found["rank"], found["ending"], found["detail"], strict=True)}


def _stops(run_dir: Path) -> dict[int, Stop]:
    """Each stalled-rank finding's rank and stop point (step, micro-step, phase, unit)."""
    found = fsdptrace.analyze(run_dir).findings
    stalled = found[found["check"] == "stalled-rank"]
    return {int(r["rank"]): (int(r["step"]), int(r["micro_step"]), str(r["phase"]),
                             str(r["unit"])) for _, r in stalled.iterrows()}


def _wait_stops(run_dir: Path, expected: dict[int, Stop], deadline_s: float = 120.0
                ) -> dict[int, Stop]:
    """Analyze the running job until every rank's expected stop has reached the analysis (its
    writer processes may not have written the run dir's first chunks yet)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            stops: dict[int, Stop] | str = _stops(run_dir)
        except RunDirError as error:
            stops = str(error)
        if stops == expected:
            return stops  # type: ignore[return-value]
        assert time.monotonic() < deadline, stops
        time.sleep(0.5)


def _progress(stop: Stop) -> tuple[int, int, int, int]:
    step, micro, phase, unit = stop
    order = FORWARD if phase == "forward" else BACKWARD
    return step, micro, int(phase == "backward"), order.index(unit)


def _wait_exit(procs: list[Popen], timeout_s: float = 60.0) -> None:
    try:
        for proc in procs:
            proc.wait(timeout=timeout_s)
    finally:
        kill_all(procs)


def test_one_hang_reads_the_same_while_hanging_after_sigterm_and_after_sigkill(
        tmp_path: Path) -> None:
    """FSDP2's twin: ``test_endings_jobs.py`` (the same test). Run twice (the hang is
    deterministic): read while hanging, then after SIGTERM to both ranks; and after SIGKILL
    to rank 1. Rank 1 is furthest behind in every read; SIGTERM is ``terminated`` on both
    ranks, SIGKILL ``killed or hung`` on rank 1, and rank 0, whose wait gloo then aborts,
    ``crashed`` where it waited."""
    expected = {1: STOP, 0: WAITED}
    procs = _start(tmp_path / "a", "hang")
    try:
        assert _wait_truth(tmp_path / "a") == STOP
        hanging = _wait_stops(tmp_path / "a" / "run", expected)
        assert set(_endings(tmp_path / "a" / "run").values()) == {KILLED}  # still running
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        _wait_exit(procs)
    finally:
        kill_all(procs)
    assert [proc.returncode for proc in procs] == [-signal.SIGTERM] * 2
    after_sigterm = _stops(tmp_path / "a" / "run")
    assert _endings(tmp_path / "a" / "run") == {0: ("terminated", "SIGTERM"),
                                                1: ("terminated", "SIGTERM")}

    procs = _start(tmp_path / "b", "hang")
    try:
        _wait_truth(tmp_path / "b")
        _wait_stops(tmp_path / "b" / "run", expected)
        procs[1].send_signal(signal.SIGKILL)
        _wait_exit(procs)
    finally:
        kill_all(procs)
    after_sigkill = _stops(tmp_path / "b" / "run")
    ended = _endings(tmp_path / "b" / "run")
    assert ended[1] == KILLED
    assert ended[0][0] == "crashed" and "Connection closed by peer" in ended[0][1]
    assert hanging == after_sigterm == after_sigkill == expected
    assert min(expected, key=lambda rank: _progress(expected[rank])) == 1  # furthest behind
    for run in ("a", "b"):
        checks = set(fsdptrace.analyze(tmp_path / run / "run").findings["check"])
        assert checks == {"stalled-rank"}, checks


def test_an_exception_is_crashed_where_it_was_raised(tmp_path: Path) -> None:
    """FSDP2's twin: ``test_uncaught_exception_under_torchrun_is_crashed``. Rank 1 raises in
    ``layers.1``'s forward; rank 0's wait for it is aborted by gloo: both crashed, each with
    its own exception, rank 1 furthest behind."""
    procs = _start(tmp_path, "raise")
    _wait_exit(procs, timeout_s=180)
    assert all(proc.returncode != 0 for proc in procs)
    run_dir = tmp_path / "run"
    ended = _endings(run_dir)
    assert ended[1] == ("crashed", "RuntimeError: planted failure in layers.1")
    assert ended[0][0] == "crashed" and "Connection closed by peer" in ended[0][1]
    assert _stops(run_dir) == {1: STOP, 0: WAITED}
    assert set(fsdptrace.analyze(run_dir).findings["check"]) == {"stalled-rank"}


def test_a_rank_that_skips_a_unit_hangs_both_and_is_the_one_found_diverged(
        tmp_path: Path) -> None:
    """Rank 1 runs step 2, micro-step 0's forward without ``layers.2``. Both ranks hang (see
    the module docstring) at different places: rank 0 in that micro-step's backward, rank 1 in
    the next micro-step's forward, so rank 0 is *behind* and only the divergence before the
    stop tells the culprit. The per-rank checks name rank 1 there (its configured prefetch of
    ``layers.2`` that did not run, its order that changed), and the recorded orders hold the
    difference the cross-rank verdict compares; with two ranks the contract names no majority
    side. Read while hanging and after SIGKILL: the same stops, both ``killed or hung``."""
    expected = {0: (2, 0, "backward", "layers.0"), 1: (2, 1, "forward", "<root>")}
    procs = _start(tmp_path, "skip")
    try:
        assert _wait_truth(tmp_path) == STOP
        hanging = _wait_stops(tmp_path / "run", expected)
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        _wait_exit(procs)
    finally:
        kill_all(procs)
    run_dir = tmp_path / "run"
    assert _stops(run_dir) == hanging == expected
    assert _endings(run_dir) == {0: KILLED, 1: KILLED}
    found = fsdptrace.analyze(run_dir).findings
    diverged = found[found["check"].isin(["prefetch-order", "order-instability"])]
    assert set(zip(diverged["check"], diverged["rank"], diverged["step"],
                   diverged["micro_step"], diverged["target"], strict=True)) == {
        ("prefetch-order", 1, 2, 0, "layers.2"), ("order-instability", 1, 2, 0, "layers.2")}
    forward = _orders(run_dir, 2, 0, "forward")
    assert forward == {0: FORWARD, 1: [u for u in FORWARD if u != "layers.2"]}


def _orders(run_dir: Path, step: int, micro: int, phase: str) -> dict[int, list[str]]:
    events = read_table(run_dir, "events")
    rows = events[(events["step"] == step) & (events["micro_step"] == micro)
                  & (events["phase"] == phase)].sort_values("seq")
    return {int(rank): list(group["unit"].astype(str))
            for rank, group in rows.groupby("rank", observed=True)}



def test_sigabrt_while_waiting_for_a_gather_is_an_ending_with_its_stack(tmp_path: Path) -> None:
    """FSDP2's twin: ``test_records_v3_fatal.py``'s SIGABRT inside a collective. Rank 1 hangs
    inside ``layers.1``'s forward; rank 0, waiting for ``layers.3``'s gather, gets SIGABRT: it
    exits -SIGABRT, its ending names the signal, its main thread's stack shows hyper_parallel's
    ``wait_for_unshard`` above the job's training loop (``ending``), and the stalled-rank
    verdict quotes the innermost frames."""
    procs = _start(tmp_path, "hang")
    try:
        _wait_truth(tmp_path)
        _wait_stops(tmp_path / "run", {1: STOP, 0: WAITED})
        procs[0].send_signal(signal.SIGABRT)
        procs[0].wait(timeout=60)
    finally:
        kill_all(procs)
    assert procs[0].returncode == -signal.SIGABRT
    run_dir = tmp_path / "run"
    ending, detail = _endings(run_dir)[0]
    assert ending == endings.FATAL_SIGNAL
    assert detail.startswith("SIGABRT; innermost frames: ")
    dump = fatal_signals.read_fatal_dump(run_dir, 0)
    assert dump is not None and dump.signal == "SIGABRT"
    assert "in wait_for_unshard" in dump.stack, dump.stack
    assert "in ending" in dump.stack  # the job's training loop, below hyper_parallel's frames
    found = fsdptrace.analyze(run_dir).findings
    stalled = found[found["check"] == "stalled-rank"]
    assert _stops(run_dir)[0] == WAITED
    message = str(stalled.loc[stalled["rank"] == 0, "message"].iloc[0])
    assert "died by SIGABRT; innermost frames: " + ", ".join(dump.innermost) in message


def test_a_rank_that_gathers_once_more_is_found_by_its_collective_count(tmp_path: Path) -> None:
    """FSDP2's twin: ``test_skipped_layer_issues_one_all_gather_fewer``. Rank 1 gathers
    ``layers.2`` once more after step 1's last backward (two per-parameter all-gathers, phase
    forward as no backward runs): in step 1, micro-step 1's forward rank 0 issued 10
    collectives where rank 1 issued 12, with the same unit order, so only the count tells.
    Both ranks then hang in step 2 (see the module docstring); read while hanging and after
    SIGKILL, the verdict's root cause is that count, both sides named (two ranks: no
    majority), the first all-gather without a partner ``layers.2``'s."""
    cause = ("first collective count: in step 1, micro-step 1, forward, rank 0 issued 10 FSDP "
             "collective(s) on process group ")
    unpaired = "where rank 1: 12; the first without a partner is the all_gather of layers.2"
    procs = _start(tmp_path, "extra-gather")
    run_dir = tmp_path / "run"
    try:
        deadline, previous = time.monotonic() + 240, None
        while not (hanging := _verdicts(run_dir)) or hanging != previous:  # stopped moving
            assert time.monotonic() < deadline, f"the ranks never hung in step 2: {hanging}"
            previous = hanging
            time.sleep(2.0)
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        _wait_exit(procs)
    finally:
        kill_all(procs)
    after = _verdicts(run_dir)
    assert set(after) == {0, 1} and after == hanging
    for message in after.values():
        assert cause in message and unpaired in message, message
        assert "no majority (ranks 0, 1 each differ from another side)" in message
    assert {step for step, *_ in _stops(run_dir).values()} == {2}
    assert _endings(run_dir) == {0: KILLED, 1: KILLED}


def _verdicts(run_dir: Path) -> dict[int, str]:
    """Each rank's stalled-rank message once both ranks are seen stopped in step 2 (the hang);
    {} before that or while the run dir has no chunk yet."""
    try:
        found = fsdptrace.analyze(run_dir).findings
    except RunDirError:
        return {}
    stalled = found[(found["check"] == "stalled-rank") & (found["step"] == 2)]
    if len(stalled) < 2:
        return {}
    return {int(r): str(m) for r, m in zip(stalled["rank"], stalled["message"], strict=True)}


def test_flight_recorder_dump_names_the_gathers_left_open(tmp_path: Path) -> None:
    """FSDP2's twin: ``test_flight_recorder_dump_names_the_hung_collective``. The hang, then
    SIGTERM to both ranks with the Flight Recorder on: each rank's dump is in the run dir, and
    every collective it shows as not completed joins a recorded all-gather by (group, number),
    so the locally counted numbers are the Flight Recorder's. Observed: the open ones are rank
    0's two last, the per-parameter gathers (weight, then bias) of ``layers.3`` it waits for,
    prefetched by ``layers.2`` in step 2's forward, and the verdict quotes one of them."""
    procs = start_ranks([SCRIPT, "--out", str(tmp_path), "--ending", "hang"],
                        env={"TORCH_FR_BUFFER_SIZE": "2000"})
    try:
        _wait_truth(tmp_path)
        _wait_stops(tmp_path / "run", {1: STOP, 0: WAITED})
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        _wait_exit(procs)
    finally:
        kill_all(procs)
    run_dir = tmp_path / "run"
    for rank in (0, 1):
        assert len(list((run_dir / "dumps" / f"rank={rank}").glob(FR_PATTERN))) == 1
    named = flight_recorder.not_completed(flight_recorder.read_dumps(run_dir),
                                          read_folded(run_dir, "collectives", [0, 1]))
    recorded = read_folded(run_dir, "collectives", [0]).sort_values("seq")
    # Rank 0's last two recorded collectives: what it issued last is what never completed.
    assert list(named["collective_seq"]) == list(recorded["collective_seq"].iloc[-2:])
    assert set(zip(named["rank"], named["step"], named["phase"], named["unit"], named["kind"],
                   named["issuer_kind"], named["issuer_unit"], strict=True)) == {
        (0, 2, "forward", "layers.3", "all_gather", "prefetch", "layers.2")}
    found = fsdptrace.analyze(run_dir, ["stalled-rank"]).findings
    verdict = found[found["rank"] == 0]["message"].iloc[0]
    assert "Flight Recorder: rank 0 never completed collective " in verdict
    assert any(description in verdict for description in named["description"])


def test_the_watcher_gives_the_verdict_and_stacks_of_a_live_hsdp_hang(tmp_path: Path) -> None:
    """``fsdptrace watch`` on an HSDP job (FSDP2's twin: ``test_watch_jobs.py``'s rank asleep
    in a forward): rank 1 sleeps in ``layers.1``'s forward, rank 0 waits for the gather of
    ``layers.3``. While both ranks are alive the watcher prints the stalled-rank verdict with
    rank 1 furthest behind, and takes every rank's stack: rank 1's in the job's own ``stop``
    hook, rank 0's inside hyper_parallel's wait for the gather (observed innermost:
    ``wait_for_unshard (param.py)`` under ``hsdp_state.wait_for_unshard``)."""
    from tests.test_watch_jobs import _read_verdict, _watcher

    run_dir = tmp_path / "run"
    procs = _start(tmp_path, "hang")
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "journal").is_dir():
            assert time.monotonic() < deadline, "the job never started recording"
            time.sleep(0.2)
        watcher = _watcher(run_dir)
        try:
            text = "".join(_read_verdict(watcher, procs))
            assert watcher.wait(timeout=120) == 1
        finally:
            kill_all([watcher])
    finally:
        kill_all(procs)
    assert "fsdptrace: hang detected at " in text
    assert "rank 1 | step 2 | micro-step 0 | forward | layers.1" in text, text
    assert "it is furthest behind (likely culprit of a hang)" in text, text
    [record] = watch_records.read_hangs(run_dir)
    assert sorted(record["stacks"]) == ["0", "1"], record
    stacks = fsdptrace.load(run_dir).stacks
    sleeper, waiter = stacks[1][-1].main_frames, stacks[0][-1].main_frames
    assert sleeper[0].startswith("stop (hsdp_cases.py:"), sleeper
    assert waiter[0].startswith("wait_for_unshard (param.py:"), waiter  # hyper_parallel's
