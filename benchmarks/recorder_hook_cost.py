"""Hook cost of the recorder per FSDP unit per micro-step, against the floor of empty hooks.

One process, FSDP2 on a 1-rank gloo group, a stack of tiny ``fully_shard`` units (so FSDP's
own per-unit work is as small as it gets and the hooks show). Three variants take turns:

- no hooks: the FSDP2 model as it is;
- empty hooks: on every unit module an empty forward pre-hook and a forward hook that puts an
  empty gradient hook on the output (both prepended, like the recorder's), the floor of what
  any recorder of forward entry and backward entry must pay;
- fsdptrace: ``fsdptrace.attach(model)``.

The figure is the time each variant adds over "no hooks", per unit per micro-step (fwd+bwd),
and fsdptrace's added cost divided by the floor's (target <= 2). Optimizer-step boundaries are
timed separately (they run once per step, not per unit per micro-step).

    python benchmarks/recorder_hook_cost.py            # about 1 minute
    python benchmarks/recorder_hook_cost.py --quick    # smoke test, under 20 s
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import build_fsdp_stack, free_port, print_table, rotated  # noqa: E402

NONE = "no hooks"
EMPTY = "empty hooks (floor)"
FSDPTRACE = "fsdptrace"
VARIANTS = [NONE, EMPTY, FSDPTRACE]


@dataclass(frozen=True)
class Config:
    num_units: int = 64
    dim: int = 8
    batch: int = 4
    reps: int = 15
    micro_steps_per_rep: int = 8


QUICK = Config(num_units=32, reps=4, micro_steps_per_rep=4)

# ``--clock cpu`` times the training thread's CPU time (in ``bare`` mode one process does all
# the work on that thread): on a shared box the wall time of a few-ms micro-step mostly
# measures the other processes.
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCKS["wall"]


def _empty_pre_hook(module: Any, args: Any) -> None:
    return None


def _empty_grad_hook(grad: torch.Tensor) -> None:
    return None


def _empty_forward_hook(module: Any, args: Any, output: Any) -> None:
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(_empty_grad_hook)


def install_empty_hooks(model: torch.nn.Module) -> Callable[[], None]:
    """The floor: the same three hook points the recorder uses, with empty bodies."""
    from torch.distributed.fsdp import FSDPModule

    handles = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            handles.append(module.register_forward_pre_hook(_empty_pre_hook, prepend=True))
            handles.append(module.register_forward_hook(_empty_forward_hook, prepend=True))

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def micro_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()


def detach_fsdp_hooks(model: torch.nn.Module) -> None:
    """Unshard every unit for good and take FSDP's own forward hooks off.

    What is left computes like plain modules (no collectives, no FSDP hooks) but still carries
    the FSDP states the recorder discovers units from, so its hooks' cost is no longer hidden
    under a 1-rank gloo all-gather and reduce-scatter per unit (~400 µs on a 2-core box).
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in units:
        module.unshard()
    for module in units:
        state = module._get_fsdp_state()
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()


def measure(cfg: Config, tmp: Path, *, bare: bool
            ) -> tuple[dict[str, list[list[float]]], list[float]]:
    """Per-micro-step seconds of each variant (per rep), and fsdptrace boundary seconds."""
    import fsdptrace

    model, optimizer = build_fsdp_stack(cfg.num_units - 1, cfg.dim, prefetch=True)
    x = torch.randn(cfg.batch, cfg.dim)
    for _ in range(3):
        micro_step(model, x)
    optimizer.zero_grad(set_to_none=True)
    if bare:
        detach_fsdp_hooks(model)
        micro_step(model, x)
    times: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    boundary: list[float] = []
    first_boundary: list[float] = []
    recorded: list[float] = []
    for rep in range(cfg.reps):
        for name in rotated(VARIANTS, rep):
            remove: Callable[[], None] = lambda: None  # noqa: E731
            rec = None
            if name == EMPTY:
                remove = install_empty_hooks(model)
            elif name == FSDPTRACE:
                rec = fsdptrace.attach(model, run_dir=tmp / f"{bare}-{rep}", rank=0, world_size=1)
                remove = rec.close
            micro_step(model, x)  # warm: the first micro-step after attach takes snapshots
            if rec is not None:
                # The first boundary of a recorder fills its caches (labels, groups): timed
                # apart, since a job pays it once and every later step the warm cost.
                start = clock()
                rec.before_optimizer_step()
                first_boundary.append(clock() - start)
                rec.flush()  # the block below times hooks; recorder_overhead times flushes
                for p in model.parameters():
                    p.grad = None
            gc.collect()
            block = []
            seq_before = rec._seq if rec is not None else 0
            for _ in range(cfg.micro_steps_per_rep):
                start = clock()
                micro_step(model, x)
                block.append(clock() - start)
            if rec is not None:
                recorded.append((rec._seq - seq_before) / cfg.micro_steps_per_rep)
                start = clock()
                rec.before_optimizer_step()
                boundary.append(clock() - start)
            for p in model.parameters():
                p.grad = None
            remove()
            times[name].append(block)
    # A sanity check that the recorder really recorded: 2 events per unit + 1 marker.
    print(f"fsdptrace rows per micro-step: {statistics.median(recorded):.0f} "
          f"(expected {2 * cfg.num_units + 1})")
    print(f"first boundary of a recorder: min {min(first_boundary) * 1e6:.0f} µs, "
          f"median {statistics.median(first_boundary) * 1e6:.0f} µs")
    return times, boundary


