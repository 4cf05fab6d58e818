"""Every collective hyper_parallel issues for a unit, recorded before it is issued, numbered.

hyper_parallel 0.1 issues one collective per sharded parameter (``TorchHSDPParamV2``), where
FSDP2 issues one per unit: ``_get_unsharded_param_data`` all-gathers the parameter (called by
its ``unshard``, which ``hsdp_state.unshard`` calls for each parameter), ``reduce_scatter_grad``
and, on a 2-D mesh, ``all_reduce_grad`` reduce its gradient (from ``hsdp_state.post_backward``,
which hyper_parallel calls only for a unit that ran backward). Each parameter instance gets
the three wrappers (``InstanceAttributePatch``, calling through whatever sits behind them); a
call writes a row only when hyper_parallel is about to issue the collective, by its own tests:
a sharded parameter on a shard group of more than one rank, or an HSDP mesh's replicate group
of more than one rank. The all-gather's issuer is read from the stack above
``hsdp_state.unshard`` (``hsdp_issuers``, as provenance reads it, stepping over provenance's
wrapper).

The sequence number is counted here, per process group, not asked of the group at each
collective (FSDP2's recorder measured ``_get_sequence_number_for_group()`` at ~100 µs inside
training on gloo; ``benchmarks/hsdp_collective_cost.py`` times it here): the group's counter is
read once, when the group is first seen, and each recorded collective adds one. Found by
experiment (2 ranks, gloo, torch 2.13): the shard group is a group of its own (not WORLD),
nothing but these per-parameter collectives runs on it, and the local count equals the group's
counter after each of them (80 in two steps, numbered 1..80 without a gap); the Flight
Recorder's ``collective_seq_id`` is the same number. A job that issues collectives of its own on
that group makes the count lag.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

import torch

from fsdptrace.record.backends import hsdp_issuers, hsdp_provenance
from fsdptrace.record.backends.base import InstanceAttributePatch
from fsdptrace.record.backends.issuers import MAX_FOREIGN_FRAMES, Issuers
from fsdptrace.store import schema

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder

TABLE = "collectives"
FORWARD, BACKWARD, EVAL = range(len(schema.COLLECTIVE_PHASES))
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = range(len(schema.COLLECTIVE_KINDS))
POST_BACKWARD = schema.COLLECTIVE_ISSUERS.index("post_backward")
_STATE_FILE = os.sep + "hsdp_state.py"
_PROVENANCE_CODES = hsdp_provenance.wrapper_codes()
_graph_task_id = torch._C._current_graph_task_id


class Numbers:
    """Each process group's collective sequence number, counted locally from its first read."""

    def __init__(self, names: list[str]) -> None:
        self.codes = {name: index for index, name in enumerate(names)}
        self._by_group: dict[int, list[int]] = {}  # id(group) -> [group code, last number]

    def next(self, group: Any) -> tuple[int, int]:
        """(group code, number of the collective about to be issued on ``group``)."""
        entry = self._by_group.get(id(group))
        if entry is None:
            entry = self._by_group[id(group)] = [
                self.codes.get(str(group.group_name), -1),
                int(group._get_sequence_number_for_group())]
        entry[1] += 1
        return entry[0], entry[1]


