"""Record variants of one small FSDP2 model, each into its own run dir (``fsdptrace diff`` tests).

    diff_variants.py --out OUT [VARIANT...]

``base``: 3 ``layers`` units with chained prefetch; ``fewer``: one layer less; ``renamed``:
the same layers under ``blocks``; ``no-reshard``: ``layers.1`` keeps its parameters after
forward. 2 optimizer steps of 2 micro-steps each, one variant after another in one job.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdptrace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import run_cases  # noqa: E402

DIM = 8
VARIANTS = ("base", "fewer", "renamed", "no-reshard")


class Model(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        stack = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2 if variant == "fewer" else 3))
        self.stack_name = "blocks" if variant == "renamed" else "layers"
        self.add_module(self.stack_name, stack)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in getattr(self, self.stack_name):
            x = torch.relu(layer(x))
        return self.head(x)


def build(variant: str) -> Model:
    torch.manual_seed(0)
    model = Model(variant)
    layers = list(getattr(model, model.stack_name))
    for i, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=not (variant == "no-reshard" and i == 1))
    fully_shard(model)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])
        layer.set_modules_to_backward_prefetch(layers[i - 1 : i])
    return model


def record(variant: str, run_dir: Path) -> None:
    model = build(variant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    recorder = fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        for _ in range(2):
            model(torch.randn(4, DIM, generator=generator)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    recorder.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("variants", nargs="*", help=f"of {', '.join(VARIANTS)} (default: all)")
    args = parser.parse_args(argv)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")
    run_cases(args.variants or VARIANTS,
              lambda variant, rank: record(variant, args.out / variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
