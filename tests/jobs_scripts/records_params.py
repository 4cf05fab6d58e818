"""Units whose managed parameters FSDP2 lists in another order than ``named_parameters``.

``python records_params.py --out DIR CASE`` on 2 gloo ranks records into ``DIR``:

- ``layout``: a root with a parameter of its own beside its children's (``scale``), a block
  (``Plus``) that adds ``bias2`` after ``super().__init__()``, and a tied embedding/head
  sharded as one grouped unit ``fully_shard([embed, head])``. Two clean steps; each rank writes
  FSDP2's own ``_param_fqn`` lists per unit (read after lazy init) to ``result.rank<r>.json``.
- ``own_param``: the same model; step 1 has two micro-steps, the first without gradient sync,
  and in that one rank 1 alone adds ``layers.1.bias2`` to its output. FSDP2 keeps the gradient
  on the unsharded parameter, so in micro-step 1 rank 1's ``layers.1`` reduce-scatters 5
  parameters against rank 0's 4: gloo aborts.
- ``skip``: three identical blocks; at step 1 rank 1 alone skips ``layers.1``. Its
  all-gathers then pair with rank 0's one unit early (same sizes, so gloo does not notice)
  until the collectives no longer match.
- ``swapped``: a fusion block with two same-shaped biases; at step 1 rank 0 uses ``img_bias``
  and rank 1 ``txt_bias``. Both reduce-scatter the same sizes, so the job finishes, reducing
  one rank's image bias gradient with the other's text bias gradient.
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdptrace

DIM = 8
STEPS = 2
COLLECTIVE_TIMEOUT = timedelta(seconds=6)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Plus(Block):
    """A subclass that registers its own parameter after its parent's children."""

    def __init__(self) -> None:
        super().__init__()
        self.bias2 = nn.Parameter(torch.zeros(DIM))
        self.use_bias2 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return h + self.bias2 if self.use_bias2 else h


class Fusion(Block):
    """Two modalities' biases of the same shape; ``modality`` picks one per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.img_bias = nn.Parameter(torch.zeros(DIM))
        self.txt_bias = nn.Parameter(torch.zeros(DIM))
        self.modality = "img"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.img_bias if self.modality == "img" else self.txt_bias
        return super().forward(x) + bias


class Net(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))
        self.embed = nn.Embedding(16, DIM)
        self.layers = nn.ModuleList([Block(), *blocks])
        self.skip: int | None = None
        self.head = nn.Linear(DIM, 16, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * self.scale
        for index, layer in enumerate(self.layers):
            if index != self.skip:
                h = layer(h)
        return self.head(h)  # type: ignore[no-any-return]


def build(case: str) -> Net:
    torch.manual_seed(0)
    blocks = {"swapped": [Fusion()], "skip": [Block(), Block()]}.get(case, [Plus()])
    model = Net(*blocks)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard([model.embed, model.head])
    fully_shard(model)
    return model


def train(case: str, out: Path, rank: int) -> None:
    model = build(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    result: dict[str, object] = {}
    with fsdptrace.attach(model, run_dir=out, optimizer=optimizer):
        for step in range(STEPS):
            last = model.layers[1]
            model.skip = 1 if case == "skip" and (step, rank) == (1, 1) else None
            num_micro_steps = 2 if case == "own_param" and step == 1 else 1
            for micro_step in range(num_micro_steps):
                model.set_requires_gradient_sync(micro_step == num_micro_steps - 1)
                if case == "own_param":
                    last.use_bias2 = (step, micro_step, rank) == (1, 0, 1)
                if case == "swapped":
                    last.modality = "txt" if step == 1 and rank == 1 else "img"
                tokens = torch.randint(0, 16, (4, 3),
                                       generator=torch.Generator().manual_seed(step))
                model(tokens).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        # FSDP2's own names, read after lazy init (the layout case's model).
        result["fsdp_fqns"] = {
            name: [p._param_fqn for group in module._get_fsdp_state()._fsdp_param_groups
                   for p in group.fsdp_params]
            for name, module in (("<root>", model), *(
                (f"layers.{i}", layer) for i, layer in enumerate(model.layers)),
                ("embed,head", model.embed))}
    (out / f"result.rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("case", choices=["layout", "own_param", "swapped", "skip"])
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        train(args.case, args.out, dist.get_rank())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
