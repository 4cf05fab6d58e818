"""A 400-step 2-rank FSDP2 job recorded whole (``whole``), and the same job recorded with
``steps="100:110"`` (``window``) for 120 steps: ten unrecorded steps after the window show it
stays closed, and the 280 more the whole run takes would only cost the suite time."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdptrace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import process_group  # noqa: E402

# Each run: which steps are recorded, and how many the job trains.
RUNS = {"whole": (None, 400), "window": ("100:110", 120)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    with process_group():
        record(args.out)
    return 0


def record(out: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for name, (steps, num_steps) in RUNS.items():
        with fsdptrace.attach(model, run_dir=out / name, optimizer=optimizer, steps=steps):
            for _ in range(num_steps):
                model(torch.randn(4, 8)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()


if __name__ == "__main__":
    sys.exit(main())