class Route:
    """Where one unit's collectives are recorded: its recorder's table, its unit, the numbers."""

    __slots__ = ("rec", "rows", "unit", "first", "issuers", "numbers", "_last")

    def __init__(self, rec: Recorder, rows: Any, unit: int, first: Any, issuers: Issuers,
                 numbers: Numbers) -> None:
        self.rec, self.rows, self.unit, self.first = rec, rows, unit, first
        self.issuers, self.numbers = issuers, numbers
        # (id of the ``hsdp_state.unshard`` frame, the issuer read for it): live while that
        # call runs, so its id names it; forgotten when ``first`` (the unit's first sharded
        # parameter, gathered first in every call) is gathered, so a later call whose frame
        # reuses the id never finds a stale issuer.
        self._last: tuple[int, tuple[int, int]] | None = None

    def record(self, kind: int, group: Any, issuer: tuple[int, int]) -> None:
        rec = self.rec
        try:
            if rec.in_eval and not torch.is_grad_enabled():
                phase, micro_step = EVAL, -1
            else:
                phase = BACKWARD if _graph_task_id() != -1 else FORWARD
                micro_step = rec.micro_step
            code, number = self.numbers.next(group)
            self.rows.append((rec.next_seq(), time.monotonic_ns(), rec.step, micro_step, phase,
                              self.unit, kind, code, number, *issuer))
        except Exception as error:
            rec.disable(f"collective recording failed: {type(error).__name__}: {error}")

    def record_reduce(self, kind: int, group_of: Callable[[Any], Any], hsdp_param: Any) -> None:
        """A gradient reduction, when ``group_of`` finds a group it runs on."""
        try:
            group = group_of(hsdp_param)
        except Exception as error:
            self.rec.disable(f"collective recording failed: {type(error).__name__}: {error}")
            return
        if group is not None:
            self.record(kind, group, (POST_BACKWARD, self.unit))

    def gather_issuer(self, frame: FrameType | None) -> tuple[int, int]:
        """Who called ``hsdp_state.unshard`` above ``frame`` (the parameter's own ``unshard``),
        past provenance's wrapper: the frame provenance reads its issuer from.

        ``hsdp_state.unshard`` gathers the unit's parameters in one loop, so the stack is read
        for its first parameter and reused for the others of the same call (the same frame).
        """
        state_frame = _state_unshard_frame(frame)
        if state_frame is None:
            return self.issuers.of(None, self.unit, _graph_task_id() != -1)
        last = self._last
        if last is not None and last[0] == id(state_frame):
            return last[1]
        caller = state_frame.f_back
        while caller is not None and caller.f_code in _PROVENANCE_CODES:
            caller = caller.f_back
        issuer = self.issuers.of(caller, self.unit, _graph_task_id() != -1)
        self._last = (id(state_frame), issuer)
        return issuer

    def forget_issuer(self) -> None:
        """The unit's first parameter is being gathered: a new ``hsdp_state.unshard`` call."""
        self._last = None


# Whether a code object is ``hsdp_state.unshard``'s, decided once per code object.
_is_state_unshard: dict[CodeType, bool] = {}


def _state_unshard_frame(frame: FrameType | None) -> FrameType | None:
    """The ``hsdp_state.unshard`` frame at or above ``frame``, within a few wrapper frames."""
    for _ in range(MAX_FOREIGN_FRAMES + 2):
        if frame is None:
            return None
        code = frame.f_code
        found = _is_state_unshard.get(code)
        if found is None:
            found = _is_state_unshard[code] = (code.co_name == "unshard"
                                               and code.co_filename.endswith(_STATE_FILE))
        if found:
            return frame
        frame = frame.f_back
    return None


def install(rec: Recorder) -> list[InstanceAttributePatch]:
    """Wrap every sharded parameter's three collectives; [] when no unit has them."""
    params = [(unit.index, hsdp_param) for unit in rec.units
              for hsdp_param in _sharded_params(unit.handle)]
    issuers = hsdp_issuers.for_recorder(rec)
    if not params or issuers is None:
        return []
    names = _process_group_names(p for _, p in params)
    rows = rec.writer.buffer(TABLE, {
        "phase": schema.COLLECTIVE_PHASES, "unit": rec.unit_names,
        "kind": schema.COLLECTIVE_KINDS, "group": names,
        "issuer_kind": schema.COLLECTIVE_ISSUERS, "issuer_unit": rec.unit_names})
    numbers = Numbers(names)
    routes: dict[int, Route] = {}
    for unit, hsdp_param in params:  # each unit's first sharded parameter is its ``first``
        if unit not in routes:
            routes[unit] = Route(rec, rows, unit, hsdp_param, issuers, numbers)
    return [InstanceAttributePatch(hsdp_param, {
        "_get_unsharded_param_data": _wrap_gather(routes[unit], hsdp_param),
        "reduce_scatter_grad": _wrap_reduce(routes[unit], hsdp_param, "reduce_scatter_grad",
                                            REDUCE_SCATTER, _shard_group),
        "all_reduce_grad": _wrap_reduce(routes[unit], hsdp_param, "all_reduce_grad",
                                        ALL_REDUCE, _replicate_group),
    }) for unit, hsdp_param in params if _wrappable(hsdp_param)]


