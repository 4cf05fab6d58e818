"""Jobs for the watcher's tests: hangs it must call, pauses and stragglers it must not.

``python watch_job.py --out RUN_DIR --case CASE [--seconds S] [--steps N] [--go FILE]`` on
2 or 4 gloo ranks, recording into RUN_DIR (``fsdptrace.attach``, or ``fsdptrace record``
around it); with ``--go`` the ranks train only once FILE exists.

- ``sleep_forward``: at step 2, rank 1 sleeps for good inside ``layers.2``'s forward (a
  pre-hook of its ``fc``, after FSDP gathered the unit); the others go on to ``layers.3``.
- ``skip_layer``, ``extra_eval``: ``verdict_job``'s cases, with a collective timeout long
  enough that the job hangs instead of failing (the watcher must speak first).
- ``pause``: every rank sleeps S seconds after step 1's optimizer step (a checkpoint save).
- ``straggler``: rank 1 sleeps S seconds before each forward (slow data loading).

Each rank writes ``stopping.rank<r>`` (the wall time) just before it hangs on purpose.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdptrace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verdict_job import batch, extra_eval, sharded, skip_layer, stopping  # noqa: E402

HANG_TIMEOUT = timedelta(seconds=600)


def _sleep_in_forward(out: Path, rank: int) -> None:
    """The job's own frame a stack of the hung rank shows."""
    stopping(out, rank)
    while True:
        time.sleep(0.5)


def sleep_forward(net: Any, optimizer: Any, rank: int, args: argparse.Namespace) -> None:
    for step in range(args.steps):
        if step == 2 and rank == 1:
            net.layers[2].fc.register_forward_pre_hook(
                lambda *_: _sleep_in_forward(args.out, rank))
        net(batch()).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def pause(net: Any, optimizer: Any, rank: int, args: argparse.Namespace) -> None:
    for step in range(args.steps):
        net(batch()).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            stopping(args.out, rank)
            time.sleep(args.seconds)


def straggler(net: Any, optimizer: Any, rank: int, args: argparse.Namespace) -> None:
    for _ in range(args.steps):
        if rank == 1:
            time.sleep(args.seconds)
        net(batch()).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _verdict_case(case: Any) -> Any:
    def run(net: Any, optimizer: Any, rank: int, args: argparse.Namespace) -> None:
        case(net, optimizer, rank, False, args.out, {})
    return run


CASES = {"sleep_forward": sleep_forward, "pause": pause, "straggler": straggler,
         "skip_layer": _verdict_case(skip_layer), "extra_eval": _verdict_case(extra_eval)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--go", type=Path, help="wait for this file before training (a test "
                        "starts its watcher first)")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=HANG_TIMEOUT)
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    net = sharded()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with fsdptrace.attach(net, run_dir=args.out, optimizer=optimizer):
        while args.go is not None and not args.go.exists():
            time.sleep(0.1)
        CASES[args.case](net, optimizer, rank, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