def report(cfg: Config, times: dict[str, list[list[float]]], boundary: list[float], *,
           bare: bool) -> None:
    n = cfg.num_units
    flat = {v: [t for block in times[v] for t in block] for v in VARIANTS}
    base_min = min(flat[NONE])
    # Per rep, each variant's fastest micro-step minus that of "no hooks" in the same rep:
    # the minimum of a block is the sample least disturbed by the box's other tenants.
    added = {v: [min(b) - min(r)
                 for b, r in zip(times[v], times[NONE], strict=True)] for v in VARIANTS}
    rows = []
    for v in VARIANTS:
        rows.append([v, min(flat[v]) / n * 1e6, statistics.median(flat[v]) / n * 1e6,
                     (min(flat[v]) - base_min) / n * 1e6,
                     statistics.median(added[v]) / n * 1e6])
    floor_min = min(flat[EMPTY]) - base_min
    rec_min = min(flat[FSDPTRACE]) - base_min
    ratio_per_rep = [a / f for a, f in zip(added[FSDPTRACE], added[EMPTY], strict=True) if f > 0]
    mode = ("units unsharded, FSDP hooks detached (hook cost resolved)" if bare
            else "full FSDP2 (hook cost under collective noise)")
    print_table(
        f"[{mode}] µs per unit per micro-step (fwd+bwd), 1-rank gloo, {n} units of "
        f"2 x Linear({cfg.dim},{cfg.dim}), {cfg.reps} reps x {cfg.micro_steps_per_rep} "
        "micro-steps interleaved",
        ["variant", "min", "median", "added over no hooks (min-min)",
         "added over no hooks (median over reps of per-rep min-min)"],
        rows)
    print_table(
        f"[{mode}] fsdptrace hook cost ÷ empty-hook floor (target <= 2)",
        ["estimate", "ratio"],
        [["min-based: (fsdptrace - none) / (empty - none)",
          rec_min / floor_min if floor_min > 0 else "floor not resolved"],
         ["median of per-rep ratios",
          statistics.median(ratio_per_rep) if ratio_per_rep else "floor not resolved"]])
    if boundary:
        print_table(
            f"[{mode}] fsdptrace optimizer-step boundary (before_optimizer_step), once per step "
            "(a recorder's second boundary; its first is printed above)",
            ["figure", "µs"],
            [["min", min(boundary) * 1e6], ["median", statistics.median(boundary) * 1e6],
             ["median per unit", statistics.median(boundary) / n * 1e6]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (< 20 s)")
    parser.add_argument("--reps", type=int, help="interleaved repetitions per variant")
    parser.add_argument("--units", type=int, help="FSDP units in the model")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="cpu: the training thread's CPU time (a busy shared box)")
    parser.add_argument("--mode", choices=["bare", "fsdp", "both"], default="both",
                        help="bare: FSDP hooks detached (precise); fsdp: full FSDP2 (realistic)")
    args = parser.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    cfg = QUICK if args.quick else Config()
    overrides = {k: v for k, v in (("reps", args.reps), ("num_units", args.units)) if v}
    cfg = Config(**{**asdict(cfg), **overrides})
    torch.set_num_threads(1)
    started = time.perf_counter()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        with tempfile.TemporaryDirectory(prefix="fsdptrace-bench-") as tmp:
            for bare in {"bare": [True], "fsdp": [False], "both": [True, False]}[args.mode]:
                times, boundary = measure(cfg, Path(tmp), bare=bare)
                report(cfg, times, boundary, bare=bare)
    finally:
        dist.destroy_process_group()
    print(f"\n(total {time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
