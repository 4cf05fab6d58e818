"""The hang verdict on real FSDP2 jobs (gloo, CPU, 2 and 4 ranks) whose ranks do something
different just before they stop (``tests/jobs_scripts/verdict_job.py``), and their clean twins.

What FSDP2 and gloo did in each job, measured on torch 2.13 CPU, is in each test's docstring.
Every unit of the jobs' model has the same shape, so gloo pairs mismatched all-gathers
silently: a divergence shows up later, as a timeout (8 s here) or a hang.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pandas as pd
import pytest

import fsdptrace
from fsdptrace.errors import RunDirError
from tests.jobs import assert_ok, case_result, how_terminated, kill_all, run_ranks, start_ranks

pytestmark = [pytest.mark.slow]

SCRIPT = "tests/jobs_scripts/verdict_job.py"
CASES = ["drop_expert", "skip_layer", "extra_eval", "eval_rank0", "nosync_stall", "dead_edge",
         "skip_backward", "extra_micro_step", "early_stop", "wrap_differs"]


def _run(out: Path, case: str, *, nproc: int = 2) -> Path:
    run_ranks([SCRIPT, "--out", str(out), "--case", case], nproc=nproc, timeout_s=300)
    return out / case


def _stalled(found: pd.DataFrame) -> dict[int, str]:
    rows = found[found["check"] == "stalled-rank"]
    return dict(zip(rows["rank"].astype(int), rows["message"], strict=True))


def _verdict(message: str) -> str:
    """What a stalled-rank message says after the ending: where, and the classification."""
    return message.split("; stopped at ", 1)[1]


def _nothing_from(found: pd.DataFrame, step: int, micro: int, phase: str) -> None:
    """No finding but stalled-rank from a cut-off pass."""
    other = found[found["check"] != "stalled-rank"]
    hit = other[(other["step"] == step) & (other["micro_step"] == micro)
                & (other["phase"] == phase)]
    assert hit.empty, hit[["check", "rank", "message"]].to_string()


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case with all ranks doing the same, one launch."""
    out = tmp_path_factory.mktemp("verdict_clean")
    assert_ok(run_ranks([SCRIPT, "--out", str(out), "--case", ",".join(CASES), "--clean"],
                        timeout_s=400))
    return out


@pytest.mark.parametrize("case", CASES)
def test_clean_twins_have_no_findings(clean: Path, case: str) -> None:
    """Every rank doing the same: nothing to report. One exception FSDP2 itself makes: in the
    backward after eval forwards, its implicit prefetch gathers ``head`` once more and drops
    it unused (check 8's warning on every rank, not the verdict's business)."""
    found = fsdptrace.analyze(clean / case).findings
    if case in ("extra_eval", "eval_rank0"):
        found = found[found["check"] != "wasted-prefetch"]
    assert found.empty, found[["check", "rank", "message"]].to_string()


def test_an_expert_dropped_on_one_rank(tmp_path: Path) -> None:
    """Rank 1 skips ``moe.experts.1`` in step 1, micro-step 0. Both ranks complete that
    forward (the same-shaped all-gathers pair up wrongly without an error); in its backward
    both wait in gloo, and the first 8 s timeout to fire ends that rank, whose peer then times
    out too or loses it ("Connection closed by peer"): which rank comes first is a race. The
    forward of (1, 0) is compared (only the backward was cut off) and, with two ranks, names
    no outlier; the verdict names that divergence as the root cause."""
    run_dir = _run(tmp_path, "drop_expert")
    errors = [case_result(run_dir, rank)["error"] for rank in (0, 1)]
    assert any("Timed out" in error for error in errors), errors
    assert all("Timed out" in error or "Connection closed by peer" in error
               for error in errors), errors
    found = fsdptrace.analyze(run_dir).findings
    divergence = found[found["check"] == "rank-divergence"]
    assert set(zip(divergence["rank"], divergence["step"], divergence["micro_step"],
                   divergence["phase"], divergence["unit"], divergence["target"],
                   strict=True)) == {
        (0, 1, 0, "forward", "moe.experts.1", "head"),
        (1, 1, 0, "forward", "head", "moe.experts.1")}
    assert divergence["message"].str.contains("no majority: the 2 ranks disagree").all()
    stalled = _stalled(found)
    assert set(stalled) == {0, 1}
    for message in stalled.values():
        assert ", micro-step 0, backward, last unit entered " in message
        assert ("root cause: the ranks diverged before the stop with no majority (ranks 0, 1 "
                "each differ from another side), first rank-divergence: rank 0 ran "
                "moe.experts.1 at index 6 of step 1, micro-step 0 forward") in message
    _nothing_from(found, 1, 0, "backward")


