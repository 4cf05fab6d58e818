"""An HF accelerate loop on FSDP2 (its ``FullyShardedDataParallelPlugin(fsdp_version=2)``), as
its users write it, on CPU/gloo:

    fsdptrace record --run-dir RUN -- accelerate launch --num_processes 2 \\
        trainer_accelerate.py CASE --out DIR

6 batches per rank through ``accelerator.accumulate`` with ``gradient_accumulation_steps=2``
(3 optimizer steps of 2 micro-steps), a no-grad evaluation batch after the second step.

CPU shim (kept here on purpose): accelerate honours its FSDP plugin only for GPU-type
distributed setups; on CPU ``AcceleratorState`` says ``MULTI_CPU`` and ``prepare`` silently
wraps the model in DDP. Setting the two fields it would set on GPU (``distributed_type = FSDP``
and ``fsdp_plugin``) makes ``prepare`` run its FSDP2 path unchanged (``fsdp2_prepare_model``:
``fully_shard`` on each ``Block`` and the root).

Cases: ``clean``; ``bad_prefetch+crash`` (``layers.2`` wired to forward-prefetch ``layers.0``,
which ran first, and rank 1 raises on its batch of step 2); ``attach`` (``clean`` with
``fsdptrace.attach(model, optimizer=<AcceleratedOptimizer>)``, no ``fsdptrace record``).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs
from torch.utils.data import DataLoader, TensorDataset

DIM = 8
NUM_LAYERS = 3
ACCUMULATE = 2
BATCH = 4
NUM_TRAIN_SAMPLES = 48  # 6 batches of 4 per rank
EVAL_AFTER_NUM_STEPS = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(NUM_LAYERS))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_accelerator() -> Accelerator:
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"], reshard_after_forward=True)
    accelerator = Accelerator(
        cpu=True,  # else on a host without GPUs each process thinks it runs alone
        fsdp_plugin=plugin, gradient_accumulation_steps=ACCUMULATE,
        # Bounds the wait for a dead peer.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=60))])
    # The CPU shim (module docstring): what accelerate sets on GPU.
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["clean", "bad_prefetch+crash", "attach"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    accelerator = make_accelerator()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = DataLoader(TensorDataset(torch.randn(NUM_TRAIN_SAMPLES, DIM,
                                                generator=torch.Generator().manual_seed(0))),
                      batch_size=BATCH)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    rank = accelerator.process_index
    faults = args.case.split("+")
    if "bad_prefetch" in faults:
        model.layers[2].set_modules_to_forward_prefetch([model.layers[0]])
    recorder = None
    if args.case == "attach":
        import fsdptrace

        recorder = fsdptrace.attach(model, optimizer=optimizer)
    num_steps = 0
    for (x,) in data:
        with accelerator.accumulate(model):
            if "crash" in faults and rank == 1 and num_steps == 2:
                raise RuntimeError("planted bad batch on rank 1")
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            num_steps += 1
            if num_steps == EVAL_AFTER_NUM_STEPS:
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
    if recorder is not None:
        recorder.close()
    result = {"num_steps": num_steps, "model_type": type(model).__name__,
              "optimizer_type": type(optimizer).__name__,
              "distributed_type": str(accelerator.distributed_type)}
    (args.out / f"result.rank{rank}.json").write_text(json.dumps(result))
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
