"""What recording an HSDP collective costs, next to what asking its group for the number would.

Two processes, hyper_parallel 0.1 on a 2-rank gloo mesh (on one rank it issues no collective),
``Block`` units with forward prefetch, recorded by ``fsdptrace.attach``: every per-parameter
all-gather and reduce-scatter goes through ``record/backends/hsdp_collectives.py``. Timed in
training on rank 0, per real collective:

- ``issuer``: an all-gather's issuer, read from the stack for a unit's first parameter
  (``stack read``) and reused for the others gathered in the same ``hsdp_state.unshard``;
- ``row``: the row with its locally counted number, appended to the journal buffer;
- ``group read``: ``ProcessGroup._get_sequence_number_for_group()`` called at the same moment,
  the read the local count replaces (while an earlier asynchronous gather may be in flight).

    python benchmarks/hsdp_collective_cost.py            # about 1 minute on 2 busy cores
    python benchmarks/hsdp_collective_cost.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HYPER_PARALLEL_PLATFORM", "torch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port, print_table  # noqa: E402

DIM = 64
NUM_UNITS = 8
NAMES = ("issuer, stack read", "issuer, reused", "row", "group read")


def _model() -> nn.Module:
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.fully_shard.api import fully_shard

    mesh = init_device_mesh(device_type="cpu", mesh_shape=(2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(NUM_UNITS)))
    for unit in [*model, model]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=False, device=torch.device("cpu"))
    for here, following in zip(model[:-1], model[1:], strict=True):
        here.set_modules_to_forward_prefetch([following])
    return model


def _timed(samples: dict[str, list[int]]) -> None:
    """Time ``Route.record`` (and the issuer read it is given) and the group read after it."""
    from fsdptrace.record.backends import hsdp_collectives

    record, issuer = hsdp_collectives.Route.record, hsdp_collectives.Route.gather_issuer

    def gather_issuer(self: Any, frame: Any) -> Any:
        before = self._last
        start = time.perf_counter_ns()
        out = issuer(self, frame)
        took = time.perf_counter_ns() - start
        samples["issuer, reused" if self._last is before else "issuer, stack read"].append(took)
        return out

    def timed_record(self: Any, kind: int, group: Any, who: Any) -> None:
        start = time.perf_counter_ns()
        record(self, kind, group, who)
        middle = time.perf_counter_ns()
        group._get_sequence_number_for_group()
        samples["row"].append(middle - start)
        samples["group read"].append(time.perf_counter_ns() - middle)

    hsdp_collectives.Route.record = timed_record  # type: ignore[method-assign]
    hsdp_collectives.Route.gather_issuer = gather_issuer  # type: ignore[method-assign]


def _worker(rank: int, port: int, steps: int, out: str) -> None:
    from hyper_parallel import SkipDTensorDispatch, hsdp_sync_stream

    import fsdptrace

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    samples: dict[str, list[int]] = {name: [] for name in NAMES}
    _timed(samples)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tempfile.TemporaryDirectory() as run_dir, SkipDTensorDispatch(), \
            fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer):
        for _ in range(steps):
            model(torch.randn(4, DIM)).pow(2).mean().backward()
            hsdp_sync_stream()
            optimizer.step()
            optimizer.zero_grad()
    if rank == 0:
        Path(out).write_text(json.dumps(samples))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "samples.json")
        mp.spawn(_worker, args=(free_port(), steps, out), nprocs=2, join=True)
        samples = json.loads(Path(out).read_text())
    rows = []
    num_collectives = len(samples["row"])
    for name in NAMES:
        values = [ns / 1e3 for ns in samples[name]]
        rows.append((name, len(values), statistics.median(values), statistics.mean(values)))
    print_table(f"HSDP collectives, rank 0, {steps} steps, {num_collectives} collectives "
                "(all-gathers carry the issuer read)",
                ["what", "calls", "median µs", "mean µs"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
