"""Real HSDP (hyper_parallel) jobs on 2 CPU ranks (gloo), many cases in one process group.

    python tests/jobs_scripts/hsdp_cases.py --out DIR CASE...   # under tests.jobs.run_ranks
    python tests/jobs_scripts/hsdp_cases.py --zero-code          # under `fsdptrace record`

Each case records into ``--out/<case>`` through ``fsdptrace.attach(model, optimizer=opt)``
and writes ``result.rank<r>.json`` there: whether ``optimizer.step()`` raised (type, message),
which parameter shards changed across it, and the backend's settings of every unit. With
``--zero-code`` the script never touches fsdptrace and runs the clean case once.

Wrapping as hyper_parallel 0.1 works on gloo: ``reshard_after_forward=False`` (``True`` fails
in backward there), the loop inside ``SkipDTensorDispatch``, ``hsdp_sync_stream()`` before the
optimizer. Backward prefetch is then a no-op (units stay unsharded until the end of backward);
forward prefetch issues real asynchronous all-gathers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HYPER_PARALLEL_PLATFORM", "torch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from hyper_parallel import SkipDTensorDispatch, hsdp_sync_stream, init_device_mesh  # noqa: E402
from hyper_parallel.core.fully_shard.api import fully_shard  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.jobs_scripts.harness import DIM, Block, run_cases  # noqa: E402

NUM_LAYERS = 4
NUM_STEPS = 2
NUM_MICRO_STEPS = 2
Result = dict[str, Any]


class Model(nn.Module):
    """Four blocks, an ``extra`` unit the forward never calls, and a head on the root."""

    def __init__(self, *, checkpointed: bool = False, bypass_extra: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(NUM_LAYERS))
        self.extra = Block()
        self.head = nn.Linear(DIM, DIM)
        self.checkpointed = checkpointed
        self.bypass_extra = bypass_extra
        self.order = list(range(NUM_LAYERS))
        self.swap_every_other_call = False
        self.num_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = list(self.order)
        if self.swap_every_other_call and self.num_calls % 2:
            order[1], order[2] = order[2], order[1]
        self.num_calls += 1
        for layer in (self.layers[i] for i in order):
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
        if self.bypass_extra:  # reaches into the unit's parameters without its forward
            x = x + nn.functional.linear(x, self.extra.fc.weight)
        return self.head(x)


_mesh: Any = None


def build(*, checkpointed: bool = False, bypass_extra: bool = False) -> Model:
    global _mesh
    if _mesh is None:
        _mesh = init_device_mesh(device_type="cpu", mesh_shape=(2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = Model(checkpointed=checkpointed, bypass_extra=bypass_extra)
    for block in [*model.layers, model.extra]:
        fully_shard(block, mesh=_mesh, reshard_after_forward=False, device=torch.device("cpu"))
    fully_shard(model, mesh=_mesh, reshard_after_forward=False, device=torch.device("cpu"))
    return model


def one_ahead(model: Model) -> None:
    layers = list(model.layers)
    for here, following in zip(layers[:-1], layers[1:], strict=True):
        here.set_modules_to_forward_prefetch([following])


def prefetch_extra_that_never_runs(model: Model, rank: int) -> None:
    one_ahead(model)
    model.layers[3].set_modules_to_forward_prefetch([model.extra])


def wrong_backward_edge(model: Model, rank: int) -> None:
    one_ahead(model)
    model.layers[1].set_modules_to_backward_prefetch([model.layers[2]])  # 2 ran already


def prefetch_on_rank_0_only(model: Model, rank: int) -> None:
    # The gathers run in the same order on both ranks (rank 0 only issues them earlier).
    if rank == 0:
        one_ahead(model)


def unshard_extra(model: Model, rank: int) -> None:
    one_ahead(model)
    model.extra.unshard()


def swap_on_rank_1(model: Model, rank: int) -> None:
    # The blocks have equal shapes: the mismatched all-gathers pair up silently, no hang.
    if rank == 1:
        model.order = [0, 2, 1, 3]


def swap_in_odd_micro_steps(model: Model, rank: int) -> None:
    model.swap_every_other_call = True


CASES: dict[str, tuple[Callable[[Model, int], None], dict[str, bool], bool]] = {
    # name: (prefetch set-up, build options, raise_on_violation)
    "clean": (lambda model, rank: one_ahead(model), {}, False),
    "clean-explicit-boundaries": (lambda model, rank: one_ahead(model), {}, False),
    "clean-checkpoint": (lambda model, rank: one_ahead(model), {"checkpointed": True}, False),
    "never-runs": (prefetch_extra_that_never_runs, {}, False),
    "wrong-backward": (wrong_backward_edge, {}, False),
    "config-divergence": (prefetch_on_rank_0_only, {}, False),
    "rank-divergence": (swap_on_rank_1, {}, False),
    "order-instability": (swap_in_odd_micro_steps, {}, False),
    "bypassed-extra": (unshard_extra, {"bypass_extra": True}, False),
    "live-never-runs": (prefetch_extra_that_never_runs, {}, True),
}

EXPLICIT_BOUNDARIES = {"clean-explicit-boundaries"}  # attach(model) without the optimizer


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every managed parameter, read from hyper_parallel's params."""
    fqn_of = {id(m): fqn for fqn, m in model.named_modules()}
    shards = {}
    for module in model.modules():
        scheduler = getattr(module, "hsdp_scheduler", None)
        for hsdp_param in scheduler.hsdp_state.hsdp_params if scheduler is not None else ():
            info = hsdp_param._module_info
            name = ".".join(filter(None, [fqn_of[id(info.module)], info.param_name]))
            shards[name] = hsdp_param.sharded_param.to_local().detach().clone()
    return shards


