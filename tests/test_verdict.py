"""The hang verdict (check 6) and the cut-off rules of CHECKS.md v3, on hand-built tables.

Each trace is what the recorder writes for a shape of hang that real jobs produce (see
``tests/test_verdict_jobs.py`` for the jobs themselves): a rank that skipped a unit and then
stopped at the same unit as the others, a rank behind the others with nothing diverging, ranks
stopped at one place, stops in an eval forward and at a boundary, and the no-sync stall whose
settings one rank recorded after the other had stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from fsdptrace import analyze
from fsdptrace.checks.kernel.majority import against_majority, ranks_text
from fsdptrace.reading.trace import Trace
from fsdptrace.store import schema
from tests.trace_builder import ROOT, TraceBuilder, write_run_dir

UNITS = [ROOT, "a", "b", "c", "head"]
FORWARD, BACKWARD = schema.FORWARD, schema.BACKWARD


def _step_zero(b: TraceBuilder, rank: int) -> None:
    """A rank's meta and ``UNITS``, then step 0 whole: forward, backward, boundary."""
    b.meta(rank)
    for index, name in enumerate(UNITS):
        b.unit(rank, name, is_root=index == 0)
    b.marker(rank, 0, 0, schema.MARKER_MICRO_STEP)
    b.run(rank, 0, 0, FORWARD, UNITS)
    b.run(rank, 0, 0, BACKWARD, [ROOT, *reversed(UNITS[1:])])
    b.marker(rank, 0, 0, schema.MARKER_OPTIMIZER_STEP)


def _job(world_size: int, stops: dict[int, list[str]], *, skip: dict[int, str] | None = None
         ) -> TraceBuilder:
    """Step 0 whole on every rank; in step 1's forward rank r runs ``UNITS`` (less
    ``skip[r]``) and stops at ``stops[r]``'s last unit (the calls it recorded)."""
    b = TraceBuilder(world_size=world_size)
    for rank in range(world_size):
        _step_zero(b, rank)
        b.marker(rank, 1, 0, schema.MARKER_MICRO_STEP)
        b.run(rank, 1, 0, FORWARD, stops[rank])
    return b


def _two_steps(world_size: int, *, last_boundary: bool = True,
               backward: Callable[[int, int], list[str]] | None = None) -> TraceBuilder:
    """Steps 0 and 1 whole on every rank, each ending at its boundary (step 1's left out
    without ``last_boundary``); ``backward(rank, step)``: that pass's order, if not reversed."""
    b = TraceBuilder(world_size=world_size)
    for rank in range(world_size):
        b.meta(rank)
        for index, name in enumerate(UNITS):
            b.unit(rank, name, is_root=index == 0)
        for step in range(2):
            b.marker(rank, step, 0, schema.MARKER_MICRO_STEP)
            b.run(rank, step, 0, FORWARD, UNITS)
            b.run(rank, step, 0, BACKWARD, backward(rank, step) if backward
                  else [ROOT, *reversed(UNITS[1:])])
            if step == 0 or last_boundary:
                b.marker(rank, step, 0, schema.MARKER_OPTIMIZER_STEP)
    return b

def _stalled(trace: Trace) -> pd.DataFrame:
    found = analyze(trace).findings
    assert set(found["check"]) == {"stalled-rank"}, found[["check", "rank", "message"]]
    return found.set_index("rank")


def test_a_skipped_unit_inside_the_stopped_pass_is_the_root_cause() -> None:
    """Rank 2 skipped ``b`` and every rank stopped at ``head``: the stopped passes differ
    inside the part every rank recorded, so rank 2 is the culprit, not the network."""
    seen = [ROOT, "a", "b", "c", "head"]
    trace = _job(3, {0: seen, 1: seen, 2: [ROOT, "a", "c", "head"]}).build()
    stalled = _stalled(trace)
    assert sorted(stalled.index) == [0, 1, 2]
    culprit = stalled.loc[2, "message"]
    assert "root cause: this rank diverged before the stop (likely culprit)" in culprit
    assert ("inside the stopped pass (step 1, micro-step 0, forward, compared over the 4 "
            "call(s) every rank recorded): rank 2 ran c at index 2 where 2 of 3 ranks "
            "(e.g. rank 0) ran b") in culprit
    assert "root cause: rank 2 diverged before the stop" in stalled.loc[0, "message"]
    assert "stall is inside" not in " ".join(stalled["message"])