@pytest.mark.parametrize("nproc", [2, 4])
def test_one_extra_eval_batch_on_rank_0(tmp_path: Path, nproc: int) -> None:
    """After step 1 rank 0 runs a 3rd eval batch; the others go on training. Its eval
    all-gathers pair with their training all-gathers (same shapes), and a gloo recv or send
    times out in step 2. Rank 0 is the culprit with 4 ranks (3 ranks ran 2 batches); with 2
    both sides are given. Either way the root cause is eval interval 2, not a furthest-behind
    rank."""
    run_dir = _run(tmp_path, "extra_eval", nproc=nproc)
    found = fsdptrace.analyze(run_dir).findings
    stalled = _stalled(found)
    assert set(stalled) == set(range(nproc))
    for rank, message in stalled.items():
        assert "eval interval 2" in _verdict(message)
        assert "furthest behind" not in message and "stall is inside" not in message
        if nproc == 2:
            assert "the ranks diverged before the stop with no majority" in message
        elif rank == 0:
            assert "root cause: this rank diverged before the stop (likely culprit)" in message
        else:
            assert "root cause: rank 0 diverged before the stop (likely culprit)" in message
    evals = found[found["check"] == "eval-divergence"]
    assert set(evals["rank"]) <= ({0} if nproc == 4 else {0, 1})


def test_eval_on_rank_0_only(tmp_path: Path) -> None:
    """Rank 0 validates after step 0, rank 1 goes on to step 1: rank 0's eval all-gathers
    pair with rank 1's training ones until a gloo recv times out. Rank 0 stopped inside eval
    interval 1 (cut off, so no eval-divergence); the verdict compares it with rank 1's
    complete, empty interval 1 and, with two ranks, blames neither."""
    run_dir = _run(tmp_path, "eval_rank0")
    found = fsdptrace.analyze(run_dir).findings
    assert set(found["check"]) == {"stalled-rank"}, found[["check", "message"]].to_string()
    stalled = _stalled(found)
    assert "stopped at eval forward " in stalled[0] and "of eval interval 1" in stalled[0]
    for message in stalled.values():
        assert ("the ranks diverged before the stop with no majority (ranks 0, 1 each differ "
                "from another side), first inside the stopped eval interval (eval interval 1"
                in message)
        assert "rank 0 ran <root> at index 0 where rank 1 (no majority" in message


def test_a_backward_left_out_on_one_rank(tmp_path: Path) -> None:
    """Rank 1 of 4 skips step 1's backward and optimizer step (a bad loss) and runs the next
    forward. Its all-gathers pair with the others' backward collectives (same shapes) until
    every rank times out (8 s): ranks 0, 2 and 3 in the backward of (1, 0), rank 1 in the
    forward of (1, 1). No order differs (rank 1 has no backward to compare); the verdict names
    rank 1, which went on past a pass the others ran, not a rank that waited."""
    run_dir = _run(tmp_path, "skip_backward", nproc=4)
    assert case_result(run_dir, 1)["skipped"] == 1
    found = fsdptrace.analyze(run_dir).findings
    assert set(found["check"]) == {"stalled-rank"}, found[["check", "message"]].to_string()
    stalled = _stalled(found)
    assert set(stalled) == {0, 1, 2, 3}
    cause = ("first a pass skipped: rank 1 recorded nothing of step 1, micro-step 0, backward "
             "and went on past it (rank 1's last record: step 1, micro-step 1, forward")
    assert "root cause: this rank diverged before the stop (likely culprit), " + cause \
        in stalled[1]
    for rank in (0, 2, 3):
        assert "stopped at step 1, micro-step 0, backward" in stalled[rank]
        assert "root cause: rank 1 diverged before the stop (likely culprit), " + cause \
            in stalled[rank]
        assert "where 3 of 4 ranks (e.g. rank 0) ran it" in stalled[rank]


