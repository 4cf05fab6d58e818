"""A Lightning fit on FSDP2 (``ModelParallelStrategy``, CPU, gloo, 2 ranks), as its users write it.

    fsdptrace record --run-dir RUN -- python trainer_lightning.py CASE [--accumulate N]
        [--uneven-val]

Lightning launches rank 1 itself (it re-runs this script with its rank in the environment),
so the command is the one a user types. Automatic optimization runs each training forward and
backward inside ``optimizer.step(closure)``. Nothing here knows of fsdptrace except the
``attach`` case (explicit ``attach(optimizer=LightningOptimizer)``, issue 30 item 7).

Cases: ``clean`` (1 epoch of 6 training batches per rank, then validation of 2 batches);
``bad_prefetch`` (a callback wires ``layers.2`` to forward-prefetch ``layers.0``, which runs
before it); ``attach`` (``clean`` with the recorder attached in ``on_train_start`` to the
``LightningOptimizer``). ``--uneven-val``: the data is sharded by hand
(``use_distributed_sampler=False``) and rank 0's validation set holds one batch more than
rank 1's, as with hand-sharded validation files of different sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DIM = 8
NUM_LAYERS = 3
BATCH = 4
# Lightning gives each rank its share through a DistributedSampler: 6 training batches and 2
# validation batches per rank.
NUM_TRAIN_SAMPLES = 48
NUM_VAL_SAMPLES = 16


class Net(pl.LightningModule):
    def __init__(self, case: str, out: str, uneven_val: bool) -> None:
        super().__init__()
        self.case = case
        self.out = out
        self.uneven_val = uneven_val
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(NUM_LAYERS))
        self.head = nn.Linear(DIM, 1)

    def configure_model(self) -> None:
        # Lightning's documented FSDP2 recipe: shard each block, then the root, on its mesh.
        mesh = self.device_mesh["data_parallel"]
        for layer in self.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x).pow(2).mean()

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (x,) = batch
        self.log("val_loss", self(x).pow(2).mean(), sync_dist=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return _data(0, NUM_TRAIN_SAMPLES, self.global_rank if self.uneven_val else None)

    def val_dataloader(self) -> DataLoader:
        if not self.uneven_val:
            return _data(1, NUM_VAL_SAMPLES)
        # Sharded by hand, unevenly: rank 0 gets one batch more than rank 1.
        num = NUM_VAL_SAMPLES // 2 + (BATCH if self.global_rank == 0 else 0)
        return _data(1 + self.global_rank, num)


class WrongPrefetch(pl.Callback):
    """Wires a forward prefetch whose target has already run: check 1 must find it."""

    def on_train_start(self, trainer: pl.Trainer, module: Net) -> None:
        module.layers[2].set_modules_to_forward_prefetch([module.layers[0]])


class AttachToLightningOptimizer(pl.Callback):
    """The explicit one-liner with the optimizer a Lightning user holds: a LightningOptimizer."""

    def on_train_start(self, trainer: pl.Trainer, module: Net) -> None:
        import fsdptrace

        optimizer = module.optimizers()
        module.recorder = fsdptrace.attach(module, optimizer=optimizer)
        _write(module.out, trainer.global_rank,
               {"optimizer_type": type(optimizer).__name__})

    def on_train_end(self, trainer: pl.Trainer, module: Net) -> None:
        module.recorder.close()


def _write(out: str, rank: int, result: dict) -> None:
    with open(os.path.join(out, f"result.rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _data(seed: int, num: int, rank: int | None = None) -> DataLoader:
    """``num`` samples; this rank's half of them when ``rank`` is given (a sampler of one's own,
    as with ``use_distributed_sampler=False``), else Lightning's sampler shards them."""
    generator = torch.Generator().manual_seed(seed)
    dataset = TensorDataset(torch.randn(num, DIM, generator=generator))
    sampler = (None if rank is None
               else DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=False))
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["clean", "bad_prefetch", "attach"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--uneven-val", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    callbacks: list[pl.Callback] = {
        "bad_prefetch": [WrongPrefetch()], "attach": [AttachToLightningOptimizer()],
    }.get(args.case, [])
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, num_nodes=1, max_epochs=1,
        # "auto" would make the mesh (data_parallel=1, tensor_parallel=2) on one node: FSDP over
        # 1 rank, no collective between the ranks. The timeout bounds a wait for a dead peer.
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                       timeout=timedelta(seconds=60)),
        accumulate_grad_batches=args.accumulate, callbacks=callbacks, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=not args.uneven_val,
    )
    trainer.fit(Net(args.case, args.out, args.uneven_val))
    if args.case != "attach":
        _write(args.out, trainer.global_rank, {"global_step": trainer.global_step})
    return 0


if __name__ == "__main__":
    sys.exit(main())
