"""The unsharded-memory ledger's real job: four ``Linear(512, 512)`` units under a root, 2 steps.

``keep`` shards with ``reshard_after_forward=False``: every unit stays unsharded from its
forward until its backward. ``default`` reshards after each forward.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdptrace

DIM = 512  # 1 MiB per unit: the ledger's excess passes unsharded-excess's thresholds


def main() -> None:
    run_dir, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