def train(model: Model, optimizer: torch.optim.Optimizer, rank: int,
          before: dict[str, torch.Tensor], recorder: Any = None) -> None:
    """The HSDP loop; ``before`` holds the shards right before the latest ``optimizer.step()``
    (filled in place: a step that raises never returns). Given a ``recorder`` attached
    without an optimizer, the loop marks the boundaries itself."""
    generator = torch.Generator().manual_seed(rank)
    with SkipDTensorDispatch():
        for step in range(NUM_STEPS):
            for micro in range(NUM_MICRO_STEPS):
                if recorder is not None:
                    recorder.begin_micro_step(step, micro)
                model(torch.randn(4, DIM, generator=generator)).pow(2).mean().backward()
            hsdp_sync_stream()
            before.update(local_shards(model))
            if recorder is not None:
                recorder.before_optimizer_step()
            optimizer.step()
            optimizer.zero_grad()


def run_case(out: Path, name: str, rank: int) -> None:
    import fsdptrace

    set_up, options, raising = CASES[name]
    model = build(**options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)  # the sharded parameters
    set_up(model, rank)
    run_dir = out / name
    result: Result = {"raised": None, "message": "", "changed": [], "settings": {}}
    before: dict[str, torch.Tensor] = {}
    try:
        explicit = name in EXPLICIT_BOUNDARIES
        with fsdptrace.attach(model, run_dir=run_dir, optimizer=None if explicit else optimizer,
                              raise_on_violation=raising) as recorder:
            result["settings"] = {u.name: recorder.backend.settings(u) for u in recorder.units}
            train(model, optimizer, rank, before, recorder if explicit else None)
    except fsdptrace.LifecycleError as error:
        result["raised"], result["message"] = type(error).__name__, str(error)
    after = local_shards(model)
    result["changed"] = sorted(k for k in after if not torch.equal(after[k], before[k]))
    # AdamW creates its state at its first step: none means it never ran.
    result["optimizer_state"] = len(optimizer.state)
    (run_dir / f"result.rank{rank}.json").write_text(json.dumps(result, default=str))


def zero_code() -> None:
    """The clean case with no fsdptrace call: ``fsdptrace record`` attaches by itself."""
    dist.init_process_group("gloo")
    try:
        model = build()
        one_ahead(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        train(model, optimizer, dist.get_rank(), {})
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--zero-code", action="store_true")
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args()
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {sorted(CASES)}")
    if args.zero_code:
        zero_code()
        return
    run_cases(args.cases, lambda name, rank: run_case(args.out, name, rank))


if __name__ == "__main__":
    main()
