"""What the optimizer boundary costs the training thread per recorded step, at 64 and 256 units.

One rank (gloo, CPU) trains a stack of real ``fully_shard`` units (explicit one-ahead prefetch,
2 micro-steps a step, ``zero_grad(set_to_none=True)``) under ``fsdptrace.attach``. Each step
pays two gradient snapshots for checks 2 and 10: the baseline at the step's first micro-step
(``snapshots.take_grad_baseline``) and the boundary right before ``optimizer.step()``
(``snapshots.record_boundary``: presence, pending all-gathers, what the step wrote). Both are
timed where the recorder calls them, in a real loop, so a cache that skips unchanged units is
measured as it would really be hit.

    python benchmarks/boundary_cost.py                  # 64 and 256 units, ~30 s
    python benchmarks/boundary_cost.py --units 256 --steps 20 --clock wall
    python benchmarks/boundary_cost.py --against /tmp/base --rounds 4   # before/after
    python benchmarks/boundary_cost.py --units 256 --breakdown          # where it goes

Times are the training thread's CPU time by default (``--clock wall`` for wall time): on a
shared machine the wall time of a 1 ms call mostly measures the other processes. ``--against``
runs this script in turn on another checkout of the package (``PYTHONPATH``) and on this one,
``--rounds`` times each, and prints each side's median and their ratio, round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import build_fsdp_stack, free_port, min_median, print_table  # noqa: E402

import fsdptrace  # noqa: E402
from fsdptrace.record import snapshots  # noqa: E402

DIM = 8
MICRO_STEPS = 2
CLOCKS = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}
CLOCK = CLOCKS["cpu"]


def _timed(samples: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    # The training thread's own CPU time: on a shared machine the wall time of a 1 ms call
    # mostly measures the other processes (both are printed).
    def wrapper(*args: Any) -> Any:
        start = CLOCK()
        try:
            return fn(*args)
        finally:
            samples.append((CLOCK() - start) / 1000)

    return wrapper


# What the two snapshots call, timed with ``--breakdown``: the backend's reads and the rows'
# writes into the journal (JSON frames); the rest is the snapshots' own row building.
BACKEND_READS = ("all_gradients", "all_pending_all_gathers", "all_grad_tokens")
JOURNAL_WRITES = ("gradients", "pending", "grads_written")


def _time_parts(rec: Any, samples: dict[str, list[float]]) -> None:
    """Time the backend's reads and the journal's writes on this recorder's own objects."""
    for name in BACKEND_READS:
        samples[f"backend.{name}"] = []
        setattr(rec.backend, name, _timed(samples[f"backend.{name}"],
                                          getattr(rec.backend, name)))
    for table in JOURNAL_WRITES:
        buffer = rec.writer.buffer(table)
        samples[f"journal {table}"] = []
        # Rows come as tuples (``extend``) or already encoded (``extend_json``).
        for method in ("extend", "extend_json"):
            if hasattr(buffer, method):
                setattr(buffer, method, _timed(samples[f"journal {table}"],
                                               getattr(buffer, method)))


