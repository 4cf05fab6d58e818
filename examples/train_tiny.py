"""A plain FSDP2 training script with no fsdptrace in it: record it with zero code changes.

    fsdptrace record -- torchrun --nproc-per-node 2 examples/train_tiny.py

By default it carries one classic mistake, a forward prefetch wired backwards
(``layers[2]`` prefetches ``layers[1]``, which already ran); ``--fixed`` wires it right.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-steps", type=int, default=2)
    parser.add_argument("--fixed", action="store_true", help="wire the prefetch correctly")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), *[Block(32) for _ in range(4)], nn.Linear(32, 64))
    layers = list(model)[1:5]
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    for i, layer in enumerate(layers[:-1]):
        layer.set_modules_to_forward_prefetch([layers[i + 1]])
    if not args.fixed:
        layers[2].set_modules_to_forward_prefetch([layers[1]])  # the planted mistake
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    for step in range(args.steps):
        for _ in range(args.micro_steps):
            tokens = torch.randint(0, 64, (64,))
            loss = model(tokens).pow(2).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
