"""What all-gather provenance adds to the recorder: µs per unit per micro-step, same run.

Two ranks on CPU/gloo (spawned here), a stack of ``fully_shard`` units with explicit one-ahead
prefetch, 2 micro-steps per optimizer step. Three variants take turns in one job (rotating
order, repeated): no recording, the recorder with provenance switched off (this script swaps
``provenance.install`` for a no-op; the package is not touched), and the full recorder. The
figure is (variant - no recording) / (units x micro-steps), min and median over repetitions.

    python benchmarks/provenance_overhead.py            # about a minute on 2 cores
    python benchmarks/provenance_overhead.py --quick    # smoke test
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
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import build_fsdp_stack, free_port, min_median, print_table, rotated  # noqa: E402

VARIANTS = ("off", "recorder", "recorder+provenance")
MICRO_STEPS = 2


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
           num_steps: int) -> float:
    start = time.perf_counter()
    for _ in range(num_steps):
        for _ in range(MICRO_STEPS):
            model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / num_steps


def _run_variant(variant: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 x: torch.Tensor, num_steps: int, run_dir: str) -> float:
    import fsdptrace
    from fsdptrace.record import provenance

    if variant == "off":
        return _steps(model, optimizer, x, num_steps)
    original = provenance.install
    if variant == "recorder":
        provenance.install = lambda rec: []  # type: ignore[assignment]
    try:
        with fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer):
            return _steps(model, optimizer, x, num_steps)
    finally:
        provenance.install = original  # type: ignore[assignment]


def _worker(rank: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, optimizer = build_fsdp_stack(args.units - 1, args.dim)
    x = torch.randn(4, args.dim)
    _steps(model, optimizer, x, 2)  # warm-up: lazy init, allocator
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for variant in rotated(VARIANTS, rep):
                run_dir = os.path.join(tmp, f"{variant}-{rep}")
                dist.barrier()
                samples[variant].append(
                    _run_variant(variant, model, optimizer, x, args.steps, run_dir))
    if rank == 0:
        out.update(samples)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=33, help="FSDP units incl. the root")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per sample")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.units, args.steps, args.reps = 9, 2, 3
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(free_port(), args, out), nprocs=2, join=True)
        samples = dict(out)
    per = args.units * MICRO_STEPS
    base = min_median(samples["off"])
    rows = []
    for variant in VARIANTS:
        lo, med = min_median(samples[variant])
        rows.append((variant, lo * 1e3, med * 1e3, (lo - base[0]) / per * 1e6,
                     (med - base[1]) / per * 1e6))
    print_table(f"{args.units} units x {MICRO_STEPS} micro-steps, {args.reps} reps, rank 0",
                ["variant", "step ms (min)", "step ms (median)", "µs/unit/micro (min)",
                 "µs/unit/micro (median)"], rows)
    lo = (min_median(samples["recorder+provenance"])[0] - min_median(samples["recorder"])[0])
    print(f"\nprovenance alone: {lo / per * 1e6:.2f} µs per unit per micro-step (min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
