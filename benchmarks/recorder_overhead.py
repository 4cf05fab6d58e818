"""What recording costs a real FSDP2 job: step time, hook latency, disk volume.

Two ranks on CPU/gloo (spawned here), a stack of ``fully_shard`` units with explicit one-ahead
forward and backward prefetch and 2 micro-steps per optimizer step. Three measurements:

1. step time of each variant divided by the step time without recording, all variants taking
   turns in the same job (no recording, fsdptrace, fsdptrace with ``raise_on_violation=True``,
   ``torch.profiler.profile()`` with default settings); target for fsdptrace <= 1.02;
2. how long a single recorder hook or boundary call takes (every hook is wrapped by this
   script with a timer; the package is not touched). The Parquet writing runs in the
   recorder's writer process, so it no longer competes with the hooks for the GIL;
3. disk bytes per event and per optimizer step for 80 units x 8 micro-steps.

    python benchmarks/recorder_overhead.py            # about 2-3 minutes on 2 cores
    python benchmarks/recorder_overhead.py --quick    # smoke test, under 20 s
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    build_fsdp_stack,
    dir_bytes,
    free_port,
    min_median,
    percentile,
    print_table,
    rotated,
)

OFF = "no recording"
FSDPTRACE = "fsdptrace"
RAISING = "fsdptrace raise_on_violation"
PROFILER = "torch.profiler (defaults)"


@dataclass(frozen=True)
class Config:
    num_units: int = 32
    dim: int = 64
    batch: int = 16
    micro_steps: int = 2
    reps: int = 8
    steps_per_rep: int = 6
    latency_steps: int = 30
    disk_units: int = 80
    disk_micro_steps: int = 8
    disk_steps: int = 10
    with_profiler: bool = True


# The smoke test leaves out torch.profiler: its first start alone takes ~2 s here.
QUICK = Config(num_units=24, dim=32, reps=2, steps_per_rep=2, latency_steps=3, disk_steps=1,
               with_profiler=False)


# --------------------------------------------------------------------------- training loop
def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: Config,
               micro_steps: int, dim: int, generator: torch.Generator) -> None:
    for _ in range(micro_steps):
        x = torch.randn(cfg.batch, dim, generator=generator)
        model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def variant_context(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    run_dir: Path) -> Iterator[Any]:
    import fsdptrace

    if name == OFF:
        yield None
    elif name == PROFILER:
        with torch.profiler.profile() as prof:
            yield prof
    else:
        with fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer,
                              raise_on_violation=name == RAISING) as rec:
            yield rec


def live_checks_available() -> bool:
    return importlib.util.find_spec("fsdptrace.record.live") is not None


# --------------------------------------------------------------------------- 1. step time
def measure_step_time(cfg: Config, rank: int, tmp: Path) -> dict[str, Any]:
    model, optimizer = build_fsdp_stack(cfg.num_units - 1, cfg.dim)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):
        train_step(model, optimizer, cfg, cfg.micro_steps, cfg.dim, generator)
    variants = [OFF, FSDPTRACE] + ([PROFILER] if cfg.with_profiler else [])
    if live_checks_available():
        variants.insert(2, RAISING)
    times: dict[str, list[list[float]]] = {v: [] for v in variants}
    teardown: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(cfg.reps):
        for name in rotated(variants, rep):
            gc.collect()
            dist.barrier()
            exit_started = 0.0
            with variant_context(name, model, optimizer, tmp / f"steps-{name[:9]}-{rep}"):
                # The first step after attach pays one-off costs (lazy init, first snapshot).
                train_step(model, optimizer, cfg, cfg.micro_steps, cfg.dim, generator)
                block = []
                for _ in range(cfg.steps_per_rep):
                    start = time.perf_counter()
                    train_step(model, optimizer, cfg, cfg.micro_steps, cfg.dim, generator)
                    block.append(time.perf_counter() - start)
                times[name].append(block)
                exit_started = time.perf_counter()
            teardown[name].append(time.perf_counter() - exit_started)
    return {"variants": variants, "times": times, "teardown": teardown}


# --------------------------------------------------------------------------- 2. hook latency
class HookTimer:
    """Wraps every recorder hook and boundary call with a timer."""

    def __init__(self) -> None:
        self.samples: dict[str, list[int]] = {}

    def timed(self, kind: str, fn: Callable[..., Any],
              after: Callable[..., None] | None = None) -> Callable[..., Any]:
        samples = self.samples.setdefault(kind, [])

        def wrapper(*args: Any) -> Any:
            t0 = time.perf_counter_ns()
            result = fn(*args)
            samples.append(time.perf_counter_ns() - t0)
            if after is not None:
                after(*args)
            return result

        wrapper.__name__ = f"timed_{getattr(fn, '__name__', kind)}"
        return wrapper

    def install(self, rec: Any) -> None:
        from torch.utils.hooks import RemovableHandle

        from fsdptrace.record.hooks import _grad_tensors

        def wrap_grad_hooks(module: Any, args: Any, output: Any) -> None:
            # The recorder's forward hook just put on_first_grad on these tensors; swap each
            # for a timed copy in the tensor's hook dict (autograd reads it at call time).
            for tensor in _grad_tensors(output):
                hooks = tensor._backward_hooks or {}
                for key, hook in list(hooks.items()):
                    if getattr(hook, "__name__", "") == "on_first_grad":
                        hooks[key] = self.timed("backward grad hook", hook)

        kinds = {"unit_forward_pre_hook": "forward pre-hook",
                 "unit_forward_hook": "forward hook",
                 "part_forward_pre_hook": "part pre-hook (micro-step boundary)"}
        for handle in rec._handles:
            if not isinstance(handle, RemovableHandle):
                continue
            hooks = handle.hooks_dict_ref()
            fn = hooks[handle.id]
            kind = kinds.get(fn.__name__, fn.__name__)
            after = wrap_grad_hooks if kind == "forward hook" else None
            hooks[handle.id] = self.timed(kind, fn, after)
        rec.before_optimizer_step = self.timed("optimizer boundary (before_optimizer_step)",
                                               rec.before_optimizer_step)


def measure_hook_latency(cfg: Config, rank: int, tmp: Path) -> dict[str, Any]:
    import fsdptrace

    model, optimizer = build_fsdp_stack(cfg.num_units - 1, cfg.dim)
    generator = torch.Generator().manual_seed(rank)
    train_step(model, optimizer, cfg, cfg.micro_steps, cfg.dim, generator)
    timer = HookTimer()
    with fsdptrace.attach(model, run_dir=tmp / "latency", optimizer=optimizer) as rec:
        timer.install(rec)
        for _ in range(cfg.latency_steps):
            train_step(model, optimizer, cfg, cfg.micro_steps, cfg.dim, generator)
    return {"samples": timer.samples}


# --------------------------------------------------------------------------- 3. disk volume
def measure_disk(cfg: Config, rank: int, tmp: Path) -> dict[str, Any]:
    import pyarrow.parquet as pq

    import fsdptrace

    model, optimizer = build_fsdp_stack(cfg.disk_units - 1, 16)
    generator = torch.Generator().manual_seed(rank)
    run_dir = tmp / "disk"
    with fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer):
        for _ in range(cfg.disk_steps):
            train_step(model, optimizer, cfg, cfg.disk_micro_steps, 16, generator)
    tables = sorted(p.name for p in run_dir.iterdir() if p.is_dir())
    per_table = {t: dir_bytes(run_dir, table=t) for t in tables}
    rank_dir = f"rank={rank}"
    num_events = sum(pq.read_metadata(p).num_rows
                     for p in (run_dir / "events" / rank_dir).glob("*.parquet"))
    sizes = {t: _rank_bytes(run_dir / t / rank_dir) for t in tables}
    return {"tables": tables, "per_table_all_ranks": per_table, "rank_bytes": sizes,
            "num_events": num_events, "steps": cfg.disk_steps}


def _rank_bytes(directory: Path) -> tuple[int, int]:
    files = list(directory.glob("*"))
    return sum(f.stat().st_size for f in files), len(files)


# --------------------------------------------------------------------------- ranks
def worker(rank: int, cfg_dict: dict[str, Any], port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    cfg = Config(**cfg_dict)
    try:
        with tempfile.TemporaryDirectory(prefix="fsdptrace-bench-") as tmp_name:
            tmp = Path(tmp_name)
            results: dict[str, Any] = {"phase_s": {}}
            for phase, measure in (("steps", measure_step_time),
                                   ("latency", measure_hook_latency), ("disk", measure_disk)):
                started = time.perf_counter()
                results[phase] = measure(cfg, rank, tmp)
                dist.barrier()
                results["phase_s"][phase] = time.perf_counter() - started
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- report
def report(cfg: Config, results: dict[str, Any]) -> None:
    steps = results["steps"]
    times = steps["times"]
    base = times[OFF]
    base_min = min(min(block) for block in base)
    rows = []
    for name in steps["variants"]:
        flat = [t for block in times[name] for t in block]
        per_rep = [_median(block) / _median(ref)
                   for block, ref in zip(times[name], base, strict=True)]
        low, mid = min_median(flat)
        rows.append([name, low * 1e3, mid * 1e3, min(flat) / base_min, _median(per_rep),
                     _median(steps["teardown"][name]) * 1e3])
    if RAISING not in steps["variants"]:
        rows.append([RAISING, "n/a", "n/a", "n/a", "n/a (fsdptrace.record.live missing)", "n/a"])
    print_table(
        f"Step time, 2 ranks gloo/CPU, {cfg.num_units} units, dim {cfg.dim}, "
        f"{cfg.micro_steps} micro-steps/step, {cfg.reps} reps x {cfg.steps_per_rep} steps "
        "interleaved (rank 0)",
        ["variant", "min ms/step", "median ms/step", "min ÷ min(no rec)",
         "median of per-rep ratios", "close/exit ms (untimed)"],
        rows)

    latency = results["latency"]
    rows = []
    for kind, durations in latency["samples"].items():
        rows.append([kind, len(durations), percentile(durations, 50) / 1e3,
                     percentile(durations, 99) / 1e3, max(durations) / 1e3])
    print_table(
        f"Single-call latency of recorder hooks, µs ({cfg.latency_steps} steps)",
        ["call", "calls", "p50", "p99", "max"],
        rows)

    disk = results["disk"]
    rank_bytes = disk["rank_bytes"]
    total = sum(b for b, _ in rank_bytes.values())
    files = sum(n for _, n in rank_bytes.values())
    static = sum(rank_bytes.get(t, (0, 0))[0] for t in ("meta", "units"))
    events_bytes = rank_bytes.get("events", (0, 0))[0]
    n_events = disk["num_events"]
    n_steps = disk["steps"]
    rows = [
        ["events recorded", n_events],
        ["events per optimizer step", n_events / n_steps],
        ["events table bytes per event", events_bytes / n_events],
        ["all bytes per event (every table)", total / n_events],
        ["bytes per optimizer step (all tables, less meta/units)", (total - static) / n_steps],
        ["files per optimizer step", files / n_steps],
        ["run dir bytes, this rank", total],
    ]
    rows += [[f"  {t}: bytes / files", f"{b} / {n}"] for t, (b, n) in sorted(rank_bytes.items())]
    print_table(
        f"Disk volume, rank 0, {cfg.disk_units} units x {cfg.disk_micro_steps} micro-steps x "
        f"{n_steps} optimizer steps (apparent file sizes)",
        ["figure", "value"], rows)


def _median(values: list[Any]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (< 20 s)")
    parser.add_argument("--reps", type=int, help="interleaved repetitions per variant")
    parser.add_argument("--units", type=int, help="FSDP units in the step-time model")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    overrides = {k: v for k, v in (("reps", args.reps), ("num_units", args.units)) if v}
    cfg = Config(**{**asdict(cfg), **overrides})
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.spawn(worker, args=(asdict(cfg), free_port(), out), nprocs=2, join=True)
        results = json.loads(Path(out).read_text())
    report(cfg, results)
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in results["phase_s"].items())
    print(f"\n(total {time.perf_counter() - started:.1f} s: {phases})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
