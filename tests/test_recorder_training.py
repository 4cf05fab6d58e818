"""The recorder on real 2-rank FSDP2 jobs (gloo, CPU), read back with plain pyarrow.

One launch of ``tests/jobs_scripts/recorder_cases.py`` records every case below (a process
group start costs seconds); each test then checks one thing the issue "Recorder" asks for.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

import fsdptrace
from fsdptrace.store import schema
from tests.jobs import case_result
from tests.jobs_scripts.tables import marker_kinds, orders, read_table, rows_of
from tests.recordings import CATALOGUE, Recordings

pytestmark = pytest.mark.slow

CASES = CATALOGUE["recorder_cases"]
RANKS = (0, 1)
LAYERS = [f"layers.{i}" for i in range(4)]
TINY_FORWARD = ["<root>", *LAYERS]
TINY_BACKWARD = ["<root>", *reversed(LAYERS)]


@pytest.fixture(scope="module")
def runs(recordings: Recordings) -> Path:
    """One folder with a run dir per case, from the session's catalogue launch."""
    return recordings.catalogue("recorder_cases")


def expected_orders(
    steps: int, micro_steps: int, forward: list[str], backward: list[str]
) -> dict[tuple[int, int, int, str], list[str]]:
    return {
        (rank, step, micro, phase): order
        for rank in RANKS
        for step in range(steps)
        for micro in range(micro_steps)
        for phase, order in (("forward", forward), ("backward", backward))
    }


# ------------------------------------------------------------------ the tiny transformer
def test_clean_orders_for_every_rank_step_and_micro_step(runs: Path) -> None:
    """Forward runs root then layers; backward begins at the loss end, layers reversed."""
    assert orders(runs / "clean") == expected_orders(3, 2, TINY_FORWARD, TINY_BACKWARD)


def test_clean_prefetch_edges_are_one_complete_snapshot(runs: Path) -> None:
    """Edges are configured once, so each rank writes one snapshot, at the first micro-step."""
    prefetch = read_table(runs / "clean", "prefetch")
    assert rows_of(prefetch, "step", "micro_step") == {(0, 0)}
    for rank in RANKS:
        rows = prefetch[prefetch["rank"] == rank]
        edges = {row for row in rows_of(rows, "unit", "phase", "target") if isinstance(row[2], str)}
        forward = {(a, "forward", b) for a, b in pairwise(LAYERS)}
        backward = {(b, "backward", a) for a, b in pairwise(LAYERS)}
        assert edges == forward | backward
        # Every unit and phase has a row, with a null target when it prefetches nothing.
        assert len(rows_of(rows, "unit", "phase")) == 6 * 2


def test_clean_gradients_at_each_boundary(runs: Path) -> None:
    """Every managed parameter holds a reduced gradient, except the never-run adapter's."""
    gradients = read_table(runs / "clean", "gradients")
    assert rows_of(gradients, "rank", "step", "micro_step") == {
        (rank, step, 1) for rank in RANKS for step in range(3)
    }
    ran = gradients[gradients["unit"] != "adapter"]
    assert ran["has_grad"].all() and set(ran["grad_source"]) == {"sharded"}
    adapter = gradients[gradients["unit"] == "adapter"]
    assert len(adapter) == 2 * 3 * 4
    assert not adapter["has_grad"].any() and set(adapter["grad_source"]) == {"none"}


def test_clean_has_nothing_pending(runs: Path) -> None:
    """A clean loop leaves no all-gather pending and no parameters unsharded at the step."""
    for case in ("clean", "clean-checkpoint-accumulation", "no-sync-boundary", "two-parts"):
        assert read_table(runs / case, "pending").empty, case


def test_clean_units_and_meta(runs: Path) -> None:
    """Units carry the user's class names and FSDP's parameter FQNs; meta names the run."""
    units = read_table(runs / "clean", "units")
    for rank in RANKS:
        rows = units[units["rank"] == rank].set_index("unit")
        assert list(rows.index) == [*TINY_FORWARD, "adapter"]
        assert rows.loc["<root>", "module_type"] == "TinyModel"
        assert set(rows.loc[[*LAYERS, "adapter"], "module_type"]) == {"Block"}
        assert list(rows["is_root"]) == [True] + [False] * 5
        assert list(rows.loc["<root>", "param_names"]) == [
            "embed.weight",
            "norm.weight",
            "norm.bias",
            "head.weight",
            "head.bias",
        ]
        assert rows.loc["<root>", "num_param_elements"] == 32 * 16 + 2 * 16 + 16 * 32 + 32
        assert rows.loc["layers.2", "num_params"] == 4
    meta = read_table(runs / "clean", "meta")
    assert list(meta["rank"]) == [0, 1] and meta["pid"].nunique() == 2
    assert set(meta["world_size"]) == {2} and set(meta["backend"]) == {"fsdp2"}
    assert set(meta["num_parts"]) == {1}
    assert set(meta["schema_version"]) == {schema.SCHEMA_VERSION}


