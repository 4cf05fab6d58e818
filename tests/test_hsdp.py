"""The HSDP backend on real hyper_parallel units (2 ranks, gloo, CPU), and on a fake only for
the attribute layout this release does not have.

One launch of ``tests/jobs_scripts/hsdp_cases.py`` runs every real case; each test judges what
one case recorded. What hyper_parallel 0.1 does, observed in these jobs, is written next to the
test that relies on it. The fake (``tests/fake_hsdp.py``) remains for the reference checker's
newer layout (fused ``all_gather_buckets`` and ``allgather_comm_ctx``), which this release
cannot produce.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import torch.nn as nn

import fsdptrace
from fsdptrace import LifecycleError
from fsdptrace.record.launch import record_env
from tests import fake_hsdp
from tests.jobs import REPO, assert_ok, case_result, run_ranks
from tests.jobs_scripts.tables import orders, read_table

SCRIPT = REPO / "tests" / "jobs_scripts" / "hsdp_cases.py"
WHEELS = REPO.parent / "shared" / "wheels"
FINDING_COLUMNS = ["check", "step", "micro_step", "phase", "unit", "target", "message"]
LAYERS = [f"layers.{i}" for i in range(4)]
FORWARD = ["<root>", *LAYERS]
BACKWARD = ["<root>", *LAYERS[::-1]]
PASSES = [(rank, step, micro) for rank in (0, 1) for step in (0, 1) for micro in (0, 1)]
BOUNDARIES = [(rank, step) for rank in (0, 1) for step in (0, 1)]
EXTRA = ["extra.fc.bias", "extra.fc.weight"]

real_hsdp = pytest.mark.skipif(
    importlib.util.find_spec("hyper_parallel") is None,
    reason="hyper_parallel is not installed: `make setup` installs it from ../shared/wheels/ "
           f"({'present' if WHEELS.is_dir() else 'absent here'})")


# --------------------------------------------------------------------- real hyper_parallel
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hsdp")
    from tests.jobs_scripts.hsdp_cases import CASES

    assert_ok(run_ranks([str(SCRIPT), "--out", str(out), *CASES], timeout_s=240))
    return out


def findings(run_dir: Path) -> pd.DataFrame:
    return fsdptrace.analyze(run_dir).findings


def keys(found: pd.DataFrame, check: str) -> list[tuple]:
    rows = found[found["check"] == check]
    return sorted(zip(rows["rank"], rows["step"], rows["micro_step"], rows["target"],
                      strict=True))


@real_hsdp
@pytest.mark.slow
def test_clean_chain_records_every_pass_and_finds_nothing(runs: Path) -> None:
    run_dir = runs / "clean"
    assert set(read_table(run_dir, "meta")["backend"]) == {"hsdp"}
    assert list(read_table(run_dir, "units").query("rank == 0")["unit"]) == [*FORWARD, "extra"]
    recorded = orders(run_dir)
    assert {k: v for k, v in recorded.items() if k[3] == "forward"} == {
        (*p, "forward"): FORWARD for p in PASSES}
    assert {k: v for k, v in recorded.items() if k[3] == "backward"} == {
        (*p, "backward"): BACKWARD for p in PASSES}
    # hyper_parallel 0.1 leaves _param_fqn None: names come from its (module, param_name).
    gradients = read_table(run_dir, "gradients").query("rank == 0 and step == 0")
    assert list(gradients.query("unit == 'layers.0'")["param"]) == [
        "layers.0.fc.weight", "layers.0.fc.bias"]
    # After a synced backward every trained unit's gradient is on its sharded parameter.
    assert set(gradients.query("unit != 'extra'")["grad_source"]) == {"sharded"}
    assert len(findings(run_dir)) == 0
    assert case_result(run_dir, 0)["changed"]  # it trained


@real_hsdp
@pytest.mark.slow
def test_explicit_boundaries_record_what_the_optimizer_hook_does(runs: Path) -> None:
    """``begin_micro_step``/``before_optimizer_step`` called by the loop, no optimizer given."""
    run_dir = runs / "clean-explicit-boundaries"
    assert orders(run_dir) == orders(runs / "clean")
    assert len(read_table(run_dir, "gradients")) == len(read_table(runs / "clean", "gradients"))
    assert len(findings(run_dir)) == 0


@real_hsdp
@pytest.mark.slow
def test_checkpoint_recompute_is_not_forward_order(runs: Path) -> None:
    recorded = orders(runs / "clean-checkpoint")
    assert [recorded[(*p, "forward")] for p in PASSES] == [FORWARD] * len(PASSES)
    assert len(findings(runs / "clean-checkpoint")) == 0


@real_hsdp
@pytest.mark.slow
def test_forward_prefetch_of_a_unit_that_never_runs(runs: Path) -> None:
    """HSDP issues the all-gather and nothing ever waits for it: its ``prefetch_handle`` stays
    set and its ``all_gather_outputs`` held at every optimizer boundary, and training exits 0."""
    found = findings(runs / "never-runs")
    assert set(found["check"]) == {"prefetch-order", "pending-all-gather"}
    assert keys(found, "prefetch-order") == [(*p, "extra") for p in PASSES]
    assert keys(found, "pending-all-gather") == [
        (rank, step, 1, param) for rank, step in BOUNDARIES for param in EXTRA]
    pending = found[found["check"] == "pending-all-gather"]
    assert set(pending["unit"]) == {"extra"}
    assert pending["message"].str.contains("handle=set, output=not-consumed").all()
    order = found[found["check"] == "prefetch-order"]
    assert order["message"].str.startswith(
        "layers.3 prefetched extra, but extra did not execute in forward").all()


@real_hsdp
@pytest.mark.slow
def test_wrong_backward_edge(runs: Path) -> None:
    """``layers.1`` backward-prefetches ``layers.2``, whose backward already ran.

    Observed: layers.2's post-backward has resharded it by then, so the edge issues a real
    all-gather that no one consumes; it is still pending at every optimizer boundary, and the
    next forward of layers.2 would run on the pre-step gather.
    """
    found = findings(runs / "wrong-backward")
    assert set(found["check"]) == {"prefetch-order", "pending-all-gather"}
    order = found[found["check"] == "prefetch-order"]
    assert keys(found, "prefetch-order") == [(*p, "layers.2") for p in PASSES]
    assert set(order["phase"]) == {"backward"}
    assert order["message"].str.startswith(
        "layers.1 prefetched layers.2 at positions 3->2 in backward").all()
    assert keys(found, "pending-all-gather") == [
        (rank, step, 1, f"layers.2.fc.{name}")
        for rank, step in BOUNDARIES for name in ("bias", "weight")]


@real_hsdp
@pytest.mark.slow
def test_ranks_with_different_prefetch_configuration(runs: Path) -> None:
    """Rank 0 prefetches one ahead, rank 1 not at all; both gather in the same order."""
    found = findings(runs / "config-divergence")
    assert list(found["check"]) == ["prefetch-config-divergence"]
    assert list(found["rank"]) == [1]
    assert "layers.0 forward -> [] (rank 0: [layers.1])" in found["message"].iloc[0]


@real_hsdp
@pytest.mark.slow
def test_rank_divergence(runs: Path) -> None:
    """Rank 1 runs layers.2 before layers.1. The blocks' gathers have equal shapes, so HSDP
    pairs them up across ranks without a hang or an error (silently swapped parameters)."""
    found = findings(runs / "rank-divergence")
    assert set(found["check"]) == {"rank-divergence"}
    assert sorted(zip(found["rank"], found["step"], found["micro_step"], found["phase"],
                      found["unit"], found["target"], strict=True)) == [
        (1, step, micro, phase, *(("layers.1", "layers.2") if phase == "backward"
                                  else ("layers.2", "layers.1")))
        for step in (0, 1) for micro in (0, 1) for phase in ("backward", "forward")]


@real_hsdp
@pytest.mark.slow
def test_order_instability(runs: Path) -> None:
    """Every second micro-step swaps layers.1 and layers.2 on both ranks."""
    found = findings(runs / "order-instability")
    assert set(found["check"]) == {"order-instability"}
    assert keys(found, "order-instability") == [
        (rank, step, 1, "layers.1") for rank, step in BOUNDARIES]


@real_hsdp
@pytest.mark.slow
def test_a_unit_used_without_its_forward(runs: Path) -> None:
    """``extra.unshard()`` then its weight used directly: the gradient stays on the unsharded
    parameter (never reduced), and the unit stays unsharded across the optimizer step."""
    found = findings(runs / "bypassed-extra")
    assert set(found["check"]) == {"bypassed-unit", "pending-all-gather"}
    bypassed = found[found["check"] == "bypassed-unit"]
    assert sorted(zip(bypassed["rank"], bypassed["step"], strict=True)) == BOUNDARIES
    assert bypassed["message"].str.contains(r"\(extra.fc.weight\)").all()
    pending = found[found["check"] == "pending-all-gather"]
    assert pending["message"].str.startswith("extra: unit parameters unsharded-held").all()
    gradients = read_table(runs / "bypassed-extra", "gradients").query("unit == 'extra'")
    assert set(gradients.query("has_grad")["grad_source"]) == {"unsharded"}


@real_hsdp
@pytest.mark.slow
def test_live_raising_stops_the_optimizer_step(runs: Path) -> None:
    run_dir = runs / "live-never-runs"
    for rank in (0, 1):
        result = case_result(run_dir, rank)
        assert result["raised"] == "LifecycleError"
        message = result["message"]
        assert f"on rank {rank} before optimizer step 0; the optimizer was not executed" in message
        assert "prefetch-order" in message and "pending-all-gather" in message
        assert result["changed"] == [] and result["optimizer_state"] == 0
    # The live findings are on disk and are exactly the offline analysis's.
    on_disk = read_table(run_dir, "findings")
    offline = findings(run_dir)
    assert _rows(on_disk) == _rows(offline[offline["severity"] == "error"])
    assert set(offline["check"]) == {"prefetch-order", "pending-all-gather"}


@real_hsdp
@pytest.mark.slow
def test_settings_of_every_unit(runs: Path) -> None:
    settings = case_result(runs / "clean", 0)["settings"]
    assert set(settings) == {*FORWARD, "extra"}
    assert settings["layers.0"] == {
        "requires_gradient_sync": True, "requires_all_reduce": True, "is_last_backward": True,
        "reshard_after_forward": False, "reshard_after_backward": True, "mesh_shape": [2]}


@real_hsdp
@pytest.mark.slow
def test_backward_grads_and_settings_tables(runs: Path) -> None:
    """``hsdp_state.post_backward`` runs only for units that ran backward: ``extra`` (never
    called) has no rows, every layer's parameters are ``received`` in every micro-step."""
    run_dir = runs / "clean"
    grads = read_table(run_dir, "backward_grads")
    assert set(grads["unit"]) == {"<root>", *LAYERS}
    assert set(grads["state"]) == {"received"} and set(grads["via"]) == {"backward"}
    per_pass = grads.groupby(["rank", "step", "micro_step"])["param"].agg(frozenset)
    assert per_pass.index.tolist() == PASSES
    assert len(set(per_pass)) == 1
    settings = read_table(run_dir, "settings")
    first = settings[(settings["rank"] == 0) & (settings["step"] == 0)
                     & (settings["micro_step"] == 0) & (settings["unit"] == "layers.0")]
    assert dict(zip(first["setting"], first["value"].fillna("null"), strict=True)) == {
        "requires_gradient_sync": "true", "requires_all_reduce": "true",
        "is_last_backward": "true", "reshard_after_forward": "false",
        "reshard_after_backward": "true", "reduce_scatter_unused_params": "null",
        "mesh_shape": "[2]"}
    written = read_table(run_dir, "grads_written")
    assert written["written"].all() and set(written["unit"]) == {"<root>", *LAYERS}
    assert read_table(run_dir, "eval_forwards").empty


