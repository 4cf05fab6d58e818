"""Real HSDP (hyper_parallel) jobs on 2 CPU ranks (gloo), many cases in one process group.

    python tests/jobs_scripts/hsdp_cases.py --out DIR CASE...   # under tests.jobs.run_ranks
    python tests/jobs_scripts/hsdp_cases.py --zero-code          # under `fsdptrace record`
    python tests/jobs_scripts/hsdp_cases.py --out DIR --ending hang|raise|skip

Each case records into ``--out/<case>`` through ``fsdptrace.attach(model, optimizer=opt)``
and writes ``result.rank<r>.json`` there: whether ``optimizer.step()`` raised (type, message),
which parameter shards changed across it, the backend's settings of every unit, and the
all-gathers hyper_parallel really ran per unit (counted by wrapping its per-parameter gather
inside this job, independently of the recorder). With ``--zero-code`` the script never
touches fsdptrace and runs the clean case once.

Wrapping as hyper_parallel 0.1 works on gloo: ``reshard_after_forward=False``, the loop inside
``SkipDTensorDispatch``, ``hsdp_sync_stream()`` before the optimizer. Backward prefetch is then
a no-op (units stay unsharded until the end of backward); forward prefetch issues real
asynchronous all-gathers. ``reshard_after_forward=True`` fails in hyper_parallel 0.1's backward
(on any process group: see ``preserve_version_counter``); the ``-raf`` cases run it with that
one fix applied in the job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HYPER_PARALLEL_PLATFORM", "torch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from hyper_parallel import SkipDTensorDispatch, hsdp_sync_stream, init_device_mesh  # noqa: E402
from hyper_parallel.core.fully_shard.api import fully_shard  # noqa: E402
from hyper_parallel.platform.torch.fully_shard.param import TorchHSDPParamV2  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.jobs_scripts.harness import DIM, Block, run_cases  # noqa: E402

NUM_LAYERS = 4
WIDE = 512  # a Linear(512, 512) unit holds 1 MiB gathered: past unsharded-excess's threshold
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


class Wide(nn.Module):
    """The ledger's model (``tests/jobs_scripts/ledger_job.py``'s): four ``Linear(512, 512)``
    units under a root without parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDE, WIDE) for _ in range(NUM_LAYERS))
        self.in_dim = WIDE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


_meshes: dict[bool, Any] = {}


def build(*, checkpointed: bool = False, bypass_extra: bool = False, wide: bool = False,
          reshard_after_forward: bool = False, replicated: bool = False) -> Any:
    """``replicated``: a 2-D mesh of 2 replicas of 1 shard (HSDP proper): hyper_parallel then
    all-reduces every gradient on the replicate group and its "all-gathers" are local copies."""
    if replicated not in _meshes:
        _meshes[replicated] = (
            init_device_mesh(device_type="cpu", mesh_shape=(2, 1),
                             mesh_dim_names=("replicate", "shard")) if replicated
            else init_device_mesh(device_type="cpu", mesh_shape=(2,), mesh_dim_names=("dp",)))
    mesh = _meshes[replicated]
    torch.manual_seed(0)
    model: Any = Wide() if wide else Model(checkpointed=checkpointed, bypass_extra=bypass_extra)
    units = [*model.layers] if wide else [*model.layers, model.extra]
    for unit in [*units, model]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    device=torch.device("cpu"))
    return model


