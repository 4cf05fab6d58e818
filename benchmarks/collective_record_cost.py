"""Cost of recording each FSDP2 collective with its sequence number, side by side with and without.

Two processes, FSDP2 on a 2-rank gloo group (on one rank FSDP2 issues no collective at all), a
stack of tiny ``fully_shard`` units, recorded by ``fsdptrace.attach``. Three variants take
turns, in step on both ranks, on the same recorder and model:

- without: FSDP2's own ``foreach_all_gather`` / ``foreach_reduce`` (collectives not recorded);
- with: fsdptrace's wrappers (``record/backends/fsdp2/collectives.py``): route lookup, issuer,
  the group's sequence number (``collectives.Numbers``: its counter read once per pass), one
  journal row;
- read each: the same, but ``ProcessGroup._get_sequence_number_for_group()`` read at every
  collective (fsdptrace before the ``Numbers`` change), for the side-by-side comparison.

FSDP2 issues an all-gather per unit in forward, another in backward (resharded after forward)
and a reduce-scatter per unit. Two figures: rank 0's (time per micro-step with -
without) / collectives per micro-step, median over repetitions (honest but noisy: gloo's
latency between two busy processes dwarfs the difference), and the time spent inside the
wrappers minus FSDP2's own call, per real collective (the recording's cost itself). The
sequence-number read alone is timed too.

    python benchmarks/collective_record_cost.py            # about 1 minute
    python benchmarks/collective_record_cost.py --quick    # smoke test, under 20 s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import build_fsdp_stack, free_port, print_table, rotated  # noqa: E402

import fsdptrace  # noqa: E402
from fsdptrace.record.backends.fsdp2 import collectives  # noqa: E402
from fsdptrace.store.schema import COLLECTIVES  # noqa: E402

WITHOUT, WITH, READ_EACH = "without", "with", "read each"


class _ReadEach(collectives.Numbers):
    """The earlier recorder: the group's counter read at every collective."""

    def next(self, group: Any, name: str, pass_key: tuple[int, int, int]) -> int:
        return int(group._get_sequence_number_for_group()) + 1


def _set_variant(variant: str) -> None:
    numbers = _ReadEach() if variant == READ_EACH else collectives.Numbers()
    for route in collectives._routes.values():
        route.numbers = numbers
    module = collectives._originals["module"]
    for name in ("foreach_all_gather", "foreach_reduce"):
        wrapped = getattr(module, name)
        original = getattr(wrapped, "__wrapped__", wrapped)
        if variant == WITHOUT:
            setattr(module, name, original)
        elif wrapped is original:
            setattr(module, name, (collectives._wrap_all_gather if name == "foreach_all_gather"
                                   else collectives._wrap_reduce)(original))


def _micro_steps(model: torch.nn.Module, batch: torch.Tensor, num: int) -> float:
    start = time.perf_counter()
    for _ in range(num):
        model(batch).sum().backward()
    return (time.perf_counter() - start) / num


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--units", type=int, default=32)
    args = parser.parse_args()
    reps, per_rep = (3, 2) if args.quick else (15, 6)
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(args.units, reps, per_rep, free_port(), out), nprocs=2)
        result = json.loads((Path(out) / "result.json").read_text())
    without, with_, each, per_micro_step, read, inside = (result[k] for k in (
        WITHOUT, WITH, READ_EACH, "per_micro_step", "sequence_read", "inside"))
    print_table(
        f"Per FSDP2 collective ({args.units + 1} units, {per_micro_step} collectives per "
        f"micro-step, 2-rank gloo, {len(COLLECTIVES)} columns per row)",
        ["variant", "µs per micro-step", "µs per collective", "added µs per collective"],
        [[WITHOUT, f"{without * 1e6:.0f}", f"{without / per_micro_step * 1e6:.1f}", "0"],
         *([name, f"{value * 1e6:.0f}", f"{value / per_micro_step * 1e6:.1f}",
            f"{(value - without) / per_micro_step * 1e6:.2f}"]
           for name, value in ((WITH, with_), (READ_EACH, each)))])
    print_table("Inside the wrappers, per real collective (rank 0; timed around FSDP2's call, "
                "min / median over repetitions)",
                ["variant", "µs per collective"],
                [[f"{WITHOUT} (FSDP2's foreach_all_gather / foreach_reduce)",
                  _min_median(inside[WITHOUT])],
                 *([f"{name}: added by recording", _min_median(inside[name])]
                   for name in (WITH, READ_EACH)),
                 ["ratio with ÷ read each (min / median of per-repetition ratios)",
                  "{:.2f} / {:.2f}".format(*_ratio(inside[WITH], inside[READ_EACH]))]])
    print(f"\nProcessGroup._get_sequence_number_for_group() alone: {read * 1e6:.2f} µs; "
          f"an empty Python call on this machine now: {result['empty_call'] * 1e6:.3f} µs")


