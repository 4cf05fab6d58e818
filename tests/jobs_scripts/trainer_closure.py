"""Closure steps on real FSDP2 (2 gloo ranks): ``optimizer.step(closure)`` runs the forward and
backward inside the step, so the optimizer boundary is when the closure returns.

    python -m tests.jobs.run_ranks tests/jobs_scripts/trainer_closure.py --out DIR

Cases (each records into ``DIR/<case>`` with ``attach(optimizer=...)``; rank 0 prints one line
``RESULTS <json>`` with what the job observed):

- ``lbfgs``: ``torch.optim.LBFGS(max_iter=1)``, 3 ``step(closure)`` calls, an eval forward after
  each: one boundary per call;
- ``lbfgs_inner``: ``LBFGS(max_iter=3)``: it evaluates the closure once per inner iteration and
  updates after each, so every closure return is a boundary (the job counts the calls);
- ``closure_pending``: SGD ``step(closure)`` with live raising, the closure leaving ``layers.1``
  unsharded (a stray ``unshard()``): the step must raise before the update.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdptrace

DIM = 8
NUM_STEPS = 3
CASES = ["lbfgs", "lbfgs_inner", "closure_pending"]


class Net(nn.Module):
    """Three layers and a square head. LBFGS flattens every gradient with ``view(-1)``, which
    DTensor refuses for a parameter sharded unevenly (a ``Linear(8, 1)`` head on 2 ranks:
    "would remove or reshape sharded dimension 0"), so every parameter here splits evenly."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def build() -> Net:
    torch.manual_seed(0)
    model = Net()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _shards(model: nn.Module) -> list[torch.Tensor]:
    """This rank's shard of every parameter, from FSDP's sharded parameters: after an eval
    forward the root's parameters stay unsharded, so ``model.parameters()`` is not it."""
    return [fsdp_param.sharded_param.to_local().detach().clone()
            for module in model.modules() if isinstance(module, FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups
            for fsdp_param in group.fsdp_params]


def run_case(name: str, out: Path, rank: int) -> dict[str, Any]:
    model = build()
    if name == "closure_pending":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1,
                                      max_iter=1 if name == "lbfgs" else 3)
    generator = torch.Generator().manual_seed(rank)
    batch = torch.randn(4, DIM, generator=generator)
    result: dict[str, Any] = {"closure_calls": 0, "raised": None, "changed": None}

    def closure() -> torch.Tensor:
        result["closure_calls"] += 1
        optimizer.zero_grad()
        loss = model(batch).pow(2).mean()
        loss.backward()
        if name == "closure_pending":
            model.layers[1].unshard()
        return loss

    recorder = fsdptrace.attach(model, run_dir=out / name, optimizer=optimizer,
                                raise_on_violation=name == "closure_pending")
    try:
        with recorder:  # its exit ends the recording cleanly at the raising boundary
            for _ in range(NUM_STEPS):
                before = _shards(model)
                optimizer.step(closure)
                with torch.no_grad():
                    model(batch)
    except fsdptrace.LifecycleError as error:
        result["raised"] = str(error).splitlines()[0]
        result["changed"] = any(not torch.equal(a, b)
                                for a, b in zip(before, _shards(model), strict=True))
    result["recorder_steps"] = recorder.step
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    try:
        for name in CASES:
            results[name] = run_case(name, args.out, rank)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