def test_clean_markers_frame_each_step(runs: Path) -> None:
    """Two micro-step begins per optimizer step, then a clean close."""
    for rank in RANKS:
        step = ["micro_step_begin", "micro_step_begin", "optimizer_step"]
        assert marker_kinds(runs / "clean", rank) == step * 3 + ["close"]


def test_every_file_is_stamped_with_its_rank_and_schema(runs: Path) -> None:
    """Files copied out of their folder still say which rank and schema wrote them."""
    files = sorted((runs / "clean").glob("*/rank=*/part-*.parquet"))
    assert len(files) > 10
    for path in files:
        metadata = pq.read_schema(path).metadata
        assert metadata[schema.RANK_KEY].decode() == path.parent.name.removeprefix("rank=")
        assert metadata[schema.SCHEMA_VERSION_KEY] == str(schema.SCHEMA_VERSION).encode()
        assert "rank" not in pq.read_schema(path).names


# ------------------------------------------------------------------ activation checkpointing
@pytest.mark.parametrize("case", ["clean-checkpoint-accumulation", "clean-reentrant-checkpoint"])
def test_checkpoint_recompute_is_not_forward_order(runs: Path, case: str) -> None:
    """Recompute re-enters every layer during backward; forward order must not show it."""
    assert orders(runs / case) == expected_orders(3, 2, TINY_FORWARD, TINY_BACKWARD)


def test_eval_forward_is_not_a_micro_step(runs: Path) -> None:
    """The no_grad forward after each optimizer step adds no micro-step and no events."""
    run = runs / "clean-checkpoint-accumulation"
    for rank in RANKS:
        step = ["micro_step_begin", "micro_step_begin", "optimizer_step"]
        assert marker_kinds(run, rank) == step * 3 + ["close"]
    assert set(read_table(run, "events")["step"]) == {0, 1, 2}


def test_eval_forwards_are_recorded_apart(runs: Path) -> None:
    """Each no_grad forward is recorded in its own table, in the eval interval after the step
    it follows; reentrant checkpointing's no_grad first forward is training, not eval."""
    run = runs / "clean-checkpoint-accumulation"
    evals = read_table(run, "eval_forwards")
    for rank in RANKS:
        mine = evals[evals["rank"] == rank]
        assert {int(s): list(g["unit"]) for s, g in mine.groupby("step")} == {
            step: orders(run)[(rank, 0, 0, "forward")] for step in (1, 2, 3)}
    assert set(evals["grad_mode"]) == {"no_grad"}
    assert read_table(runs / "clean-reentrant-checkpoint", "eval_forwards").empty


def test_accumulation_without_sync_keeps_gradients_visible(runs: Path) -> None:
    """Sync off: ``param.grad`` is None, yet the recorder finds the unsharded gradient."""
    gradients = read_table(runs / "no-sync-boundary", "gradients")
    layers = gradients[gradients["unit"].str.startswith("layers.")]
    assert len(layers) == 2 * 2 * 4
    assert layers["has_grad"].all() and set(layers["grad_source"]) == {"unsharded"}
    root = gradients[gradients["unit"] == "<root>"]
    assert root["has_grad"].all() and set(root["grad_source"]) == {"sharded"}
    for rank in RANKS:
        assert all(case_result(runs / "no-sync-boundary", rank)["layer_param_grad_is_none"])
    synced_first_micro_off = read_table(runs / "clean-checkpoint-accumulation", "gradients")
    assert synced_first_micro_off["has_grad"].groupby(
        synced_first_micro_off["unit"] != "adapter"
    ).all().to_dict() == {True: True, False: False}


# ------------------------------------------------------------------ unit shapes
def test_two_parts_with_colliding_fqns_get_part_prefixes(runs: Path) -> None:
    """Both parts own ``layers.0``; names must stay unique, and one pass is one micro-step."""
    run = runs / "two-parts"
    units = read_table(run, "units")
    first = ["part[0]", "part[0].layers.0", "part[0].layers.1"]
    second = ["part[1]", "part[1].layers.0", "part[1].layers.1"]
    for rank in RANKS:
        rows = units[units["rank"] == rank]
        assert list(rows["unit"]) == first + second
        assert list(rows["part"]) == [0, 0, 0, 1, 1, 1]
        assert list(rows["fqn"]) == ["", "layers.0", "layers.1"] * 2
        assert list(rows["is_root"]) == [True, False, False] * 2
    backward = [
        "part[1]",
        "part[1].layers.1",
        "part[1].layers.0",
        "part[0].layers.1",
        "part[0]",
        "part[0].layers.0",
    ]
    assert orders(run) == expected_orders(2, 2, first + second, backward)
    assert set(read_table(run, "meta")["num_parts"]) == {2}
    gradients = read_table(run, "gradients")
    assert set(gradients["unit"]) == set(first + second) and gradients["has_grad"].all()


