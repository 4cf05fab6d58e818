"""A tiny transformer-like FSDP2 job with one switch per lifecycle problem fsdptrace finds.

Run it on 2 CPU ranks (gloo), each scenario into its own run dir:

    torchrun --nproc-per-node 2 examples/scenarios.py --out runs/ clean wrong-forward-prefetch

It is what the tests, the shipped sample traces and the README demo record. Every scenario
uses the explicit API (``fsdptrace.attach(model, optimizer=opt)``); ``train_tiny.py`` shows the
minimal version and ``fsdptrace record`` the zero-code one.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

import fsdptrace

DIM = 16
NUM_LAYERS = 4


@dataclass(frozen=True)
class Scenario:
    """What one recording plants; every field off is a clean run."""

    steps: int = 3
    micro_steps: int = 2
    checkpoint: str = "none"  # none | reentrant | nonreentrant
    no_sync: bool = False  # gradient accumulation with sync off between micro-steps
    eval_between_steps: bool = False
    wrong_forward_prefetch: bool = False
    wrong_backward_prefetch: bool = False
    missing_target: bool = False
    bypassed_child: bool = False
    rank_divergence: bool = False  # rank 1 swaps two same-shaped layers (no explicit prefetch)
    config_divergence: bool = False
    pending_all_gather: bool = False
    order_instability: bool = False
    kill_rank: int = -1  # SIGKILL this rank mid-backward of the last step
    flush_interval_s: float = 2.0
    raise_on_violation: bool = False


SCENARIOS = {
    "clean": Scenario(),
    "clean-checkpoint-accumulation": Scenario(checkpoint="nonreentrant", no_sync=True,
                                              eval_between_steps=True),
    "clean-reentrant-checkpoint": Scenario(checkpoint="reentrant"),
    "wrong-forward-prefetch": Scenario(wrong_forward_prefetch=True),
    "wrong-backward-prefetch": Scenario(wrong_backward_prefetch=True),
    "missing-target": Scenario(missing_target=True),
    "bypassed-child": Scenario(bypassed_child=True),
    "rank-divergence": Scenario(rank_divergence=True),
    "config-divergence": Scenario(config_divergence=True),
    "pending-all-gather": Scenario(pending_all_gather=True),
    "order-instability": Scenario(order_instability=True),
    "killed-rank": Scenario(kill_rank=1, flush_interval_s=0.2),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class TinyModel(nn.Module):
    """Embedding, a stack of blocks, a norm and a head; ``adapter`` is an optional extra unit."""

    def __init__(self, sc: Scenario) -> None:
        super().__init__()
        self.sc = sc
        self.embed = nn.Embedding(32, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(NUM_LAYERS))
        self.adapter = Block()  # run only by scenarios that say so
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 32)
        self.order = list(range(NUM_LAYERS))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for index in self.order:
            layer = self.layers[index]
            if self.sc.checkpoint != "none" and torch.is_grad_enabled():
                h = checkpoint(layer, h, use_reentrant=self.sc.checkpoint == "reentrant")
            else:
                h = layer(h)
        if self.sc.bypassed_child:
            # Uses the adapter's weights without running its forward: FSDP never
            # reduces them through the unit's own hooks (the planted bug).
            h = h + torch.nn.functional.linear(h, self.adapter.fc1.weight)
        return self.head(self.norm(h))


def build(sc: Scenario, rank: int) -> tuple[TinyModel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyModel(sc)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model.adapter)
    fully_shard(model)
    layers = list(model.layers)
    if sc.rank_divergence:
        # Explicit prefetch would make the ranks issue different numbers of all-gathers and
        # hang; without it, they pair same-shaped collectives crosswise and go on silently.
        if rank == 1:
            model.order = [0, 2, 1, 3]
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)
    for i, layer in enumerate(layers):
        forward = [layers[i + 1]] if i + 1 < len(layers) else []
        backward = [layers[i - 1]] if i > 0 else []
        layer.set_modules_to_forward_prefetch(forward)
        layer.set_modules_to_backward_prefetch(backward)
    if sc.wrong_forward_prefetch:
        layers[2].set_modules_to_forward_prefetch([layers[1]])
    if sc.wrong_backward_prefetch:
        layers[1].set_modules_to_backward_prefetch([layers[2]])
    if sc.missing_target:
        layers[3].set_modules_to_forward_prefetch([model.adapter])
    if sc.config_divergence and rank == 1:
        layers[0].set_modules_to_forward_prefetch([layers[2]])
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train(sc: Scenario, run_dir: Path, rank: int) -> list[float]:
    model, optimizer = build(sc, rank)
    losses = []
    generator = torch.Generator().manual_seed(rank)
    with fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer,
                          raise_on_violation=sc.raise_on_violation,
                          flush_interval_s=sc.flush_interval_s):
        for step in range(sc.steps):
            if sc.order_instability:
                model.order = [0, 2, 1, 3] if step == 1 else list(range(NUM_LAYERS))
            for micro in range(sc.micro_steps):
                last = micro == sc.micro_steps - 1
                if sc.no_sync:
                    model.set_requires_gradient_sync(last)
                if sc.pending_all_gather:
                    # Never the last backward: finalize_backward never drops the stray gather.
                    model.set_is_last_backward(False)
                if sc.bypassed_child:
                    model.adapter.unshard()
                tokens = torch.randint(0, 32, (32,), generator=generator)
                loss = model(tokens).float().pow(2).mean()
                if sc.kill_rank == rank and step == sc.steps - 1:
                    _die_mid_backward(loss, after_s=sc.flush_interval_s * 3)
                loss.backward()
                losses.append(loss.item())
            if sc.pending_all_gather:
                model.layers[1].unshard()  # a gather nobody waits for before the step
            optimizer.step()
            optimizer.zero_grad()
            if sc.eval_between_steps:
                with torch.no_grad():
                    model(torch.randint(0, 32, (16,), generator=generator))
    return losses


def _die_mid_backward(loss: torch.Tensor, *, after_s: float) -> None:
    """SIGKILL this process from inside backward, once the periodic flush has run."""
    def kill(grad: torch.Tensor) -> torch.Tensor:
        time.sleep(after_s)
        os.kill(os.getpid(), signal.SIGKILL)
        return grad

    loss.register_hook(kill)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="one run dir per scenario here")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per scenario (default: each scenario's own, 3); "
                             "the shipped samples use fewer to stay tiny")
    parser.add_argument("scenarios", nargs="*", default=["clean"], choices=sorted(SCENARIOS))
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for name in args.scenarios:
            sc = SCENARIOS[name]
            if args.steps is not None:
                sc = replace(sc, steps=args.steps)
            losses = train(sc, args.out / name, rank)
            if rank == 0:
                print(f"{name}: final loss {losses[-1]:.4f}", flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
