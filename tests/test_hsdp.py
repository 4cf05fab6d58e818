"""The HSDP backend against a fake HSDP framework: live raising and offline analysis agree.

The real HSDP framework (``hyper_parallel``) is not installable here; ``tests/fake_hsdp.py``
reproduces the attributes the reference checker reads, on real modules running real
forward/backward in one process. For each state the reference would flag, ``EXPECTED`` states
what the reference would report (read from its logic: its section, and the unit, target,
positions, parameters or bucket state it names); fsdptrace must raise with that content, and
``fsdptrace.analyze`` of the run must report the very findings the live check recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fsdptrace
from fsdptrace import LifecycleError
from tests import fake_hsdp
from tests.jobs_scripts.tables import read_table

DIM = 8
LAYERS = 4
FINDING_COLUMNS = ["check", "step", "micro_step", "phase", "unit", "target", "message"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Model(nn.Module):
    """Embedding, blocks, an adapter unit that only some cases touch, a head (the root's)."""

    def __init__(self, *, bypass_adapter: bool = False, checkpointed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.adapter = Block()
        self.head = nn.Linear(DIM, 16)
        self.bypass_adapter = bypass_adapter
        self.checkpointed = checkpointed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False) if self.checkpointed else layer(h)
        if self.bypass_adapter:
            h = h + nn.functional.linear(h, self.adapter.fc1.weight)
        return self.head(h)


Plant = Callable[[Model], None]


def one_ahead(model: Model) -> None:
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        s = fake_hsdp.scheduler(layer)
        s.forward_prefetch_cells = layers[i + 1:i + 2]
        s.backward_prefetch_cells = layers[i - 1:i] if i else []


def wrong_forward(model: Model) -> None:
    fake_hsdp.scheduler(model.layers[2]).forward_prefetch_cells = [model.layers[1]]


def wrong_backward(model: Model) -> None:
    fake_hsdp.scheduler(model.layers[1]).backward_prefetch_cells = [model.layers[2]]


def missing_target(model: Model) -> None:
    fake_hsdp.scheduler(model.layers[3]).forward_prefetch_cells = [model.adapter]


def untracked_target(model: Model) -> None:
    """A unit of another model part this recorder was not attached to."""
    other = Block()
    fake_hsdp.shard(other, [])
    fake_hsdp.scheduler(model.layers[0]).forward_prefetch_cells = [other]


def _param(model: Model, index: int) -> fake_hsdp.HSDPParam:
    return fake_hsdp.scheduler(model.layers[1]).hsdp_state.hsdp_params[index]


# Planted right before optimizer.step(), after the last backward.
def fused_handle(model: Model) -> None:
    fake_hsdp.bucket(model.layers[1]).all_gather_result = fake_hsdp.AllGatherResult(object())


def fused_completed(model: Model) -> None:
    fake_hsdp.bucket(model.layers[1]).all_gather_result = fake_hsdp.AllGatherResult(None)


def param_handle(model: Model) -> None:
    _param(model, 0).allgather_comm_ctx.allgather_handle = object()


def param_handle_and_output(model: Model) -> None:
    ctx = _param(model, 2).allgather_comm_ctx
    ctx.allgather_handle = object()
    ctx.allgather_output = torch.zeros(DIM)


def param_output(model: Model) -> None:
    _param(model, 1).allgather_comm_ctx.allgather_output = torch.zeros(DIM)


ORDER = "configured prefetch targets do not follow the observed runtime order"
BYPASS = "child FSDP module was bypassed while its parameter participated in backward"
PENDING = "unconsumed parameter all-gather exists at the optimizer boundary"
SECTION_CHECK = {ORDER: "prefetch-order", BYPASS: "bypassed-unit",
                 PENDING: "pending-all-gather"}
BOTH_MICRO = ("micro_step=0", "micro_step=1")

# case: (setup, plant before step, bypass, what the reference reports: section -> the
# fragments one line of that section holds). Positions count the root first.
EXPECTED: dict[str, tuple[Plant | None, Plant | None, bool, list[tuple[str, tuple[str, ...]]]]] = {
    "wrong-forward": (wrong_forward, None, False, [
        (ORDER, (m, "phase=forward", "layers.2 prefetched layers.1 at positions 3->2"))
        for m in BOTH_MICRO]),
    "wrong-backward": (wrong_backward, None, False, [
        (ORDER, (m, "phase=backward", "layers.1 prefetched layers.2 at positions 3->2"))
        for m in BOTH_MICRO]),
    "missing-target": (missing_target, None, False, [
        (ORDER, (m, "phase=forward", "layers.3 prefetched adapter, but", "did not execute"))
        for m in BOTH_MICRO]),
    "untracked-target": (untracked_target, None, False, [
        (ORDER, (m, "layers.0 prefetched <untracked:Block>, but", "did not execute"))
        for m in BOTH_MICRO]),
    "bypassed-child": (None, None, True, [
        (BYPASS, ("adapter", "adapter.fc1.weight"))]),
    "fused-bucket-handle": (None, fused_handle, False, [
        (PENDING, ("layers.1:", "fused_bucket[0]", "handle=set"))]),
    "fused-bucket-completed": (None, fused_completed, False, [
        (PENDING, ("layers.1:", "fused_bucket[0]", "completed-not-consumed"))]),
    "param-handle": (None, param_handle, False, [
        (PENDING, ("layers.1:", "layers.1.fc1.weight", "handle=set"))]),
    "param-output": (None, param_output, False, [
        (PENDING, ("layers.1:", "layers.1.fc1.bias", "output=not-consumed"))]),
    "param-handle-and-output": (None, param_handle_and_output, False, [
        (PENDING, ("layers.1:", "layers.1.fc2.weight", "handle=set, output=not-consumed"))]),
}


def train(run_dir: Path, *, setup: Plant | None = None, plant: Plant | None = None,
          bypass: bool = False, checkpointed: bool = False, steps: int = 2,
          micro_steps: int = 2, seen: dict[str, object] | None = None
          ) -> tuple[Model, dict[str, torch.Tensor]]:
    """The fake-HSDP training loop with live raising; returns the model and pre-step params.

    ``seen`` receives them too, for callers that expect ``optimizer.step()`` to raise.
    """
    seen = {} if seen is None else seen
    torch.manual_seed(0)
    model = Model(bypass_adapter=bypass, checkpointed=checkpointed)
    fake_hsdp.shard(model, [f"layers.{i}" for i in range(LAYERS)] + ["adapter"])
    one_ahead(model)
    if setup is not None:
        setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    before: dict[str, torch.Tensor] = {}
    seen["model"] = model
    generator = torch.Generator().manual_seed(0)
    with fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer, raise_on_violation=True,
                          rank=0, world_size=1):
        for _ in range(steps):
            for _ in range(micro_steps):
                model(torch.randint(0, 16, (8,), generator=generator)).pow(2).mean().backward()
            if plant is not None:
                plant(model)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            seen["before"] = before
            optimizer.step()
            optimizer.zero_grad()
    return model, before