def test_grouped_unit_is_one_unit_named_by_its_modules(runs: Path) -> None:
    """``fully_shard([embed, head])`` is one unit ``embed,head``, entered by both modules."""
    run = runs / "grouped"
    units = read_table(run, "units")
    grouped = units[units["unit"] == "embed,head"]
    assert len(grouped) == 2 and list(units["unit"]).count("embed,head") == 2
    assert set(grouped["module_type"]) == {"Embedding,Block"}
    names = ["embed.weight", "head.fc.weight", "head.fc.bias"]
    assert all(list(p) == names for p in grouped["param_names"])
    gradients = read_table(run, "gradients")
    assert sorted(set(gradients.loc[gradients["unit"] == "embed,head", "param"])) == sorted(names)
    forward = ["<root>", "embed,head", "layers.0", "layers.1", "embed,head"]
    backward = ["embed,head", "<root>", "layers.1", "layers.0", "embed,head"]
    assert orders(run) == expected_orders(2, 2, forward, backward)


def test_registered_forward_method_is_recorded_once(runs: Path) -> None:
    """``head.project`` bypasses module hooks; the unit still enters forward, exactly once."""
    forward = ["<root>", "layers.0", "layers.1", "head"]
    backward = ["head", "<root>", "layers.1", "layers.0"]
    assert orders(runs / "forward-method") == expected_orders(2, 2, forward, backward)


# ------------------------------------------------------------------ boundary state
@pytest.mark.parametrize(
    ("case", "steps", "state"),
    [
        ("pending-all-gather", 3, "unsharded-held"),
        ("pending-unshard", 2, "unsharded-held"),
        ("pending-async-unshard", 2, "handle=set"),
    ],
)
def test_stray_unshard_is_pending_at_the_boundary(
    runs: Path, case: str, steps: int, state: str
) -> None:
    """``set_is_last_backward(False)`` plus a stray ``unshard()`` before every step.

    Blocking: the gathered parameters are held, and the next forward runs on them (stale by
    one optimizer update). Async: the all-gather itself is still waiting for its ``wait()``.
    """
    pending = read_table(runs / case, "pending")
    expected = {
        (rank, step, 1, "layers.1", "param_group", "group[0]", state)
        for rank in RANKS
        for step in range(steps)
    }
    columns = ["rank", "step", "micro_step", "unit", "kind", "bucket", "state"]
    assert rows_of(pending, *columns) == expected
    assert len(pending) == len(expected)


def test_step_window_records_only_its_steps(runs: Path) -> None:
    """``steps="1:3"`` over 4 steps: events, edges, gradients and micro-steps of 1 and 2 only."""
    run = runs / "step-window"
    assert orders(run) == {
        key: order
        for key, order in expected_orders(
            3, 2, ["<root>", "layers.0", "layers.1"], ["<root>", "layers.1", "layers.0"]
        ).items()
        if key[1] >= 1
    }
    assert set(read_table(run, "gradients")["step"]) == {1, 2}
    assert set(read_table(run, "prefetch")["step"]) == {1}
    markers = read_table(run, "markers")
    begins = markers[markers["kind"] == "micro_step_begin"]
    assert set(begins["step"]) == {1, 2} and len(begins) == 2 * 2 * 2
    assert set(read_table(run, "meta")["steps_spec"]) == {"1:3"}


# ------------------------------------------------------------------ failures
@pytest.mark.parametrize(
    ("case", "what"),
    [
        ("failing-gradients", "boundary snapshot failed"),
        ("failing-hook", "forward pre-hook failed"),
    ],
)
def test_backend_failure_warns_once_and_training_is_unchanged(
    runs: Path, case: str, what: str
) -> None:
    """A read that raises disables recording on that rank; the job never notices."""
    for rank in RANKS:
        healthy = case_result(runs / "healthy-backend", rank)
        failed = case_result(runs / case, rank)
        assert failed["losses"] == healthy["losses"] and len(failed["losses"]) == 4
        assert healthy["warnings"] == []
        assert len(failed["warnings"]) == 1 and what in failed["warnings"][0]
        kinds = marker_kinds(runs / case, rank)
        assert kinds.count("recording_disabled") == 1 and kinds[-1] == "close"


def test_failure_stops_recording_where_it_happened(runs: Path) -> None:
    """Rows before the failure stay; nothing is recorded after it."""
    gradients = read_table(runs / "failing-gradients", "gradients")
    assert set(gradients["step"]) == {0}  # step 1's snapshot failed
    assert set(read_table(runs / "failing-gradients", "events")["step"]) == {0, 1}
    hook_events = read_table(runs / "failing-hook", "events")
    assert rows_of(hook_events, "step", "micro_step") == {(0, 0)}
    assert read_table(runs / "failing-hook", "gradients").empty


def test_the_analysis_is_the_same_whatever_the_batches_held(runs: Path) -> None:
    """One batch of both ranks (a small run, mapped in process) and a batch per rank (``-j 2``)
    give the same findings, endings and unchecked micro-steps, row for row: a disabled
    recording leaves unchecked micro-steps in every table of both ranks."""
    one_batch = fsdptrace.analyze(runs / "failing-hook", jobs=1)
    per_rank = fsdptrace.analyze(runs / "failing-hook", jobs=2)
    assert len(one_batch.incomplete) and set(one_batch.incomplete["rank"]) == {0, 1}
    for field in ("findings", "endings", "incomplete"):
        pd.testing.assert_frame_equal(getattr(one_batch, field), getattr(per_rank, field))