def test_two_ranks_that_disagree_give_both_sides() -> None:
    """With two ranks no side is a majority: the verdict blames neither rank number."""
    trace = _job(2, {0: [ROOT, "a", "b", "c", "head"], 1: [ROOT, "a", "c", "head"]}).build()
    stalled = _stalled(trace)
    for message in stalled["message"]:
        assert "the ranks diverged before the stop with no majority (ranks 0, 1" in message
        assert "no majority: the 2 ranks disagree, rank 0 | rank 1" in message
        assert "likely culprit" not in message


def test_no_divergence_names_the_rank_furthest_behind() -> None:
    trace = _job(3, {0: UNITS, 1: UNITS, 2: UNITS[:2]}).build()
    stalled = _stalled(trace)
    assert ("stopped at step 1, micro-step 0, forward, last unit entered a (position 1, call 1)"
            "; no rank diverged before the stop; it is furthest behind") in stalled.loc[2,
                                                                                      "message"]
    assert "rank 2 is further behind" in stalled.loc[0, "message"]


def test_the_same_stop_everywhere_is_a_stall_below_the_unit() -> None:
    trace = _job(2, {0: UNITS[:3], 1: UNITS[:3]}).build()
    for message in _stalled(trace)["message"]:
        assert "no rank diverged before the stop, so the stall is inside b's collective" \
            in message


def test_an_eval_stop_and_a_boundary_stop_are_places() -> None:
    """Rank 0 finished step 1 and stopped in its 2nd eval forward of interval 2; rank 1
    stopped right after optimizer step 1's boundary. Both are exact places, and rank 1 (at the
    boundary, before interval 2 began) is behind rank 0."""
    b = _two_steps(2)
    b.eval_forward(0, 2, ROOT)
    b.eval_forward(0, 2, "a")
    stalled = _stalled(b.build())
    assert ("stopped at eval forward 1 of eval interval 2 (after optimizer step 1), a"
            in stalled.loc[0, "message"])
    assert "stopped at the boundary after optimizer step 1; no rank diverged before the " \
        "stop; it is furthest behind" in stalled.loc[1, "message"]


@pytest.mark.parametrize("source", ["trace", "run_dir"])
def test_an_order_difference_before_an_eval_stop_is_found_read_back_too(
        source: str, tmp_path: Path) -> None:
    """Every rank ran step 1's backward, rank 0 in another order, then an eval forward before
    the optimizer step, and hung there. The backward passes are complete (the stops are eval
    forwards), so check 4 reports rank 0, on the trace and on the run dir alike: the reduce
    re-reads the orders it spells out, and read without the eval forwards, every rank seemed
    stopped in that backward, its order cut off and dropped, and the finding with it. The
    stops come after those backwards (eval interval 1 began at boundary 0, but these evals ran
    after step 1's passes), so the verdict names rank 0 as the cause."""
    backward = [ROOT, *reversed(UNITS[1:])]
    swapped = [ROOT, backward[2], backward[1], *backward[3:]]
    b = _two_steps(4, last_boundary=False,
                   backward=lambda rank, step: swapped if (rank, step) == (0, 1) else backward)
    for rank in range(4):
        b.eval_forward(rank, 1, ROOT)
    trace = b.build()
    found = (analyze(trace) if source == "trace"
             else analyze(write_run_dir(trace, tmp_path / "run"), jobs=1)).findings
    divergence = found[found["check"] == "rank-divergence"]
    assert list(divergence["rank"]) == [0], found[["check", "rank", "message"]]
    assert divergence["message"].iloc[0].startswith(
        f"rank 0 ran {backward[2]} at index 1 of step 1, micro-step 0 backward where 3 of 4 "
        f"ranks (e.g. rank 1) ran {backward[1]}")
    # The eval forwards ran after those backwards: the verdict traces every stop to rank 0.
    stalled = found[found["check"] == "stalled-rank"].set_index("rank")
    assert "root cause: this rank diverged before the stop (likely culprit), first " \
        "rank-divergence: rank 0 ran" in stalled.loc[0, "message"]
    for rank in (1, 2, 3):
        assert "root cause: rank 0 diverged before the stop" in stalled.loc[rank, "message"]

def _left_out(world_size: int, *, skipper: int = 1, aborted: bool = False) -> TraceBuilder:
    """Step 0 whole; in step 1 every rank runs micro-step 0's forward, then ``skipper`` goes
    on to micro-step 1's forward (stopping at ``b``) without a backward, ``aborted`` telling
    (``reset_iter_state()``), while the others stop at the root in micro-step 0's backward."""
    b = TraceBuilder(world_size=world_size)
    for rank in range(world_size):
        _step_zero(b, rank)
        b.marker(rank, 1, 0, schema.MARKER_MICRO_STEP)
        b.run(rank, 1, 0, FORWARD, UNITS)
        if rank != skipper:
            b.run(rank, 1, 0, BACKWARD, [ROOT])
            continue
        if aborted:
            b.marker(rank, 1, 0, schema.MARKER_ABORTED)
        b.marker(rank, 1, 1, schema.MARKER_MICRO_STEP)
        b.run(rank, 1, 1, FORWARD, [ROOT, "a", "b"])
    return b