def test_a_micro_step_more_on_one_rank(tmp_path: Path) -> None:
    """Rank 0 of 4 accumulates three micro-steps in step 1, the others two. gloo pairs its
    extra micro-step's collectives with the others' next ones (same shapes), so ranks 1-3
    finish training and close their recordings cleanly on wrongly exchanged data; rank 0,
    one micro-step behind, times out in step 2's last forward. The verdict names rank 0 for
    the micro-step it ran that the others never did, not merely as the rank left behind."""
    run_dir = _run(tmp_path, "extra_micro_step", nproc=4)
    assert [case_result(run_dir, rank)["done"] for rank in (1, 2, 3)] == [[2, 1]] * 3
    found = fsdptrace.analyze(run_dir).findings
    assert set(found["check"]) == {"stalled-rank"}, found[["check", "message"]].to_string()
    stalled = _stalled(found)
    assert list(stalled) == [0]
    assert ("root cause: this rank diverged before the stop (likely culprit), first a pass "
            "skipped: rank 0 ran step 1, micro-step 2, forward where 3 of 4 ranks (e.g. rank "
            "1) recorded nothing of it and went on past it") in stalled[0]


def test_a_rank_that_stops_training_early(tmp_path: Path) -> None:
    """Rank 1 of 4 leaves the loop after step 1 (a local early-stopping rule) and its
    recording closes cleanly; it goes on to the job's final barrier, which no other rank
    reaches, and ranks 0, 2 and 3 time out (8 s) in the first all-gather of step 2, all at one
    place. Before, that read as a stall below ``layers.0`` (device, network); the verdict now
    names rank 1, which ran none of step 2."""
    run_dir = _run(tmp_path, "early_stop", nproc=4)
    assert case_result(run_dir, 1) == {"error": None, "done": 1}
    found = fsdptrace.analyze(run_dir).findings
    assert set(found["check"]) == {"stalled-rank"}, found[["check", "message"]].to_string()
    stalled = _stalled(found)
    assert set(stalled) == {0, 2, 3}
    for message in stalled.values():
        assert "stopped at step 2, micro-step 0, forward, last unit entered" in message
        assert ("root cause: rank 1 diverged before the stop (likely culprit), first a pass "
                "skipped: rank 1 recorded nothing of step 2, micro-step 0, forward and ended "
                "its recording cleanly before it (rank 1's last record: the boundary after "
                "optimizer step 1) where 3 of 4 ranks (e.g. rank 0) ran it") in message


def test_a_model_wrapped_differently_on_one_rank(tmp_path: Path) -> None:
    """On rank 1 of 4, ``head`` is not a unit of its own (the root's group holds it). In step
    0's forward the root's all-gather is larger on rank 1 and gloo pairs what it can; the ranks
    time out (8 s) in the backward. Their unit sets differ, so no order of rank 1 is compared
    with the others'; the parameters are the same, so the verdict names the wrapping."""
    run_dir = _run(tmp_path, "wrap_differs", nproc=4)
    found = fsdptrace.analyze(run_dir).findings
    stalled = _stalled(found)
    assert set(stalled) == {0, 1, 2, 3}, found[["check", "rank", "message"]].to_string()
    cause = ("first FSDP units wrapped differently: rank 1 holds the same parameters as 3 of 4 "
             "ranks (e.g. rank 0) in other units (no unit head: 7 units against 8)")
    assert "root cause: this rank diverged before the stop (likely culprit), " + cause \
        in stalled[1]
    for rank in (0, 2, 3):
        assert "root cause: rank 1 diverged before the stop (likely culprit), " + cause \
            in stalled[rank]


def test_an_edge_dead_for_two_reasons(tmp_path: Path) -> None:
    """``layers.1 -> layers.2`` (forward): in micro-step 0 ``layers.0`` had already prefetched
    ``layers.2`` (FSDP2 records a no-op, "pending"); in micro-steps 1-2 ``layers.2`` is still
    unsharded from the previous backward (``reshard_after_backward`` false), a no-op by
    design. The edge did no work in the step: one warning per rank naming ``layers.0``."""
    run_dir = _run(tmp_path, "dead_edge")
    found = fsdptrace.analyze(run_dir).findings
    assert set(zip(found["check"], found["rank"], found["phase"], found["unit"],
                   found["target"], strict=True)) == {
        ("redundant-prefetch", r, "forward", "layers.1", "layers.2") for r in (0, 1)}
    for message in found["message"]:
        assert "gathered by prefetch from layers.0" in message
        assert "at 2 other call(s) layers.2 stayed unsharded by design" in message


