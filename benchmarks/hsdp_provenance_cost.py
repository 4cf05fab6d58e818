"""What HSDP all-gather provenance costs per call: each wrapped path, plain and wrapped.

One process, gloo with world size 1, hyper_parallel 0.1 units (``fully_shard`` on a 1-rank
mesh: a gather is a copy into the gather buffer, no network, so the figures are the wrappers'
and hyper_parallel's own Python, not gloo's). Each path is called from a caller compiled under
hyper_parallel's own file and function name (the scheduler's ``_hsdp_forward_pre_hook``), so
the wrapper attributes it as it does in training (one cached lookup, or the two-frame walk and
the source read of a prefetch). Plain and wrapped calls are interleaved, min of 5 x N calls:

- ``own unshard, unsharded``: a unit's own pre-forward unshard when it is unsharded already
  (``reshard_after_forward=False`` keeps it so: a no-op, ``noop`` row);
- ``prefetch, unsharded``: ``hsdp_state.prefetch()`` of an unsharded target (``noop`` row,
  issuer read from the stack and the source scheduler from the frame);
- ``gather cycle``: own blocking unshard of a sharded unit then ``shard()``: ``issue``,
  ``consume`` and ``reshard`` rows around a real (1-rank) gather of a 16 x 16 linear;
- ``wait, unsharded``: ``wait_for_unshard`` on an unsharded unit, a call that finds nothing to
  do (one attribute read; ``shard`` of a sharded unit takes the same path).

The FSDP2 wrapper's figure for its own no-op ``unshard`` (``provenance_overhead.py``'s
measurement) is taken in the same process, as the reference: a shared machine's load moves
every figure, not their ratio.

    python benchmarks/hsdp_provenance_cost.py            # ~20 s on 2 cores
    python benchmarks/hsdp_provenance_cost.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HYPER_PARALLEL_PLATFORM", "torch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port, print_table  # noqa: E402

DIM = 16


def _as_scheduler_caller(scheduler: Any) -> Callable[..., Any]:
    """``_hsdp_forward_pre_hook(self, fn)`` calling ``fn()``, compiled under the file of
    hyper_parallel's scheduler: the frame the wrapper reads in training."""
    from hyper_parallel.core.fully_shard import hsdp_scheduler

    namespace: dict[str, Any] = {}
    source = "def _hsdp_forward_pre_hook(self, fn):\n    return fn()\n"
    exec(compile(source, hsdp_scheduler.__file__, "exec"), namespace)
    return namespace["_hsdp_forward_pre_hook"]


def _model() -> nn.Module:
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.fully_shard.api import fully_shard

    mesh = init_device_mesh(device_type="cpu", mesh_shape=(1,), mesh_dim_names=("dp",))
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
    for unit in [*model, model]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=False, device=torch.device("cpu"))
    return model


def _paths(model: nn.Module, call: Callable[..., Any]) -> dict[str, Callable[[], None]]:
    """Each timed path, as a no-argument function over the unit's current methods."""
    source, target = model[0].hsdp_scheduler, model[1].hsdp_scheduler
    own, other = source.hsdp_state, target.hsdp_state

    def own_unshard_unsharded() -> None:
        call(source, own.unshard)

    def prefetch_unsharded() -> None:
        call(source, other.prefetch)

    def gather_cycle() -> None:
        own.shard()
        call(source, own.unshard)

    def wait_unsharded() -> None:
        own.wait_for_unshard()

    return {"own unshard, unsharded": own_unshard_unsharded,
            "prefetch, unsharded": prefetch_unsharded,
            "gather cycle (shard + unshard)": gather_cycle,
            "wait, unsharded (fast path)": wait_unsharded}


def _time(fn: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(calls: int, reps: int) -> list[tuple[str, float, float]]:
    """(path, plain s per call, wrapped s per call), interleaved: the recorder stays attached
    and the plain calls run with its instance-level wrappers taken off the states."""
    import fsdptrace

    model = _model()
    call = _as_scheduler_caller(model[0].hsdp_scheduler)
    states = [m.hsdp_scheduler.hsdp_state for m in model.modules() if hasattr(m, "hsdp_scheduler")]
    for unit in (model[0], model[1]):
        unit.hsdp_scheduler.hsdp_state.unshard()  # the no-op paths find them unsharded
    paths = _paths(model, call)
    best = {name: [float("inf"), float("inf")] for name in paths}
    with tempfile.TemporaryDirectory() as run_dir, fsdptrace.attach(model, run_dir=run_dir):
        wrappers = [{n: vars(s)[n] for n in ("unshard", "wait_for_unshard", "shard")}
                    for s in states if "unshard" in vars(s)]
        assert len(wrappers) == 2, "provenance not installed on both linear units"
        installed = [s for s in states if "unshard" in vars(s)]
        for _ in range(reps):
            for name, fn in paths.items():
                for index in (0, 1):
                    for state, methods in zip(installed, wrappers, strict=True):
                        for method, wrapper in methods.items():
                            if index:
                                setattr(state, method, wrapper)
                            else:
                                vars(state).pop(method, None)
                    best[name][index] = min(best[name][index], _time(fn, calls))
    return [(name, lo, hi) for name, (lo, hi) in best.items()]


def fsdp2_reference(calls: int) -> tuple[float, float]:
    """(plain, wrapped) seconds per FSDP2 ``unshard()`` of an unsharded group, as FSDP2 calls
    it (``provenance_overhead.py``'s measurement, min of 5 x ``calls``)."""
    from _common import build_fsdp_stack
    from provenance_overhead import _per_call_cost

    model, optimizer = build_fsdp_stack(2, DIM)
    with tempfile.TemporaryDirectory() as run_dir:
        best = _per_call_cost(model, optimizer, run_dir, calls)
    return best["plain"], best["wrapped"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.reps = 500, 2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        rows = measure(args.calls, args.reps)
        plain, wrapped = fsdp2_reference(args.calls)
        rows.append(("FSDP2 own unshard, unsharded (reference)", plain, wrapped))
    finally:
        dist.destroy_process_group()
    print_table(f"HSDP provenance per call (min of {args.reps} x {args.calls} calls, 1 rank)",
                ["path", "plain µs", "wrapped µs", "added µs"],
                [(name, plain * 1e6, wrapped * 1e6, (wrapped - plain) * 1e6)
                 for name, plain, wrapped in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