@real_hsdp
@pytest.mark.slow
def test_zero_code_record_of_torchrun(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items() if k not in launcher}
    env = record_env(run_dir, base_env={**base, "OMP_NUM_THREADS": "1"})
    cli = [sys.executable, "-m", "fsdptrace_cli.main"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", str(SCRIPT), "--zero-code"]
    done = subprocess.run([*cli, "record", "--run-dir", str(run_dir), "--", *torchrun],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: no findings across 2 of 2 ranks" in done.stdout
    assert set(read_table(run_dir, "meta")["backend"]) == {"hsdp"}
    assert orders(run_dir) == {(*p, ph): FORWARD if ph == "forward" else BACKWARD
                               for p in PASSES for ph in ("forward", "backward")}


def _rows(frame: pd.DataFrame) -> set[tuple]:
    return {tuple(None if pd.isna(v) else v for v in row)
            for row in frame[FINDING_COLUMNS].astype(object).itertuples(index=False)}


# --------------------------------------------------------------------- missing attributes
def test_each_missing_attribute_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    """A scheduler with none of the attributes the backend reads (a future or foreign
    release): one warning per attribute, over every step, and the order is still recorded."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    for module in (model[0], model):
        module.hsdp_scheduler = types.SimpleNamespace()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fsdptrace.attach(model, run_dir=tmp_path, optimizer=optimizer, rank=0,
                              world_size=1) as recorder:
            for _ in range(3):
                model(torch.ones(2, 4)).sum().backward()
                optimizer.step()
            settings = recorder.backend.settings(recorder.units[1])
    ours = [str(w.message) for w in caught if "fsdptrace: HSDP unit" in str(w.message)]
    missing = sorted(m.split(" has no ", 1)[1].split(",", 1)[0] for m in ours)
    assert missing == sorted(["hsdp_state", "forward_prefetch_cells", "backward_prefetch_cells",
                              "scheduler_ctx", "reshard_after_forward"])
    assert set(settings.values()) == {None}
    assert orders(tmp_path)[(0, 2, 0, "forward")] == ["<root>", "0"]


# --------------------------------------------------------------------- the reference's layout
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _param(model: Model, index: int) -> fake_hsdp.HSDPParam:
    return fake_hsdp.scheduler(model.layers[1]).hsdp_state.hsdp_params[index]


def fused_handle(model: Model) -> None:
    fake_hsdp.bucket(model.layers[1]).all_gather_result = fake_hsdp.AllGatherResult(object())


def fused_completed(model: Model) -> None:
    fake_hsdp.bucket(model.layers[1]).all_gather_result = fake_hsdp.AllGatherResult(None)


def param_handle(model: Model) -> None:
    _param(model, 0).allgather_comm_ctx.allgather_handle = object()


def param_output(model: Model) -> None:
    _param(model, 1).allgather_comm_ctx.allgather_output = torch.zeros(8)


def param_handle_and_output(model: Model) -> None:
    ctx = _param(model, 2).allgather_comm_ctx
    ctx.allgather_handle = object()
    ctx.allgather_output = torch.zeros(8)


# Planted right before optimizer.step(): what the reference reports for each (its section
# "unconsumed parameter all-gather exists at the optimizer boundary" is our check 3).
LAYOUT_CASES: dict[str, tuple[Callable[[Model], None], tuple[str, ...]]] = {
    "fused-bucket-handle": (fused_handle, ("layers.1:", "fused_bucket[0]", "handle=set")),
    "fused-bucket-completed": (fused_completed,
                               ("layers.1:", "fused_bucket[0]", "completed-not-consumed")),
    "param-handle": (param_handle, ("layers.1:", "layers.1.fc1.weight", "handle=set")),
    "param-output": (param_output, ("layers.1:", "layers.1.fc1.bias", "output=not-consumed")),
    "param-handle-and-output": (param_handle_and_output, (
        "layers.1:", "layers.1.fc2.weight", "handle=set, output=not-consumed")),
}


def train_fake(run_dir: Path, plant: Callable[[Model], None]) -> Any:
    """One fake-HSDP step with live raising; returns the exception it raised."""
    torch.manual_seed(0)
    model = Model()
    fake_hsdp.shard(model, LAYERS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(LifecycleError) as raised, fsdptrace.attach(
            model, run_dir=run_dir, optimizer=optimizer, raise_on_violation=True, rank=0,
            world_size=1):
        model(torch.arange(8) % 16).pow(2).mean().backward()
        plant(model)
        optimizer.step()
    return raised.value


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_the_reference_layout_is_read_live_and_offline(case: str, tmp_path: Path) -> None:
    """hyper_parallel 0.1 keeps no buckets nor comm contexts: only a fake can plant them."""
    plant, fragments = LAYOUT_CASES[case]
    error = train_fake(tmp_path, plant)
    lines = [line for line in str(error).splitlines() if line.startswith("  - ")]
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), str(error)
    assert "pending-all-gather (" in str(error)
    offline = fsdptrace.analyze(tmp_path).findings
    assert _rows(offline) == _rows(error.findings) == _rows(read_table(tmp_path, "findings"))