@pytest.mark.parametrize("source", ["trace", "run_dir"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_backward_left_out_is_the_root_cause(source: str, world_size: int,
                                              tmp_path: Path) -> None:
    """A rank that skipped a backward (a bad loss) went on past a pass the others stopped in:
    with 4 ranks it is the culprit; with 2, both sides are given. No order differs, and the
    skipper is furthest ahead: without this, the verdict blamed the ranks that waited."""
    trace = _left_out(world_size).build()
    found = (analyze(trace) if source == "trace"
             else analyze(write_run_dir(trace, tmp_path / "run"), jobs=1)).findings
    assert set(found["check"]) == {"stalled-rank"}, found[["check", "rank", "message"]]
    stalled = found.set_index("rank")["message"]
    last = "(rank 1's last record: step 1, micro-step 1, forward, last unit entered b"
    for rank in range(world_size):
        if world_size == 2:
            assert ("the ranks diverged before the stop with no majority (ranks 0, 1 each "
                    "differ from another side), first a pass skipped: rank 0 ran step 1, "
                    "micro-step 0, backward; rank 1 recorded nothing of it and went on past "
                    f"it {last}") in stalled[rank]
        else:
            who = "this rank" if rank == 1 else "rank 1"
            assert (f"root cause: {who} diverged before the stop (likely culprit), first a "
                    "pass skipped: rank 1 recorded nothing of step 1, micro-step 0, backward "
                    f"and went on past it {last}") in stalled[rank]
            assert "where 3 of 4 ranks (e.g. rank 0) ran it" in stalled[rank]


def test_a_micro_step_more_on_one_rank_is_the_root_cause() -> None:
    """Rank 2 of 4 ran three micro-steps in step 1, the others two, and all stopped in step
    2's first forward: every pass compared is alike, but rank 2 ran two the others went past."""
    b = TraceBuilder(world_size=4)
    for rank in range(4):
        b.meta(rank)
        for index, name in enumerate(UNITS):
            b.unit(rank, name, is_root=index == 0)
        for step in range(2):
            for micro in range(3 if (rank, step) == (2, 1) else 2):
                b.marker(rank, step, micro, schema.MARKER_MICRO_STEP)
                b.run(rank, step, micro, FORWARD, UNITS)
                b.run(rank, step, micro, BACKWARD, [ROOT, *reversed(UNITS[1:])])
            b.marker(rank, step, 0, schema.MARKER_OPTIMIZER_STEP)
        b.marker(rank, 2, 0, schema.MARKER_MICRO_STEP)
        b.run(rank, 2, 0, FORWARD, [ROOT, "a"])
    stalled = _stalled(b.build())["message"]
    for rank in range(4):
        assert ("first a pass skipped: rank 2 ran step 1, micro-step 2, forward where 3 of 4 "
                "ranks (e.g. rank 0) recorded nothing of it and went on past it (rank 0's last "
                "record: step 2, micro-step 0, forward") in stalled[rank]
    assert "root cause: this rank diverged" in stalled[2]


@pytest.mark.parametrize("majority", ["ran", "ended"])
def test_a_rank_that_ended_early_is_the_root_cause(majority: str) -> None:
    """Rank 1 of 4 closed its recording cleanly after step 0 (it stopped training early, or
    its data ran out) while the others went on and stopped in step 1's forward: every rank
    that stopped did so at one place, which read as a stall below ``a`` (device, network).
    The rank that ended ran none of step 1: it is the culprit. With the majority ended, the
    one rank that went on is."""
    ended = {1} if majority == "ran" else {0, 1, 2}
    b = TraceBuilder(world_size=4)
    for rank in range(4):
        _step_zero(b, rank)
        if rank in ended:
            b.marker(rank, 1, 0, schema.MARKER_CLOSE)
            continue
        b.marker(rank, 1, 0, schema.MARKER_MICRO_STEP)
        b.run(rank, 1, 0, FORWARD, [ROOT, "a"])
    stalled = _stalled(b.build())["message"]
    assert sorted(stalled.index) == sorted(set(range(4)) - ended)
    for message in stalled:
        assert "stall is inside" not in message
        if majority == "ran":
            assert ("root cause: rank 1 diverged before the stop (likely culprit), first a "
                    "pass skipped: rank 1 recorded nothing of step 1, micro-step 0, forward and "
                    "ended its recording cleanly before it (rank 1's last record: the boundary "
                    "after optimizer step 0) where 3 of 4 ranks (e.g. rank 0) ran it") in message
        else:
            assert ("root cause: this rank diverged before the stop (likely culprit), first a "
                    "pass skipped: rank 3 ran step 1, micro-step 0, forward where 3 of 4 ranks "
                    "(e.g. rank 0) recorded nothing of it and ended its recording cleanly "
                    "before it") in message


def _wrapped(world_size: int, units: Callable[[int], dict[str, list[str]]]) -> TraceBuilder:
    """Step 0 whole with ``units(rank)`` (name -> parameter names, the root first); every
    rank stops at the root's backward of step 1."""
    b = TraceBuilder(world_size=world_size)
    for rank in range(world_size):
        b.meta(rank)
        mine = units(rank)
        for index, (name, params) in enumerate(mine.items()):
            b.unit(rank, name, is_root=index == 0, param_names=params)
        order = list(mine)
        b.marker(rank, 0, 0, schema.MARKER_MICRO_STEP)
        b.run(rank, 0, 0, FORWARD, order)
        b.run(rank, 0, 0, BACKWARD, [order[0], *reversed(order[1:])])
        b.marker(rank, 0, 0, schema.MARKER_OPTIMIZER_STEP)
        b.marker(rank, 1, 0, schema.MARKER_MICRO_STEP)
        b.run(rank, 1, 0, FORWARD, order)
        b.run(rank, 1, 0, BACKWARD, [order[0]])
    return b


def test_a_model_wrapped_differently_on_one_rank_is_the_root_cause() -> None:
    """Rank 2 of 4 did not wrap ``head`` as a unit (its root holds head's parameters): every
    FSDP collective after differs, and ranks of other unit sets are never compared, so the
    verdict read the same stop on every rank as a stall below the root. The parameters are
    the same on every rank, so the units are what differs: rank 2 is the culprit."""
    full = {name: [f"{name}.weight"] for name in UNITS}
    merged = {ROOT: [f"{ROOT}.weight", "head.weight"],
              **{n: [f"{n}.weight"] for n in UNITS[1:-1]}}
    stalled = _stalled(_wrapped(4, lambda rank: merged if rank == 2 else full).build())
    for rank, message in stalled["message"].items():
        who = "this rank" if rank == 2 else "rank 2"
        assert (f"root cause: {who} diverged before the stop (likely culprit), first FSDP "
                "units wrapped differently: rank 2 holds the same parameters as 3 of 4 ranks "
                "(e.g. rank 0) in other units (no unit head: 4 units against 5)") in message


def test_pipeline_stages_are_not_a_different_wrapping() -> None:
    """Ranks 0-1 hold stage 0 (``a``, ``b``), ranks 2-3 stage 1 (``c``, ``head``): other
    parameters, so no stage is said to wrap the model differently."""
    stages = [{ROOT: [f"{ROOT}.0"], "a": ["a.weight"], "b": ["b.weight"]},
              {ROOT: [f"{ROOT}.1"], "c": ["c.weight"], "head": ["head.weight"]}]
    stalled = _stalled(_wrapped(4, lambda rank: stages[rank // 2]).build())["message"]
    assert not stalled.str.contains("wrapped differently").any(), stalled.to_list()


def test_an_aborted_micro_step_is_no_skipped_pass() -> None:
    """The same stops, but the rank that left the backward out said so (``reset_iter_state()``
    aborted the micro-step): nothing is known of that pass on it, so no rank is blamed for
    skipping it; the verdict falls back to the rank furthest behind."""
    stalled = _stalled(_left_out(4, aborted=True).build())["message"]
    assert not stalled.str.contains("a pass skipped").any(), stalled.to_list()
    assert "no rank diverged before the stop; it is furthest behind" in stalled[0]


def test_a_completed_forward_of_the_stopped_micro_step_is_compared() -> None:
    """Rank 0 died in the backward of (1, 0) after a forward that differs from rank 1 and 2's:
    rank-divergence reports it (only the backward is cut off), and the verdict names it."""
    b = _job(3, {0: [ROOT, "a", "c", "head"], 1: UNITS, 2: UNITS})
    b.run(0, 1, 0, BACKWARD, [ROOT])
    for rank in (1, 2):
        b.run(rank, 1, 0, BACKWARD, [ROOT, *reversed(UNITS[1:])])
        b.marker(rank, 1, 0, schema.MARKER_OPTIMIZER_STEP)
        b.marker(rank, 1, 0, schema.MARKER_CLOSE)
    found = analyze(b.build()).findings
    divergence = found[found["check"] == "rank-divergence"]
    assert list(zip(divergence["rank"], divergence["step"], divergence["micro_step"],
                    divergence["phase"], divergence["unit"], divergence["target"],
                    strict=True)) == [(0, 1, 0, FORWARD, "c", "b")]
    stalled = found[found["check"] == "stalled-rank"]
    assert list(stalled["rank"]) == [0]
    assert "stopped at step 1, micro-step 0, backward" in stalled["message"].iloc[0]
    assert "root cause: this rank diverged before the stop (likely culprit), first " \
        "rank-divergence: rank 0 ran c at index 2" in stalled["message"].iloc[0]


def test_settings_a_stopped_rank_never_reached_are_not_compared() -> None:
    """The no-sync stall: rank 1 stops in the backward of (0, 0) after ``c``'s post-backward
    only; rank 0 finishes it, recording ``is_last_backward`` changes at the others'
    post-backwards. Only ``c`` is compared in (0, 0), and there the ranks agree."""
    b = TraceBuilder(world_size=2)
    for rank in range(2):
        b.meta(rank)
        for index, name in enumerate(UNITS):
            b.unit(rank, name, is_root=index == 0)
        b.marker(rank, 0, 0, schema.MARKER_MICRO_STEP)
        for name in UNITS:
            b.setting(rank, 0, 0, name, "is_last_backward", "false")
        b.run(rank, 0, 0, FORWARD, UNITS)
    b.run(1, 0, 0, BACKWARD, [ROOT, "head", "c", "b"])
    b.backward_grad(1, 0, 0, "head", "head.weight", "received")
    b.backward_grad(1, 0, 0, "c", "c.weight", "received")
    b.run(0, 0, 0, BACKWARD, [ROOT, "head", "c", "b", "a"])
    for name in ("head", "c", "b", "a"):
        b.backward_grad(0, 0, 0, name, f"{name}.weight", "received")
        if name in ("b", "a"):
            b.setting(0, 0, 0, name, "is_last_backward", "true")
    b.marker(0, 0, 0, schema.MARKER_OPTIMIZER_STEP)
    found = analyze(b.build()).findings
    assert set(found["check"]) == {"stalled-rank"}, found[["check", "rank", "message"]]


def test_linked_settings_are_one_finding() -> None:
    """``set_requires_gradient_sync(False)`` on rank 2 flips ``requires_all_reduce`` too."""
    b = TraceBuilder(world_size=3)
    for rank in range(3):
        b.meta(rank)
        for index, name in enumerate(UNITS):
            b.unit(rank, name, is_root=index == 0)
        b.marker(rank, 0, 0, schema.MARKER_MICRO_STEP)
        sync = "false" if rank == 2 else "true"
        b.setting(rank, 0, 0, "a", "requires_gradient_sync", sync)
        b.setting(rank, 0, 0, "a", "requires_all_reduce", sync)
        b.run(rank, 0, 0, FORWARD, UNITS)
        b.run(rank, 0, 0, BACKWARD, [ROOT, *reversed(UNITS[1:])])
        b.marker(rank, 0, 0, schema.MARKER_OPTIMIZER_STEP)
        b.marker(rank, 1, 0, schema.MARKER_CLOSE)
    found = analyze(b.build()).findings
    assert list(zip(found["check"], found["rank"], found["target"], strict=True)) == [
        ("setting-divergence", 2, "requires_gradient_sync, requires_all_reduce")]
    assert "a's requires_gradient_sync, requires_all_reduce = false, false, where 2 of 3 " \
        "ranks (e.g. rank 0) had true, true" in found["message"].iloc[0]


def test_one_majority_rule() -> None:
    """A strict majority is the reference; a tie sets every rank against another side."""
    rows = pd.DataFrame({"g": 0, "rank": [0, 1, 2, 3], "v": ["x", "x", "y", "z"]})
    odd = against_majority(rows, ["g"], "v")
    assert list(zip(odd["rank"], odd["reference"], odd["tied"], strict=True)) == [
        (2, "x", False), (3, "x", False)]
    tie = against_majority(rows.assign(v=["x", "x", "y", "y"]), ["g"], "v")
    assert sorted(zip(tie["rank"], tie["reference"], tie["reference_rank"], strict=True)) == [
        (0, "y", 2), (1, "y", 2), (2, "x", 0), (3, "x", 0)]
    assert set(tie["sides"]) == {"ranks 0-1 | ranks 2-3"}
    assert ranks_text([5, 0, 1, 2, 7]) == "ranks 0-2, 5, 7"