def _hang(out: Path, case: str, stoppers: list[int], sig: signal.Signals
          ) -> tuple[dict[int, str], dict[int, str]]:
    """Start a hanging job, analyze it while its ranks are alive and again after ``sig``."""
    procs = start_ranks([SCRIPT, "--out", str(out), "--case", case])
    run_dir = out / case
    try:
        deadline = time.monotonic() + 240
        while not all((run_dir / f"stopping.rank{r}").exists() for r in stoppers):
            assert time.monotonic() < deadline, "the job never reached its stop"
            assert all(p.poll() is None for p in procs), "a rank exited before hanging"
            time.sleep(0.5)
        alive = _settled(run_dir)
        assert all(p.poll() is None for p in procs), "analyzed while the ranks are alive"
        for proc in procs:
            proc.send_signal(sig)
        for proc in procs:
            proc.wait(timeout=60)
    finally:
        kill_all(procs)
    return alive, _stalled(fsdptrace.analyze(run_dir).findings)


def _settled(run_dir: Path) -> dict[int, str]:
    """The verdict once the recorders' writers have flushed: the same twice in a row."""
    last: dict[int, str] = {}
    for _ in range(30):
        time.sleep(2)
        try:
            now = _stalled(fsdptrace.analyze(run_dir).findings)
        except RunDirError:  # the writers have not flushed a first chunk yet
            continue
        if now and now == last:
            return now
        last = now
    raise AssertionError(f"the verdict never settled: {last}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_layer_skipped_on_one_rank(tmp_path: Path, sig: signal.Signals) -> None:
    """Rank 1 skips ``layers.2`` at step 1. Both ranks finish that forward (gloo pairs the
    same-shaped all-gathers) and hang in its backward, where the collectives no longer match
    and no error is raised. The verdict reads the same while hanging, after SIGTERM and after
    SIGKILL: the forward of (1, 0) diverged (index 3), neither rank blamed by its number."""
    alive, after = _hang(tmp_path, "skip_layer", [0, 1], sig)
    assert set(alive) == set(after) == {0, 1}
    ended = how_terminated(after) if sig == signal.SIGTERM else {}
    for rank in (0, 1):
        if ended.get(rank) != "peer gone":  # it says so instead of how it was stopped
            assert _verdict(alive[rank]) == _verdict(after[rank])
        assert "root cause: the ranks diverged before the stop with no majority" in alive[rank]
        assert "rank 0 ran layers.2 at index 3 of step 1, micro-step 0 forward" in alive[rank]
        assert ", micro-step 0, backward, last unit entered " in alive[rank]
    if sig == signal.SIGTERM:
        assert "terminated" in ended.values(), ended
        assert set(ended.values()) <= {"terminated", "peer gone"}, ended


def test_a_stall_mid_backward_in_a_no_sync_micro_step(tmp_path: Path) -> None:
    """Rank 1 blocks in a gradient hook right after ``layers.1``'s backward began, in the
    no-sync micro-step (1, 0). Its units kept their parameters after forward, so that backward
    issues no collective: rank 0 finishes the micro-step alone, records the settings of
    (1, 1) (gradient sync back on) and blocks in the first all-gather of its forward. No
    setting is compared at a point rank 1 never reached; the verdict names rank 1, furthest
    behind, while hanging and after SIGTERM alike."""
    alive, after = _hang(tmp_path, "nosync_stall", [1], signal.SIGTERM)
    assert set(alive) == {0, 1}
    for verdicts in (alive, after):
        assert ("stopped at step 1, micro-step 0, backward, last unit entered layers.1 "
                in verdicts[1])
        assert "; it is furthest behind (likely culprit of a hang)" in verdicts[1]
        assert "stopped at step 1, micro-step 1, forward, last unit entered " in verdicts[0]
        assert "rank 1 is further behind (likely culprit)" in verdicts[0]
    for rank in (0, 1):
        assert _verdict(alive[rank]) == _verdict(after[rank])
    found = fsdptrace.analyze(tmp_path / "nosync_stall").findings
    assert set(found["check"]) == {"stalled-rank"}, found[["check", "message"]].to_string()
