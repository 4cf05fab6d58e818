"""A training loop that issues its own collectives on FSDP2's group around FSDP's passes.

``python collective_numbers.py --out DIR`` on 2 gloo ranks records into ``DIR``. FSDP2's
default 1-D mesh uses the default process group, and so does every collective below: a loss
all-reduced between forward and backward, ``clip_grad_norm_`` (an all-reduce of the DTensor
gradient norms) before ``optimizer.step()``, eval forwards with a metric all-reduced between
them, a barrier per step; gradient accumulation over 2 micro-steps. The truth is read by
a wrapper around FSDP2's ``foreach_all_gather``/``foreach_reduce`` installed before
fsdptrace's: the group's own counter, plus one, as each collective is about to be issued.
Each rank writes that list to ``result.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

import fsdptrace

DIM = 8
STEPS = 3
MICRO_STEPS = 2


def read_counter(original: Callable[..., Any], group_at: int, truth: list[int]
                 ) -> Callable[..., Any]:
    """``original`` after noting the counter of its process group argument (by position)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        group = args[group_at] if len(args) > group_at else kwargs["reduce_scatter_group"]
        truth.append(group._get_sequence_number_for_group() + 1)
        return original(*args, **kwargs)
    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    truth: list[int] = []
    _fsdp_param_group.foreach_all_gather = read_counter(
        _fsdp_param_group.foreach_all_gather, 1, truth)
    _fsdp_param_group.foreach_reduce = read_counter(_fsdp_param_group.foreach_reduce, 2, truth)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(3)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(4, DIM)
    with fsdptrace.attach(model, run_dir=args.out, optimizer=optimizer):
        for _ in range(STEPS):
            for _ in range(MICRO_STEPS):
                loss = model(batch).sum()
                dist.all_reduce(loss.detach().clone())
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                model(batch)
                dist.all_reduce(torch.ones(1))
                model(batch)
            dist.barrier()
    (args.out / f"result.rank{rank}.json").write_text(json.dumps({"truth": truth}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
