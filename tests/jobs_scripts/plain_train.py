"""A plain FSDP2 training script that knows nothing of fsdptrace (zero-code recording tests).

    torchrun --nproc-per-node 2 tests/jobs_scripts/plain_train.py
    python tests/jobs_scripts/plain_train.py          # one process, world size 1

Each layer and the root are fully_shard units, with explicit forward/backward prefetch;
3 optimizer steps of 2 micro-steps, and a no-grad eval forward after each step.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

DIM = 8
NUM_LAYERS = 3
NUM_STEPS = 3
NUM_MICRO_STEPS = 2


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(NUM_LAYERS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def build() -> Model:
    torch.manual_seed(0)
    model = Model()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])
        layer.set_modules_to_backward_prefetch(layers[i - 1 : i] if i > 0 else [])
    return model


def init_process_group() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, num_steps: int = NUM_STEPS, seed: int = 0
) -> float:
    generator = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    loss = torch.zeros(())
    for _ in range(num_steps):
        for _ in range(NUM_MICRO_STEPS):
            loss = model(torch.randn(4, DIM, generator=generator)).pow(2).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model(torch.randn(4, DIM, generator=generator))
    return loss.item()


def main() -> int:
    init_process_group()
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loss = train(model, optimizer)
    print(
        f"rank {dist.get_rank()}: loss {loss:.4f} fsdptrace imported: {'fsdptrace' in sys.modules}",
        flush=True,
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
