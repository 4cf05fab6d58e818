"""The unsharded-memory ledger's real job: four ``Linear(512, 512)`` units under a root, 2 steps.

``python ledger_job.py --out DIR MODE...`` records each mode into ``DIR/MODE``.
``keep`` shards with ``reshard_after_forward=False``: every unit stays unsharded from its
forward until its backward. ``default`` reshards after each forward.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdptrace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import run_cases  # noqa: E402

DIM = 512  # 1 MiB per unit: the ledger's excess passes unsharded-excess's thresholds


def record(run_dir: Path, mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(4)])
    for layer in [*model, model]:
        fully_shard(layer, reshard_after_forward=mode != "keep")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer):
        for _ in range(2):
            model(torch.randn(4, DIM)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("modes", nargs="+", choices=["default", "keep"])
    args = parser.parse_args(argv)
    run_cases(args.modes, lambda mode, rank: record(args.out / mode, mode))


if __name__ == "__main__":
    main()
