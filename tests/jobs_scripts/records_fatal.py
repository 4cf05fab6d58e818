"""A rank that dies by ``os.abort()`` in its own training code, mid-micro-step.

``python records_fatal.py --out DIR`` on 2 gloo ranks records into ``DIR``. At step 1 rank 1
calls ``planted_abort()`` between the forward and the backward (the frame the test looks for
in the dump); rank 0 then waits in its backward's reduce-scatter until gloo sees the closed
connection. Each rank writes ``ready.rank<r>`` after step 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import fsdptrace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records_params import build  # noqa: E402


def planted_abort() -> None:
    os.abort()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    model = build("layout")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with fsdptrace.attach(model, run_dir=args.out, optimizer=optimizer):
        for step in range(3):
            tokens = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(step))
            loss = model(tokens).sum()
            if step == 1 and rank == 1:
                planted_abort()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