def _rank(rank: int, units: int, reps: int, per_rep: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        model, optimizer = build_fsdp_stack(units, 8)
        batch = torch.randn(4, 8)
        with tempfile.TemporaryDirectory() as run_dir, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rec = fsdptrace.attach(model, run_dir=Path(run_dir), optimizer=optimizer)
            _micro_steps(model, batch, 2)  # lazy init, warm caches
            group = dist.group.WORLD
            before = group._get_sequence_number_for_group()
            _micro_steps(model, batch, 1)
            per_micro_step = group._get_sequence_number_for_group() - before
            times: dict[str, list[float]] = {WITHOUT: [], WITH: [], READ_EACH: []}
            inside: dict[str, list[float]] = {WITHOUT: [], WITH: [], READ_EACH: []}
            for rep in range(reps):
                for variant in rotated([WITHOUT, WITH, READ_EACH], rep):
                    _set_variant(variant)
                    dist.barrier()
                    times[variant].append(_micro_steps(model, batch, per_rep))
                    optimizer.zero_grad()
                for variant in rotated([WITH, READ_EACH], rep):
                    _set_variant(variant)
                    dist.barrier()
                    spent = _time_inside(model, batch, 1)
                    inside[variant].append(spent["added"])
                    inside[WITHOUT].append(spent["fsdp2"])
                    optimizer.zero_grad()
            _set_variant(WITH)
            read = _time_sequence_read(group)
            empty = _time_sequence_read(_Empty())
            rec.close()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        (Path(out) / "result.json").write_text(json.dumps({
            **{name: statistics.median(values) for name, values in times.items()},
            "per_micro_step": per_micro_step, "sequence_read": read, "inside": inside,
            "empty_call": empty}))


def _time_inside(model: torch.nn.Module, batch: torch.Tensor, num: int) -> dict[str, float]:
    """Time spent in fsdptrace's wrappers around real collectives, excluding FSDP2's own call:
    per call, (wrapper and FSDP2) - (FSDP2), so gloo's latency and the load cancel out."""
    module = collectives._originals["module"]
    inner, outer, calls = [0], [0], [0]
    saved = {n: getattr(module, n) for n in ("foreach_all_gather", "foreach_reduce")}

    def timed(function: Callable[..., Any], spent: list[int]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter_ns() - start
        return call

    for name, wrap in (("foreach_all_gather", collectives._wrap_all_gather),
                       ("foreach_reduce", collectives._wrap_reduce)):
        original = saved[name].__wrapped__
        setattr(module, name, _counted(timed(wrap(timed(original, inner)), outer), calls))
    try:
        _micro_steps(model, batch, num)
    finally:
        for name, function in saved.items():
            setattr(module, name, function)
    return {"fsdp2": inner[0] / calls[0] / 1e9, "added": (outer[0] - inner[0]) / calls[0] / 1e9}


def _min_median(samples: list[float]) -> str:
    return f"{min(samples) * 1e6:.1f} / {statistics.median(samples) * 1e6:.1f}"


def _ratio(mine: list[float], theirs: list[float]) -> tuple[float, float]:
    """min ÷ min, and the median of the ratios of repetitions run back to back."""
    return (min(mine) / min(theirs),
            statistics.median(m / t for m, t in zip(mine, theirs, strict=True)))


def _counted(function: Callable[..., Any], calls: list[int]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return function(*args, **kwargs)
    return call


class _Empty:
    """The calibration: the same loop around a Python method that does nothing."""

    def _get_sequence_number_for_group(self) -> int:
        return 0


def _time_sequence_read(group: Any, num: int = 20000) -> float:
    read = group._get_sequence_number_for_group
    start = time.perf_counter()
    for _ in range(num):
        read()
    return (time.perf_counter() - start) / num


if __name__ == "__main__":
    main()
