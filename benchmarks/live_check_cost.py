"""What the live option costs per optimizer step: checks 1-3 on one rank's clean step.

Drives real FSDP2 on one rank (gloo, CPU) with 8, 64 and 256 units (explicit one-ahead
prefetch), runs one step of 2 micro-steps recorded with ``raise_on_violation``, takes the
boundary snapshot once, then times ``raise_if_unsafe`` on that clean step many times (it
finds nothing, so it never writes). Also shown: the boundary snapshot itself, which every
recorded step pays with or without the live option.

    python benchmarks/live_check_cost.py [--reps 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import build_fsdp_stack, free_port, min_median, print_table  # noqa: E402

import fsdptrace  # noqa: E402
from fsdptrace.record import live, snapshots  # noqa: E402

SIZES = (8, 64, 256)
DIM = 8


def measure(num_units: int, reps: int, run_dir: Path) -> list[float]:
    """(min, median) µs of raise_if_unsafe and of the boundary snapshot, and events checked."""
    # The root is a unit too: num_units - 1 blocks.
    model, _ = build_fsdp_stack(num_units - 1, DIM)
    recorder = fsdptrace.attach(model, run_dir=run_dir, raise_on_violation=True,
                                flush_interval_s=3600)
    try:
        for _ in range(2):
            model(torch.randn(4, DIM)).pow(2).mean().backward()
        snapshot_us = _time(lambda: snapshots.record_boundary(recorder), reps)
        live.raise_if_unsafe(recorder)  # warm-up: imports pandas and the checks
        check_us = _time(lambda: live.raise_if_unsafe(recorder), reps)
        num_events = len(recorder.live_events or [])
    finally:
        recorder.close()
    return [*min_median(check_us), *min_median(snapshot_us), num_events]


def _time(fn: object, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()  # type: ignore[operator]
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for num_units in SIZES:
                figures = measure(num_units, args.reps, Path(tmp) / f"u{num_units}")
                rows.append([num_units, *figures])
    finally:
        dist.destroy_process_group()
    print_table(
        f"Live checks per optimizer step (1 rank, 2 micro-steps, {args.reps} reps, µs)",
        ["units", "checks min", "checks median", "snapshot min", "snapshot median",
         "events"],
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
