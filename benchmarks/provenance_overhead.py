"""What all-gather provenance adds to the recorder: µs per unit per micro-step, same run.

One rank by default (``--ranks 2`` for two) on CPU/gloo, spawned here: a stack of
``fully_shard`` units with explicit one-ahead prefetch, 2 micro-steps per optimizer step.
Three variants take turns in one job (rotating order, repeated): no recording, the
recorder with provenance switched off (this script swaps the backend's ``install_provenance``
for a no-op; the package is not touched), and the full recorder. The figure is
(variant - no recording) / (units x micro-steps), min and median over repetitions.
Step times on a shared machine are noisy, so the script also times one wrapped ``unshard()``
against the plain one (interleaved, min of 5 x 20000 calls, both called from a caller that
looks like FSDP2's own) and multiplies by the recorded calls per unit per micro-step: the
stable figure. A wrapped call straight from a script (issuer ``other``) is timed apart.

    python benchmarks/provenance_overhead.py            # about a minute on 2 cores
    python benchmarks/provenance_overhead.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
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
    from fsdptrace.record.backends.fsdp2.units import FSDP2Backend

    if variant == "off":
        return _steps(model, optimizer, x, num_steps)
    original = FSDP2Backend.install_provenance
    if variant == "recorder":
        FSDP2Backend.install_provenance = lambda self, rec: []  # type: ignore[method-assign]
    try:
        with fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer):
            return _steps(model, optimizer, x, num_steps)
    finally:
        FSDP2Backend.install_provenance = original  # type: ignore[method-assign]


def _as_fsdp2_caller(group: object) -> object:
    """A ``pre_backward(fn)`` that calls ``fn()``, compiled under FSDP2's own file name.

    The wrapper attributes a call by its caller's code: from this caller it takes the path of
    FSDP2's own calls (one cached lookup), not the walk past foreign frames that a call from
    this script would take.
    """
    module = sys.modules[type(group).__module__]
    namespace: dict[str, object] = {}
    exec(compile("def pre_backward(fn):\n    return fn()\n", module.__file__, "exec"), namespace)
    return namespace["pre_backward"]


def _per_call_cost(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   run_dir: str, calls: int = 20000) -> dict[str, float]:
    """Seconds per ``unshard()`` on an unsharded group (FSDP's no-op path): plain, wrapped
    as FSDP2 calls it, and wrapped called straight from a script (attributed ``other``).
    The wrapper's cost without the step-time noise of a shared machine."""
    import fsdptrace

    layer = model.layers[0]  # type: ignore[index]
    group = layer._get_fsdp_state()._fsdp_param_groups[0]
    caller = _as_fsdp2_caller(group)
    layer.unshard()
    best = {"plain": float("inf"), "wrapped": float("inf"), "direct": float("inf")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the direct calls' one "issuer other" warning
        with fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer):
            wrapped = group.unshard
            plain = type(group).unshard.__get__(group)
            for _ in range(5):
                for name, fn, arg in (("plain", caller, plain), ("wrapped", caller, wrapped),
                                      ("direct", wrapped, None)):
                    args = () if arg is None else (arg,)
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn(*args)  # type: ignore[operator]
                    best[name] = min(best[name], (time.perf_counter() - start) / calls)
    layer.reshard()
    return best


def _rows_per_unit_micro(tmp: str, args: argparse.Namespace) -> float:
    """Wrapper calls that recorded a row, per unit per micro-step, in one full-recorder run."""
    import fsdptrace

    trace = fsdptrace.load(os.path.join(tmp, f"{VARIANTS[-1]}-0"))
    micro = trace.allgathers[["step", "micro_step"]].drop_duplicates()
    return len(trace.allgathers) / (args.units * len(micro))


def _worker(rank: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
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
            out["per_call"] = _per_call_cost(model, optimizer, os.path.join(tmp, "calls"))
            out["rows_per_unit_micro"] = _rows_per_unit_micro(tmp, args)
    if rank == 0:
        out.update(samples)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=33, help="FSDP units incl. the root")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per sample")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--ranks", type=int, default=1,
                        help="1 keeps gloo's all-gathers (noise on shared CPUs) out of the "
                             "figure; the wrappers run the same either way")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.units, args.steps, args.reps = 9, 2, 3
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(free_port(), args, out), nprocs=args.ranks, join=True)
        samples = dict(out)
    calls = samples.pop("per_call")
    calls_per = samples.pop("rows_per_unit_micro")
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
    print(f"\nprovenance alone, from step times: {lo / per * 1e6:.2f} µs per unit per "
          "micro-step (min; noisy on shared CPUs)")
    from fsdptrace.record.backends.fsdp2.issuers import MAX_FOREIGN_FRAMES

    plain, wrapped, direct = calls["plain"], calls["wrapped"], calls["direct"]
    extra = (wrapped - plain) * calls_per
    print(f"provenance per call: {(wrapped - plain) * 1e6:.2f} µs (plain unshard "
          f"{plain * 1e6:.2f} µs); {calls_per:.1f} recorded calls per unit per micro-step "
          f"-> {extra * 1e6:.2f} µs per unit per micro-step")
    print(f"a call from outside FSDP2 (issuer 'other', walks past {MAX_FOREIGN_FRAMES} frames): "
          f"{(direct - plain) * 1e6:.2f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