def measure(num_units: int, steps: int, run_dir: Path, *, breakdown: bool = False
            ) -> dict[str, list[float]]:
    """µs per call of the baseline and of the boundary snapshot, one sample per step; with
    ``breakdown``, also every call of the parts (``_time_parts``)."""
    model, optimizer = build_fsdp_stack(num_units - 1, DIM)
    samples: dict[str, list[float]] = {"baseline": [], "boundary": []}
    originals = snapshots.take_grad_baseline, snapshots.record_boundary
    # The recorder looks both up on the module at call time: timing them there times exactly
    # what the training thread pays, with nothing of the package changed.
    snapshots.take_grad_baseline = _timed(samples["baseline"], originals[0])  # type: ignore[assignment]
    snapshots.record_boundary = _timed(samples["boundary"], originals[1])  # type: ignore[assignment]
    try:
        with fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer,
                              flush_interval_s=3600) as rec:
            if breakdown:
                _time_parts(rec, samples)
            for _ in range(steps + 2):
                for _ in range(MICRO_STEPS):
                    model(torch.randn(4, DIM)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    finally:
        snapshots.take_grad_baseline, snapshots.record_boundary = originals
    # The first two steps pay one-off costs (lazy init, the per-unit caches).
    timed = {kind: values[2:] for kind, values in samples.items() if kind in ("baseline",
                                                                             "boundary")}
    for kind, values in samples.items():
        if kind not in timed:  # per step: the calls of all units summed
            per_step = len(values) // (steps + 2)
            timed[kind] = [sum(values[i * per_step:(i + 1) * per_step])
                           for i in range(2, steps + 2)] if per_step else [0.0] * steps
    return timed


def print_breakdown(results: dict[int, dict[str, list[float]]], clock: str) -> None:
    """Median µs per step of each part, and per unit."""
    for num_units, result in results.items():
        parts = [k for k in result if k not in ("baseline", "boundary", "total")]
        timed = sum(statistics.median(result[k]) for k in parts)
        rows = [[k, f"{statistics.median(result[k]):.0f}",
                 f"{statistics.median(result[k]) / num_units:.2f}"] for k in parts]
        rest = statistics.median(result["total"]) - timed
        rows.append(["rest (snapshots' own loops and rows)", f"{rest:.0f}",
                     f"{rest / num_units:.2f}"])
        print_table(f"Where baseline + boundary go, {num_units} units (µs of {clock} time per "
                    "step, medians; the timers' own cost is in each part)",
                    ["part", "µs per step", "µs per unit"], rows)


def compare(against: Path, rounds: int, argv: list[str]) -> None:
    """Alternate this script on ``against`` and on this checkout; print medians and ratios."""
    here = Path(__file__).resolve().parent.parent
    sides = {"before": against.resolve(), "after": here}
    totals: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    for round_index in range(rounds):
        order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
        for side in order:
            env = {**os.environ, "PYTHONPATH": f"{sides[side]}:{sides[side] / 'cli'}"}
            out = subprocess.run([sys.executable, __file__, "--json", *argv], env=env,
                                 check=True, capture_output=True, text=True).stdout
            for units, result in json.loads(out.splitlines()[-1]).items():
                totals[side].setdefault(units, []).append(result["total"][1])
    rows = []
    for units in totals["after"]:
        before, after = totals["before"][units], totals["after"][units]
        rows.append([units, statistics.median(before), statistics.median(after),
                     statistics.median(a / b for a, b in zip(after, before, strict=True))])
    print_table(f"Baseline + boundary per step, µs (median of {rounds} alternated runs' "
                f"medians; before = {against})",
                ["units", "before", "after", "after ÷ before (median of pairs)"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=15, help="timed steps per size")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead")
    parser.add_argument("--against", type=Path, help="a checkout to compare with (before)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations with --against")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the backend's reads and the journal's writes")
    args = parser.parse_args(argv)
    if args.against is not None:
        compare(args.against, args.rounds, ["--units", *map(str, args.units),
                                            "--steps", str(args.steps), "--clock", args.clock])
        return 0
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    results: dict[int, dict[str, list[float]]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for num_units in args.units:
                results[num_units] = measure(num_units, args.steps, Path(tmp) / f"u{num_units}",
                                             breakdown=args.breakdown)
    finally:
        dist.destroy_process_group()
    for result in results.values():
        result["total"] = [a + b for a, b in zip(result["baseline"], result["boundary"],
                                                 strict=True)]
    if args.json:
        print(json.dumps({n: {k: min_median(v) for k, v in r.items()}
                          for n, r in results.items()}))
        return 0
    rows = []
    for num_units, result in results.items():
        total = result["total"]
        rows.append([num_units, *min_median(result["baseline"]),
                     *min_median(result["boundary"]), *min_median(total)])
    print_table(
        f"Gradient snapshots per optimizer step (1 rank, {MICRO_STEPS} micro-steps, "
        f"{args.steps} steps, µs of {args.clock} time)",
        ["units", "baseline min", "baseline median", "boundary min", "boundary median",
         "step total min", "step total median"],
        rows)
    if args.breakdown:
        print_breakdown(results, args.clock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