def _sharded_params(scheduler: Any) -> list[Any]:
    state = getattr(scheduler, "hsdp_state", None)
    return list(getattr(state, "sharded_hsdp_params", None) or ())


def _wrappable(hsdp_param: Any) -> bool:
    return all(callable(getattr(hsdp_param, name, None)) for name in
               ("_get_unsharded_param_data", "reduce_scatter_grad", "all_reduce_grad"))


def _process_group_names(params: Any) -> list[str]:
    """Names of every process group the parameters' meshes use, in first-seen order."""
    names: dict[str, None] = {}
    for hsdp_param in params:
        info = getattr(hsdp_param, "mesh_info", None)
        for attr in ("shard_process_group", "replicate_process_group"):
            name = getattr(getattr(info, attr, None), "group_name", None)
            if name is not None:
                names[str(name)] = None
    return list(names)


def _shard_group(hsdp_param: Any) -> Any:
    """The group hyper_parallel all-gathers and reduce-scatters this parameter on, or None
    where it copies instead (not sharded, no shard group, a shard group of one rank)."""
    if not getattr(hsdp_param, "is_sharded", False):
        return None
    info = hsdp_param.mesh_info
    group = getattr(info, "shard_process_group", None)
    return group if group is not None and getattr(info, "shard_mesh_size", 1) > 1 else None


def _replicate_group(hsdp_param: Any) -> Any:
    """The group an HSDP mesh all-reduces this parameter's gradient on, or None (a 1-D mesh,
    or a replicate group of one rank)."""
    info = hsdp_param.mesh_info
    if getattr(info, "shard_process_group", None) is None:
        return None  # not an HSDP mesh: hyper_parallel returns before the all-reduce
    group = getattr(info, "replicate_process_group", None)
    return group if group is not None and getattr(info, "replicate_mesh_size", 1) > 1 else None


def _wrap_gather(route: Route, hsdp_param: Any) -> Callable[..., Any]:
    rec = route.rec
    call = hsdp_provenance.call_through(hsdp_param, "_get_unsharded_param_data")

    def _get_unsharded_param_data(*args: Any, **kwargs: Any) -> Any:
        if rec.recording:
            try:
                if hsdp_param is route.first:
                    route.forget_issuer()
                group = _shard_group(hsdp_param)
                if group is not None:
                    route.record(ALL_GATHER, group, route.gather_issuer(sys._getframe(1)))
            except Exception as error:
                rec.disable(f"collective recording failed: {type(error).__name__}: {error}")
        return call(*args, **kwargs)

    return _get_unsharded_param_data


def _wrap_reduce(route: Route, hsdp_param: Any, method: str, kind: int,
                 group_of: Callable[[Any], Any]) -> Callable[..., Any]:
    """``reduce_scatter_grad`` or ``all_reduce_grad``: a row on ``group_of``'s group, then the
    reduction as hyper_parallel issues it."""
    rec = route.rec
    call = hsdp_provenance.call_through(hsdp_param, method)

    def reduce_grad(*args: Any, **kwargs: Any) -> Any:
        if rec.recording:
            route.record_reduce(kind, group_of, hsdp_param)
        return call(*args, **kwargs)

    return reduce_grad
