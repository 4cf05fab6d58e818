"""What checks 2, 10, 11 and 12 read, recorded by real FSDP2 jobs whose ranks diverge.

Each test launches one scenario of ``tests/jobs_scripts/divergence_job.py`` on 2 gloo ranks
and reads the tables back with each rank's journal tail folded in (a rank that aborts keeps
its last rows only there). Torch 2.13's behaviour in each scenario, observed in these jobs, is
in the test's docstring.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fsdptrace
from fsdptrace.errors import RunDirError
from fsdptrace.store import schema
from tests.jobs import REPO, RankResult, case_result
from tests.jobs_scripts.tables import read_folded
from tests.recordings import Recordings

Record = Callable[[str], tuple[Path, list[RankResult]]]
SAMPLE = REPO / "sample_traces" / "clean"
NEW_TABLES = ("backward_grads", "grads_written", "eval_forwards", "settings")


@pytest.fixture
def record(recordings: Recordings) -> Record:
    """A scenario's run dir and ranks, recorded once a session (``test_checks_v2`` and
    ``test_newcomer_outputs`` read the same jobs): tests here only read it."""
    return recordings.divergence


def _states(run_dir: Path, unit: str) -> dict[tuple[int, int, int, str], str]:
    grads = read_folded(run_dir, "backward_grads", [0, 1])
    mine = grads[grads["unit"] == unit]
    return {(int(r), int(s), int(m), str(p)): str(state) for r, s, m, p, state in zip(
        mine["rank"], mine["step"], mine["micro_step"], mine["param"], mine["state"],
        strict=True)}


def test_a_skipped_unit_receives_no_gradient_though_its_buffers_stay(record: Record) -> None:
    """``b`` skipped on odd steps with ``zero_grad(set_to_none=False)``.

    FSDP2 still calls ``b``'s ``post_backward`` from the root's end-of-backward callback (group
    state ``IDLE``) and, finding no unsharded gradient, reduces nothing; ``b``'s sharded
    gradients are the zero-filled buffers of the last ``zero_grad``, so the boundary snapshot
    says ``has_grad`` for them every step (check 2's false positive). ``zero_grad`` bumps the
    DTensor gradient's ``_version``, the reduce-scatter's accumulation only its local
    tensor's: both are compared.
    """
    run_dir, results = record("skipped_unit")
    assert [r.returncode for r in results] == [0, 0], results
    assert case_result(run_dir, 0)["b_grad_after_zero_grad"] == [True] * 4
    grads = read_folded(run_dir, "backward_grads", [0, 1])
    b = grads[grads["unit"] == "b"]
    by_step = b.groupby(["rank", "step"])
    assert by_step["state"].agg(frozenset).to_dict() == {
        (rank, step): frozenset({"received" if step % 2 == 0 else "none"})
        for rank in (0, 1) for step in range(4)}
    assert by_step["via"].agg(frozenset).to_dict() == {
        (rank, step): frozenset({"backward" if step % 2 == 0 else "idle"})
        for rank in (0, 1) for step in range(4)}
    assert set(b["param"]) == {"b.fc.weight", "b.fc.bias"}
    written = read_folded(run_dir, "grads_written", [0, 1])
    presence = read_folded(run_dir, "gradients", [0, 1])
    for rank in (0, 1):
        for step in range(4):
            mine = written[(written["rank"] == rank) & (written["step"] == step)]
            assert dict(zip(mine["param"], mine["written"], strict=True)) == {
                "a.fc.weight": True, "a.fc.bias": True, "c.fc.weight": True,
                "c.fc.bias": True, "b.fc.weight": step % 2 == 0, "b.fc.bias": step % 2 == 0}
            held = presence[(presence["rank"] == rank) & (presence["step"] == step)
                            & (presence["unit"] == "b")]
            assert held["has_grad"].all()  # the buffers the old check counted


def test_b_parameter_used_on_one_rank_in_a_no_sync_micro_step(record: Record) -> None:
    """Rank 1 alone runs ``c.extra`` in a no-sync micro-step; the next micro-step syncs.

    FSDP2 keeps rank 1's ``c.extra`` gradient on the unsharded parameter, and the syncing
    ``post_backward`` reduce-scatters 4 parameters of ``c`` on rank 1 against 2 on rank 0:
    gloo aborts rank 0 (SIGABRT, ``Received data size doesn't match expected size``) and
    rank 1 fails on the closed connection. Both ranks' rows were written before the
    reduce-scatter was issued, so they survive the abort.
    """
    run_dir, results = record("one_rank_param_in_no_sync")
    assert results[0].returncode == -signal.SIGABRT, results[0].output[-2000:]
    assert "doesn't match expected size" in results[0].output
    assert case_result(run_dir, 1)["no_sync_done"] is True
    assert "sync_done" not in case_result(run_dir, 1)
    states = _states(run_dir, "c")
    expected = {}
    for rank in (0, 1):
        for micro, extra in ((0, "received" if rank else "none"),
                             (1, "carried" if rank else "none")):
            expected.update({(rank, 0, micro, "c.fc.weight"): "received",
                             (rank, 0, micro, "c.fc.bias"): "received",
                             (rank, 0, micro, "c.extra.weight"): extra,
                             (rank, 0, micro, "c.extra.bias"): extra})
    assert states == expected
    settings = read_folded(run_dir, "settings", [0, 1])
    assert _in_effect(settings, "c", "requires_gradient_sync", 0, 1) == {0: "true", 1: "true"}


def test_b_told_unused_parameters_are_zero_filled(record: Record) -> None:
    """The same divergence, every unit told ``set_reduce_scatter_unused_params(True)``.

    FSDP2 then reduce-scatters zeros for rank 0's missing ``c.extra`` gradients: both ranks
    reduce the same 4 parameters and the job finishes. Recorded as ``zero_filled`` (not a
    finding for check 10) and in ``settings``.
    """
    run_dir, results = record("one_rank_param_told_unused")
    assert [r.returncode for r in results] == [0, 0], results
    states = _states(run_dir, "c")
    assert {k: v for k, v in states.items() if k[3].startswith("c.extra")} == {
        (0, 0, 0, "c.extra.weight"): "none", (0, 0, 0, "c.extra.bias"): "none",
        (0, 0, 1, "c.extra.weight"): "zero_filled", (0, 0, 1, "c.extra.bias"): "zero_filled",
        (1, 0, 0, "c.extra.weight"): "received", (1, 0, 0, "c.extra.bias"): "received",
        (1, 0, 1, "c.extra.weight"): "carried", (1, 0, 1, "c.extra.bias"): "carried"}
    settings = read_folded(run_dir, "settings", [0, 1])
    assert _in_effect(settings, "c", "reduce_scatter_unused_params", 0, 1) == {
        0: "true", 1: "true"}


def test_c_uneven_eval_batches_are_recorded_apart_from_training(record: Record) -> None:
    """One training step, then 2 no_grad forwards on rank 0 and 3 on rank 1.

    FSDP2 all-gathers in every eval forward: rank 1's third forward waits in ``a``'s
    all-gather (the root holds no parameters) until rank 0 exits, then fails on the closed
    connection. The eval forwards of both ranks are recorded, up to ``a`` of the third on
    rank 1 (before its all-gather), and none of them enters the forward order.
    """
    run_dir, results = record("uneven_eval")
    assert results[0].returncode == 0, results[0].output[-2000:]
    assert "Connection closed by peer" in (case_result(run_dir, 1)["error"] or "")
    evals = read_folded(run_dir, "eval_forwards", [0, 1]).sort_values(["rank", "seq"])
    one_pass = ["<root>", "a", "b", "c"]
    assert {rank: list(group["unit"]) for rank, group in evals.groupby("rank")} == {
        0: one_pass * 2, 1: one_pass * 2 + ["<root>", "a"]}
    assert set(evals["step"]) == {1} and set(evals["grad_mode"]) == {"no_grad"}
    events = read_folded(run_dir, "events", [0, 1])
    assert set(events["step"]) == {0}
    assert len(events) == 2 * 2 * len(one_pass)  # 2 ranks, forward + backward


def test_d_one_rank_turns_gradient_sync_off_in_the_last_micro_step(record: Record) -> None:
    """Both ranks skip sync in micro-step 0; only rank 0 syncs in micro-step 1.

    Rank 0's syncing backward issues ``c``'s reduce-scatter while rank 1, not syncing, issues
    ``b``'s all-gather: neither completes, one rank's gloo recv times out (the job's 6 s; which
    one varies) and the other fails on the closed connection. The settings of micro-step 1 were
    recorded at its first forward, before any of it.
    """
    run_dir, results = record("one_rank_skips_sync")
    errors = [case_result(run_dir, rank)["error"] or "" for rank in (0, 1)]
    assert any("Timed out" in e for e in errors) and all(errors), errors
    assert [case_result(run_dir, rank)["micro_steps"] for rank in (0, 1)] == [1, 1]
    settings = read_folded(run_dir, "settings", [0, 1])
    for unit in ("a", "b", "c"):
        assert _in_effect(settings, unit, "requires_gradient_sync", 0, 0) == {
            0: "false", 1: "false"}
        assert _in_effect(settings, unit, "requires_gradient_sync", 0, 1) == {
            0: "true", 1: "false"}
        assert _in_effect(settings, unit, "mesh_shape", 0, 1) == {0: "[2]", 1: "[2]"}
    grads = read_folded(run_dir, "backward_grads", [0, 1])
    assert set(grads.loc[grads["micro_step"] == 1, "rank"]) == {0, 1}


def _in_effect(settings: pd.DataFrame, unit: str, setting: str, step: int, micro_step: int
               ) -> dict[int, str]:
    """Per rank, the value in effect at (step, micro_step): the last row at or before it."""
    rows = settings[(settings["unit"] == unit) & (settings["setting"] == setting)]
    at = rows[(rows["step"] < step) | ((rows["step"] == step)
                                       & (rows["micro_step"] <= micro_step))]
    return {int(rank): str(group["value"].iloc[-1]) for rank, group in at.groupby("rank")}


def test_run_dirs_recorded_before_these_tables_read_them_as_empty() -> None:
    trace = fsdptrace.load(SAMPLE)
    assert not any((SAMPLE / table).exists() for table in NEW_TABLES)
    for table in NEW_TABLES:
        frame = getattr(trace, table)
        assert frame.empty and set(frame.columns) == {"rank", *schema.TABLES[table].names}


@pytest.mark.parametrize(("table", "row", "complaint"), [
    ("settings", {"setting": "reshard_every_other_day"}, "column setting holds"),
    ("settings", {"value": "x" * 1000}, "column value holds a text of 1,000"),
    ("backward_grads", {"state": "stolen"}, "column state holds 'stolen'"),
    ("backward_grads", {"via": None}, "column via has nulls"),
    ("eval_forwards", {"step": -1}, "column step holds -1"),
    ("grads_written", {"written": None}, "column written has nulls"),
])
def test_new_columns_are_validated(tmp_path: Path, table: str, row: dict, complaint: str
                                   ) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(SAMPLE, run_dir)
    good = {"seq": 1, "t_ns": 1, "step": 0, "micro_step": 0, "unit": "<root>",
            "param": "w", "state": "none", "via": "idle", "written": True,
            "grad_mode": "no_grad", "setting": "mesh_shape", "value": "[2]"}
    names = schema.TABLES[table].names
    data = pa.Table.from_pylist([{n: {**good, **row}[n] for n in names}],
                                schema=schema.TABLES[table].remove_metadata())
    part = run_dir / table / "rank=0" / schema.PART_FILE.format(writer="w1", chunk=0)
    part.parent.mkdir(parents=True)
    pq.write_table(data.cast(schema.with_metadata(schema.TABLES[table], rank=0,
                                                  version="test")), part)
    with pytest.raises(RunDirError, match=complaint):
        fsdptrace.load(run_dir)