def _lines_by_section(message: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = ""
    for line in message.splitlines():
        if line.startswith("  - "):
            sections.setdefault(current, []).append(line)
        elif " (" in line:
            current = line.split(" (", 1)[0]
    return sections


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_fsdptrace_raises_what_the_reference_reports(case: str, tmp_path: Path) -> None:
    setup, plant, bypass, expected = EXPECTED[case]
    with pytest.raises(LifecycleError) as raised:
        train(tmp_path, setup=setup, plant=plant, bypass=bypass)
    message = str(raised.value)
    assert "before optimizer step 0" in message
    assert "the optimizer was not executed" in message
    sections = _lines_by_section(message)
    # Exactly the reference's sections, each line accounted for by one expected finding.
    assert set(sections) == {SECTION_CHECK[s] for s, _ in expected}
    assert sum(len(v) for v in sections.values()) == len(expected)
    for section, fragments in expected:
        lines = sections[SECTION_CHECK[section]]
        assert any(all(f in line for f in fragments) for line in lines), (fragments, message)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_offline_analysis_reports_the_live_findings(case: str, tmp_path: Path) -> None:
    setup, plant, bypass, _ = EXPECTED[case]
    with pytest.raises(LifecycleError) as raised:
        train(tmp_path, setup=setup, plant=plant, bypass=bypass)
    on_disk = read_table(tmp_path, "findings")
    offline = fsdptrace.analyze(tmp_path)
    offline_errors = offline[offline["severity"] == "error"]
    live = raised.value.findings
    assert isinstance(live, pd.DataFrame)

    def rows(frame: pd.DataFrame) -> set[tuple]:
        return {tuple(None if pd.isna(v) else v for v in row)
                for row in frame[FINDING_COLUMNS].astype(object).itertuples(index=False)}

    assert rows(offline_errors) == rows(live) == rows(on_disk)


def test_the_optimizer_did_not_touch_a_parameter(tmp_path: Path) -> None:
    seen: dict[str, object] = {}
    with pytest.raises(LifecycleError):
        train(tmp_path, plant=fused_handle, seen=seen)
    model, before = seen["model"], seen["before"]
    assert isinstance(model, Model) and isinstance(before, dict)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


@pytest.mark.parametrize("checkpointed", [False, True])
def test_clean_runs_never_raise(checkpointed: bool, tmp_path: Path) -> None:
    """One-ahead prefetch, with and without checkpoint recompute (which is not forward)."""
    model, before = train(tmp_path, checkpointed=checkpointed, steps=3)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed  # the last step ran and updated the weights
    assert not (tmp_path / "findings").exists()
    assert len(fsdptrace.analyze(tmp_path)) == 0


def test_recompute_is_not_recorded_as_forward(tmp_path: Path) -> None:
    train(tmp_path, checkpointed=True, steps=1, micro_steps=1)
    events = read_table(tmp_path, "events")
    forward = list(events.loc[events["phase"] == "forward", "unit"])
    assert forward == ["<root>", *[f"layers.{i}" for i in range(LAYERS)]]
