"""Every collective FSDP2 issues for a unit, recorded before it is issued, with its sequence number.

FSDP2 issues a unit's all-gather in ``foreach_all_gather`` (from ``FSDPParamGroup.unshard``)
and its reduce-scatter, and for a 2-D mesh its all-reduce, in ``foreach_reduce`` (from
``FSDPParamGroup.post_backward``); ``_fsdp_param_group`` calls both through its module
globals. Those two names are wrapped there, once per process, and each call is routed to its
recorder and unit by the identity of its first ``FSDPParam``. A custom all-gather or
reduce-scatter (``set_custom_all_gather``) runs inside them, so it is recorded too.

The sequence number is the process group's own counter (``ProcessGroup.
_get_sequence_number_for_group()``, on gloo and NCCL in torch 2.13): the number of collectives
issued on the group so far, so the one about to be issued gets that plus one, which is the
Flight Recorder's ``collective_seq_id`` (checked by experiment on gloo). The row goes into
the journal before FSDP2 is called, so a rank that hangs inside the collective shows which
one.

Reading that counter costs 0.3-2 µs in a loop but was measured adding 2 to 30 µs per
collective inside a loaded 2-rank training job, varying with the load
(``benchmarks/collective_record_cost.py``), so ``Numbers`` reads it once per group and pass
and counts from there. Counting alone is not enough: FSDP2's 1-D mesh uses the default
group, and the collectives around FSDP's passes land on it too (``clip_grad_norm_``'s
all-reduce of DTensor norms, a loss all-reduced for logging, an eval metric, a barrier;
measured: each shifts the group's number past a local count). Those run between passes, so
the first collective of each pass reads the number again. Eval forwards, between which
metrics are commonly all-reduced, read it at every collective. What is not seen: a collective
the model's own code issues on FSDP's group in the middle of a pass (``SyncBatchNorm`` on the
default group), or between two passes that share (step, micro-step) with no backward between
(a forward retried after ``reset_iter_state()`` under the same numbers): the pass's later FSDP
collectives are then numbered too low by as many collectives.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fsdptrace.record.backends.fsdp2 import provenance
from fsdptrace.record.backends.fsdp2.issuers import Issuers, for_recorder
from fsdptrace.record.backends.fsdp2.state import param_groups
from fsdptrace.store import schema

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder

TABLE = "collectives"
FORWARD, BACKWARD, EVAL = range(len(schema.COLLECTIVE_PHASES))
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = range(len(schema.COLLECTIVE_KINDS))
POST_BACKWARD = schema.COLLECTIVE_ISSUERS.index("post_backward")
END_OF_BACKWARD = schema.COLLECTIVE_ISSUERS.index("end_of_backward")

_graph_task_id = torch._C._current_graph_task_id
_DECORATORS_FILE = "_fsdp_common.py"
_PROVENANCE_UNSHARD = provenance.unshard_code()


class Route:
    """Where one parameter group's collectives are recorded: its recorder's table, its unit."""

    __slots__ = ("rec", "rows", "unit", "param_group", "issuers", "group_codes", "numbers")

    def __init__(self, rec: Recorder, rows: Any, unit: int, param_group: Any,
                 issuers: Issuers, group_codes: dict[str, int], numbers: Numbers) -> None:
        self.rec, self.rows, self.unit, self.param_group = rec, rows, unit, param_group
        self.issuers, self.group_codes, self.numbers = issuers, group_codes, numbers

    def record(self, kind: int, group: Any, issuer: tuple[int, int]) -> None:
        rec = self.rec
        if not rec.recording:
            return
        try:
            name = group.group_name
            if rec.in_eval and not torch.is_grad_enabled():
                phase, micro_step = EVAL, -1
                number = group._get_sequence_number_for_group() + 1
            else:
                task = _graph_task_id()
                phase = BACKWARD if task != -1 else FORWARD
                micro_step = rec.micro_step
                number = self.numbers.next(group, name, (rec.step, micro_step, task))
            self.rows.append((rec.next_seq(), time.monotonic_ns(), rec.step, micro_step, phase,
                              self.unit, kind, self.group_codes.get(name, -1), number,
                              *issuer))
        except Exception as error:
            rec.disable(f"collective recording failed: {type(error).__name__}: {error}")


class Numbers:
    """One recorder's sequence numbers per process group: the group's counter read at the
    first collective of a pass (step, micro-step, autograd graph task), counted on from there
    within it (see the module's docstring for why that is exact, and where it is not)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[str, list[Any]] = {}  # group name -> [pass, last number given]

    def next(self, group: Any, name: str, pass_key: tuple[int, int, int]) -> int:
        """The number of the collective about to be issued on ``group`` in ``pass_key``."""
        last = self._last.get(name)
        if last is not None and last[0] == pass_key:
            last[1] += 1
            return last[1]
        number = group._get_sequence_number_for_group() + 1
        self._last[name] = [pass_key, number]
        return number


# id(FSDPParam) -> its unit's route; the params live as long as the model, and a route is
# dropped when its recorder closes.
_routes: dict[int, Route] = {}
_originals: dict[str, Callable[..., Any]] = {}


class Installed:
    """The handle ``hooks.install`` keeps: ``remove()`` drops this recorder's routes and, with
    no recorder left, puts FSDP2's functions back (unless someone wrapped ours since)."""

    def __init__(self, keys: list[int]) -> None:
        self.keys = keys

    def remove(self) -> None:
        for key in self.keys:
            _routes.pop(key, None)
        self.keys = []
        if not _routes:
            _unpatch()


def install(rec: Recorder) -> list[Installed]:
    """Route every unit's parameters to ``rec`` and wrap FSDP2's two collective functions."""
    module = _param_group_module(rec)
    if module is None:
        return []
    groups = _process_group_names(rec)
    rows = rec.writer.buffer(TABLE, {
        "phase": schema.COLLECTIVE_PHASES, "unit": rec.unit_names,
        "kind": schema.COLLECTIVE_KINDS, "group": groups,
        "issuer_kind": schema.COLLECTIVE_ISSUERS, "issuer_unit": rec.unit_names})
    codes = {name: index for index, name in enumerate(groups)}
    issuers = for_recorder(rec)
    if issuers is None:
        return []
    keys = []
    numbers = Numbers()
    for unit in rec.units:
        for param_group in param_groups(unit.handle):
            route = Route(rec, rows, unit.index, param_group, issuers, codes, numbers)
            for fsdp_param in getattr(param_group, "fsdp_params", ()):
                _routes[id(fsdp_param)] = route
                keys.append(id(fsdp_param))
    _patch(module)
    return [Installed(keys)]


def _param_group_module(rec: Recorder) -> Any:
    for unit in rec.units:
        groups = param_groups(unit.handle)
        if groups:
            module = sys.modules.get(type(groups[0]).__module__)
            if hasattr(module, "foreach_all_gather") and hasattr(module, "foreach_reduce"):
                return module
    return None


def _process_group_names(rec: Recorder) -> list[str]:
    """Names of every process group the units' meshes use, in first-seen order."""
    names: dict[str, None] = {}
    for unit in rec.units:
        for group in param_groups(unit.handle):
            info = getattr(group, "mesh_info", None)
            for attr in ("shard_process_group", "replicate_process_group"):
                with_name = getattr(info, attr, None) if info is not None else None
                name = getattr(with_name, "group_name", None)
                if name is not None:
                    names[str(name)] = None
    return list(names)


def _patch(module: Any) -> None:
    if _originals:
        return
    _originals["module"] = module
    _originals["foreach_all_gather"] = all_gather = module.foreach_all_gather
    _originals["foreach_reduce"] = reduce = module.foreach_reduce
    module.foreach_all_gather = _wrap_all_gather(all_gather)
    module.foreach_reduce = _wrap_reduce(reduce)


def _unpatch() -> None:
    module = _originals.pop("module", None)
    if module is None:
        return
    for name in ("foreach_all_gather", "foreach_reduce"):
        original = _originals.pop(name)
        if getattr(getattr(module, name), "__wrapped__", None) is original:
            setattr(module, name, original)


def _wrap_all_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    def foreach_all_gather(fsdp_params: Sequence[Any], group: Any, *args: Any,
                           **kwargs: Any) -> Any:
        route = _routes.get(id(fsdp_params[0])) if fsdp_params else None
        if route is not None and route.rec.recording:
            backward = _graph_task_id() != -1
            route.record(ALL_GATHER, group, route.issuers.of(
                _unshard_caller(sys._getframe(1)), route.unit, backward))
        return original(fsdp_params, group, *args, **kwargs)

    foreach_all_gather.__wrapped__ = original  # type: ignore[attr-defined]
    return foreach_all_gather


def _unshard_caller(frame: Any) -> Any:
    """Who called ``FSDPParamGroup.unshard`` (``frame``), past FSDP2's decorators around it
    (``_fsdp_common``) and ``provenance``'s wrapper: the frame ``provenance`` reads its
    issuer from, so both tables name the same issuer."""
    frame = frame.f_back
    while frame is not None and (frame.f_code.co_filename.endswith(_DECORATORS_FILE)
                                 or frame.f_code is _PROVENANCE_UNSHARD):
        frame = frame.f_back
    return frame


def _wrap_reduce(original: Callable[..., Any]) -> Callable[..., Any]:
    def foreach_reduce(fsdp_params: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        route = _routes.get(id(fsdp_params[0])) if fsdp_params else None
        if route is not None and route.rec.recording:
            _record_reduce(route, args, kwargs)
        return original(fsdp_params, *args, **kwargs)

    foreach_reduce.__wrapped__ = original  # type: ignore[attr-defined]
    return foreach_reduce


def _record_reduce(route: Route, args: tuple, kwargs: dict) -> None:
    """The reduce-scatter (on a group of more than one rank), then the all-reduce of a 2-D
    mesh when this backward syncs it; ``foreach_reduce``'s arguments by position or name."""
    # A unit whose backward did not run is reduced from the root's end-of-backward callback,
    # its training state still IDLE (as ``grads`` records ``via``).
    state = getattr(route.param_group, "_training_state", None)
    idle = getattr(state, "name", "") == "IDLE"
    issuer = (END_OF_BACKWARD if idle else POST_BACKWARD, route.unit)
    scatter = _argument(args, kwargs, 1, "reduce_scatter_group")
    if scatter is not None and scatter.size() > 1:
        route.record(REDUCE_SCATTER, scatter, issuer)
    reduce = _argument(args, kwargs, 8, "all_reduce_group")
    if reduce is not None and _argument(args, kwargs, 10, "all_reduce_grads"):
        route.record(ALL_REDUCE, reduce, issuer)


def _argument(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    """``foreach_reduce``'s argument ``name``: ``index`` counts from its second parameter."""
    return args[index] if len(args) > index else kwargs.get(name)

