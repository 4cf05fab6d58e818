"""A small fake of the reference checker's HSDP layout, on real modules and autograd.

The HSDP backend is tested on real hyper_parallel units; this fake remains for the one thing
that release cannot do: the newer layout the reference checker
(``shared/reference/fsdp_diagnostics_reference.txt``) reads, fused
``param_group.all_gather_buckets`` and per-parameter ``allgather_comm_ctx``. It carries exactly
those attributes and moves them the way a sharded framework does, driven by real
forward/backward hooks in one process:

- a unit's pre-forward consumes its own all-gather, then issues one into each of its
  ``forward_prefetch_cells``; its pre-backward (first output gradient) does the same for
  ``backward_prefetch_cells``;
- ``scheduler_ctx.root_bp_state`` is True from the root's backward begin to the end of
  backward, so activation-checkpoint recompute is told apart from forward;
- at the end of backward, results nobody consumed are dropped (as FSDP2's
  ``finalize_backward`` does), so a pending all-gather at the optimizer boundary exists only
  where a test plants one;
- gradients land on the real parameters (``sharded_param.grad``).

No communication happens: a "handle" is a plain object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten


@dataclass
class AllGatherResult:
    handle: Any = None


@dataclass
class AllGatherBucket:
    all_gather_result: AllGatherResult | None = None


@dataclass
class ParamGroup:
    all_gather_buckets: list[AllGatherBucket] = field(default_factory=lambda: [AllGatherBucket()])


@dataclass
class AllGatherCommContext:
    allgather_handle: Any = None
    allgather_output: Any = None


@dataclass
class HSDPParam:
    sharded_param: nn.Parameter
    _param_fqn: str
    allgather_comm_ctx: AllGatherCommContext = field(default_factory=AllGatherCommContext)
    _grad: Any = None
    unsharded_accumulated_grad: Any = None
    unsharded_accumulated_grad_data: Any = None


@dataclass
class HSDPState:
    param_group: ParamGroup
    hsdp_params: list[HSDPParam]


@dataclass
class SchedulerContext:
    """Shared by every unit of one model part, as the root's backward state is."""

    root_bp_state: bool = False


@dataclass
class HSDPScheduler:
    hsdp_state: HSDPState
    scheduler_ctx: SchedulerContext
    forward_prefetch_cells: list[nn.Module] = field(default_factory=list)
    backward_prefetch_cells: list[nn.Module] = field(default_factory=list)


def scheduler(module: nn.Module) -> HSDPScheduler:
    found: HSDPScheduler = module.hsdp_scheduler  # type: ignore[assignment]
    return found


def bucket(module: nn.Module, index: int = 0) -> AllGatherBucket:
    return scheduler(module).hsdp_state.param_group.all_gather_buckets[index]


def shard(root: nn.Module, unit_fqns: list[str]) -> SchedulerContext:
    """Make ``root`` and the modules at ``unit_fqns`` HSDP units (children first, like FSDP)."""
    ctx = SchedulerContext()
    modules = dict(root.named_modules())
    owned: set[int] = set()
    for fqn in [*unit_fqns, ""]:
        module = modules[fqn]
        params = [HSDPParam(p, f"{fqn}.{n}" if fqn else n)
                  for n, p in module.named_parameters() if id(p) not in owned]
        owned.update(id(hp.sharded_param) for hp in params)
        module.hsdp_scheduler = HSDPScheduler(HSDPState(ParamGroup(), params), ctx)
        module.register_forward_pre_hook(_pre_forward)
        module.register_forward_hook(_post_forward)
    root.register_forward_hook(_root_post_forward)
    return ctx


def _issue(targets: list[nn.Module]) -> None:
    for target in targets:
        b = bucket(target)
        if b.all_gather_result is None:  # already pending: the framework skips it
            b.all_gather_result = AllGatherResult(handle=object())


def _pre_forward(module: nn.Module, args: Any) -> None:
    s = scheduler(module)
    if s.scheduler_ctx.root_bp_state:
        return  # recompute: parameters are gathered by the backward schedule
    bucket(module).all_gather_result = None
    _issue(s.forward_prefetch_cells)


def _post_forward(module: nn.Module, args: Any, output: Any) -> None:
    s = scheduler(module)
    tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
    if s.scheduler_ctx.root_bp_state or not tensors:
        return
    fired = [False]

    def pre_backward(grad: torch.Tensor) -> None:
        if not fired[0]:
            fired[0] = True
            bucket(module).all_gather_result = None
            _issue(s.backward_prefetch_cells)

    for tensor in tensors:
        tensor.register_hook(pre_backward)


def _root_post_forward(root: nn.Module, args: Any, output: Any) -> None:
    ctx = scheduler(root).scheduler_ctx
    tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
    if ctx.root_bp_state or not tensors:
        return

    def end_of_backward() -> None:
        ctx.root_bp_state = False
        for module in root.modules():
            s = getattr(module, "hsdp_scheduler", None)
            if s is not None:
                for b in s.hsdp_state.param_group.all_gather_buckets:
                    b.all_gather_result = None

    def root_backward_begins(grad: torch.Tensor) -> None:
        if not ctx.root_bp_state:
            ctx.root_bp_state = True
            torch.autograd.Variable._execution_engine.queue_callback(end_of_backward)

    tensors[0].register_hook(root_backward_begins)
