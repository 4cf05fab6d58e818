"""``plain_train.py`` with an explicit ``fsdptrace.attach`` (zero-code recording tests).

    attach_train.py [--no-optimizer] [--late]

``--no-optimizer`` attaches without ``optimizer=``; ``--late`` attaches only after the first
optimizer step, when zero-code recording has already attached on its own.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from plain_train import NUM_STEPS, build, init_process_group, train

import fsdptrace


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-optimizer", action="store_true")
    parser.add_argument("--late", action="store_true")
    args = parser.parse_args()
    init_process_group()
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    steps_before = 1 if args.late else 0
    if steps_before:
        train(model, optimizer, num_steps=steps_before)
    recorder = fsdptrace.attach(model, optimizer=None if args.no_optimizer else optimizer)
    train(model, optimizer, num_steps=NUM_STEPS - steps_before, seed=1)
    recorder.close()
    print(f"rank {dist.get_rank()}: recorded into {recorder.run_dir}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