@contextlib.contextmanager
def preserve_version_counter() -> Iterator[None]:
    """hyper_parallel 0.1 with the fix ``reshard_after_forward=True`` needs, for this job only.

    ``TorchHSDPParamV2._get_unsharded_param_data`` all-gathers (``dist.all_gather_into_tensor``,
    or ``copy_`` on a 1-rank mesh) in place into ``all_gather_outputs[0]``, which the unit's
    ``_unsharded_param`` (an ``as_strided`` view made once) aliases. Forward saved that
    parameter for backward at version 2; backward's re-gather bumps it to 4 and autograd
    refuses ("modified by an inplace operation ... is at version 4; expected version 2").
    FSDP2 hides its copy-out from autograd (``torch.autograd._unsafe_preserve_version_counter``
    in ``_fsdp_collectives.py``); so does this: the version before a gather is set back after
    it, and again after the wait of an asynchronous one (a prefetch), whose completion on
    gloo's worker thread bumps the counter once more, after the gather call has returned.
    """
    originals = {name: getattr(TorchHSDPParamV2, name)
                 for name in ("_get_unsharded_param_data", "wait_for_unshard")}
    versions: dict[int, int] = {}  # id(hsdp param) -> its gather buffer's version to keep

    def gather(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = self.all_gather_outputs
        if outputs:
            versions[id(self)] = outputs[0]._version
        out = originals["_get_unsharded_param_data"](self, *args, **kwargs)
        restore(self)
        return out

    def wait_for_unshard(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = originals["wait_for_unshard"](self, *args, **kwargs)
        restore(self)
        return out

    def restore(hsdp_param: Any) -> None:
        version = versions.get(id(hsdp_param))
        if version is not None:
            torch._C._autograd._unsafe_set_version_counter(
                (hsdp_param.all_gather_outputs[0],), (version,))

    TorchHSDPParamV2._get_unsharded_param_data = gather
    TorchHSDPParamV2.wait_for_unshard = wait_for_unshard
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(TorchHSDPParamV2, name, method)


@contextlib.contextmanager
def counting_all_gathers(model: nn.Module, counts: Counter[str]) -> Iterator[None]:
    """Count the all-gathers hyper_parallel runs per unit (a real collective per sharded
    parameter: one unit gather is one call per parameter of its ``sharded_hsdp_params``)."""
    unit_of, num_params = {}, {}
    for fqn, module in model.named_modules():
        state = getattr(getattr(module, "hsdp_scheduler", None), "hsdp_state", None)
        for hsdp_param in state.sharded_hsdp_params if state is not None else ():
            unit_of[id(hsdp_param)] = fqn or "<root>"
            num_params[fqn or "<root>"] = len(state.sharded_hsdp_params)
    calls: Counter[str] = Counter()
    original = TorchHSDPParamV2._get_unsharded_param_data

    def gather(self: Any, async_op: bool = False) -> Any:
        out = original(self, async_op)
        calls[unit_of.get(id(self), "?")] += 1
        return out

    TorchHSDPParamV2._get_unsharded_param_data = gather
    try:
        yield
    finally:
        TorchHSDPParamV2._get_unsharded_param_data = original
        counts.update({unit: n // num_params[unit] for unit, n in calls.items()})


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


def two_ahead_from_layers_0(model: Model, rank: int) -> None:
    """layers.0 prefetches layers.1 and layers.2, so layers.1's prefetch of layers.2 finds it
    pending (FSDP2's twin: ``provenance_cases.py`` redundant-prefetch)."""
    one_ahead(model)
    model.layers[0].set_modules_to_forward_prefetch([model.layers[1], model.layers[2]])


def chain_both_ways(model: Model, rank: int) -> None:
    """The textbook edges: one ahead in forward, one back in backward."""
    one_ahead(model)
    layers = list(model.layers)
    for here, previous in zip(layers[1:], layers[:-1], strict=True):
        here.set_modules_to_backward_prefetch([previous])


def no_prefetch(model: Model, rank: int) -> None:
    pass


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
    "redundant-prefetch": (two_ahead_from_layers_0, {}, False),
    "manual-unshard": (lambda model, rank: one_ahead(model), {}, False),
    "ledger-keep": (no_prefetch, {"wide": True}, False),
    "ledger-raf": (no_prefetch, {"wide": True, "reshard_after_forward": True}, False),
    "clean-raf": (chain_both_ways, {"reshard_after_forward": True}, False),
    "wrong-backward-raf": (wrong_backward_edge, {"reshard_after_forward": True}, False),
    "clean-replicated": (lambda model, rank: one_ahead(model), {"replicated": True}, False),
}

EXPLICIT_BOUNDARIES = {"clean-explicit-boundaries"}  # attach(model) without the optimizer
# Called right before each optimizer.step() (FSDP2's twin: provenance_cases.py manual-unshard).
BEFORE_STEP: dict[str, Callable[[Any], None]] = {
    "manual-unshard": lambda model: model.layers[1].unshard(),
}


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


def train(model: Any, optimizer: torch.optim.Optimizer, rank: int,
          before: dict[str, torch.Tensor], recorder: Any = None,
          before_step: Callable[[Any], None] | None = None) -> None:
    """The HSDP loop; ``before`` holds the shards right before the latest ``optimizer.step()``
    (filled in place: a step that raises never returns). Given a ``recorder`` attached
    without an optimizer, the loop marks the boundaries itself."""
    generator = torch.Generator().manual_seed(rank)
    in_dim = getattr(model, "in_dim", DIM)
    with SkipDTensorDispatch():
        for step in range(NUM_STEPS):
            for micro in range(NUM_MICRO_STEPS):
                if recorder is not None:
                    recorder.begin_micro_step(step, micro)
                model(torch.randn(4, in_dim, generator=generator)).pow(2).mean().backward()
            hsdp_sync_stream()
            if before_step is not None:
                before_step(model)
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
    gathers: Counter[str] = Counter()
    fixed = (preserve_version_counter() if options.get("reshard_after_forward")
             else contextlib.nullcontext())
    try:
        explicit = name in EXPLICIT_BOUNDARIES
        with fixed, fsdptrace.attach(model, run_dir=run_dir,
                                     optimizer=None if explicit else optimizer,
                                     raise_on_violation=raising) as recorder:
            result["settings"] = {u.name: recorder.backend.settings(u) for u in recorder.units}
            result["wrapped_while_attached"] = num_wrapped(model)
            with counting_all_gathers(model, gathers):
                train(model, optimizer, rank, before, recorder if explicit else None,
                      BEFORE_STEP.get(name))
    except fsdptrace.LifecycleError as error:
        result["raised"], result["message"] = type(error).__name__, str(error)
    result["all_gathers"] = dict(gathers)
    result["group_numbers"] = group_numbers(model)
    result["wrapped_after_close"] = num_wrapped(model)
    after = local_shards(model)
    result["changed"] = sorted(k for k in after if not torch.equal(after[k], before[k]))
    result["shard_sums"] = {k: float(v.double().sum()) for k, v in after.items()}
    # AdamW creates its state at its first step: none means it never ran.
    result["optimizer_state"] = len(optimizer.state)
    (run_dir / f"result.rank{rank}.json").write_text(json.dumps(result, default=str))


def group_numbers(model: nn.Module) -> dict[str, int]:
    """Each shard group's own collective sequence number, read once after training: what the
    recorder's locally counted ``collective_seq`` must have reached."""
    numbers = {}
    for module in model.modules():
        state = getattr(getattr(module, "hsdp_scheduler", None), "hsdp_state", None)
        for hsdp_param in state.sharded_hsdp_params if state is not None else ():
            info = hsdp_param.mesh_info
            for group in (info.shard_process_group, getattr(info, "replicate_process_group",
                                                            None)):
                if group is not None:
                    numbers[str(group.group_name)] = int(group._get_sequence_number_for_group())
    return numbers


def num_wrapped(model: nn.Module) -> int:
    """Units whose ``hsdp_state`` carries instance-level method wrappers (the recorder's)."""
    states = [getattr(m.hsdp_scheduler, "hsdp_state", None) for m in model.modules()
              if getattr(m, "hsdp_scheduler", None) is not None]
    return sum("unshard" in vars(state) for state in states if state is not None)


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


STOP_STEP = 2  # where rank 1 stops in an ending job: step 2, micro-step 0, layers.1's forward
ENDING_STEPS = 4


def ending(out: Path, case: str) -> None:
    """An HSDP job whose rank 1 stops (``tests/jobs_scripts/ending_job.py``'s, on HSDP).

    Recorded with ``fsdptrace.attach`` and no ``with`` (the exit guards alone record the
    ending) into ``<out>/run``. At step 2, micro-step 0, rank 1 enters ``layers.1``'s forward,
    writes ``<out>/truth.json`` (step, micro-step, phase, unit) and then, by ``case``:

    - ``hang``: sleeps (the test sends SIGKILL or SIGTERM);
    - ``raise``: raises ``RuntimeError("planted failure in layers.1")``, uncaught;
    - ``skip``: that forward runs without ``layers.2`` (a rank that skips a unit; ``truth.json``
      is written at ``layers.1`` all the same), and training goes on;
    - ``extra-gather``: nothing stops at step 2; instead rank 1 gathers ``layers.2`` once more
      after step 1's last backward (``unshard()`` then ``reshard()``, before its optimizer
      step), so rank 0 issues that many all-gathers fewer in step 1, micro-step 1's forward,
      and training goes on with every later collective meeting the wrong partner.
    """
    import fsdptrace

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build()
    one_ahead(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    recorder = fsdptrace.attach(model, run_dir=out / "run", optimizer=optimizer,
                                close_timeout_s=2.0)
    truth = out / "truth.json"

    def stop(module: nn.Module, args: Any) -> None:
        if rank != 1 or recorder.step != STOP_STEP or recorder.micro_step != 0:
            return
        truth.write_text(json.dumps([STOP_STEP, 0, "forward", "layers.1"]))
        print("stopping", flush=True)
        if case == "raise":
            raise RuntimeError("planted failure in layers.1")
        if case == "hang":
            time.sleep(600)

    # Registered after fsdptrace's (prepended) hook and HSDP's: the unit's entry is recorded,
    # and its gather waited for, first.
    model.layers[1].register_forward_pre_hook(stop)
    generator = torch.Generator().manual_seed(rank)
    with SkipDTensorDispatch():
        for step in range(ENDING_STEPS):
            for micro in range(NUM_MICRO_STEPS):
                skips = case == "skip" and rank == 1 and (step, micro) == (STOP_STEP, 0)
                model.order = [0, 1, 3] if skips else list(range(NUM_LAYERS))
                model(torch.randn(4, DIM, generator=generator)).pow(2).mean().backward()
            if case == "extra-gather" and rank == 1 and step == STOP_STEP - 1:
                model.layers[2].unshard()
                model.layers[2].reshard()
            hsdp_sync_stream()
            optimizer.step()
            optimizer.zero_grad()
    recorder.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--zero-code", action="store_true")
    parser.add_argument("--ending", choices=["hang", "raise", "skip", "extra-gather"])
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args()
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {sorted(CASES)}")
    if args.zero_code:
        zero_code()
        return
    if args.ending:
        args.out.mkdir(parents=True, exist_ok=True)
        ending(args.out, args.ending)
        return
    run_cases(args.cases, lambda name, rank: run_case(args.out, name, rank))


if __name__ == "__main__":
    main()
