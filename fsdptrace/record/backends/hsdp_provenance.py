"""All-gather provenance (HSDP, hyper_parallel): FSDP2's ``allgathers`` rows from HSDP's state.

Checks 8 and 9, the unsharded-memory ledger and ``diff``'s bytes read one table whatever the
framework, so HSDP writes the rows FSDP2's provenance writes (``fsdp2.provenance``): ``issue``,
``consume``, ``noop`` (``pending``, ``unsharded``, ``skipped``) and ``reshard``, with the
issuer's kind and unit. hyper_parallel 0.1 gathers a unit through its ``hsdp_state``:

- ``unshard(async_op)`` all-gathers every sharded parameter (``prefetch()`` is
  ``unshard(async_op=True)``): nothing when the unit is unsharded (``is_shard`` False), and a
  parameter whose ``prefetch_handle`` is set (its gather pending) is skipped; a blocking call
  then runs ``wait_for_unshard`` itself;
- ``wait_for_unshard()`` waits for the handles and swaps the gathered parameters in
  (``is_shard`` becomes False): the consume;
- ``shard()`` frees them (``reshard()`` and the forward hook call it): the reshard.

Nothing in hyper_parallel drops a gather nobody waits for (FSDP2's ``finalize_backward`` does):
it stays pending, its buffers allocated, until the unit's next ``unshard`` waits on it, a phase,
a micro-step or steps later. So HSDP has no ``drop`` rows; such a gather ends in a late
``consume`` (check 8) or never (check 3 finds it pending at the boundary, and the ledger keeps
holding its bytes).

Each state *instance* gets the wrappers (``InstanceAttributePatch``), calling through whatever
sits behind them as FSDP2's do. Who issued a gather is read from the call stack
(``hsdp_issuers``); an ``unshard`` takes its row's ``seq`` before calling through, so the
issue of a blocking gather comes before the consume its inner ``wait_for_unshard`` records.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fsdptrace.record.backends import hsdp_issuers
from fsdptrace.record.backends.base import InstanceAttributePatch
from fsdptrace.record.backends.fsdp2 import provenance as fsdp2_provenance
from fsdptrace.record.backends.fsdp2.provenance import (
    CONSUME,
    ISSUE,
    NOOP,
    PENDING,
    RESHARD,
    SKIPPED,
    TABLE,
    UNSHARDED,
)
from fsdptrace.record.backends.issuers import Issuers

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder

# HSDP gathers a unit, not FSDP2's parameter groups (``group[i]``); -1, as the pending rows
# it is joined with (named by parameter or ``parameters``) read, so check 3 names the issuer.
NO_GROUP = -1
_graph_task_id = torch._C._current_graph_task_id


def install(rec: Recorder) -> list[InstanceAttributePatch]:
    """Wrap the ``hsdp_state`` of every unit that gathers parameters; [] when none has the
    methods read here. A unit without sharded parameters (a root that owns none) runs no
    all-gather and gets no rows, as FSDP2's has no parameter group."""
    states = [(unit.index, unit.handle.hsdp_state) for unit in rec.units
              if _wrappable(getattr(unit.handle, "hsdp_state", None))]
    if not states:
        return []
    issuers = hsdp_issuers.for_recorder(rec)
    if issuers is None:
        return []
    rows = rec.writer.buffer(TABLE, fsdp2_provenance._vocab(rec.unit_names))
    return [_wrap_state(_Recording(rec, rows, issuers), unit, state) for unit, state in states]


def _wrappable(state: Any) -> bool:
    return (state is not None and hasattr(state, "is_shard")
            and bool(getattr(state, "sharded_hsdp_params", None))
            and all(callable(getattr(state, name, None))
                    for name in ("unshard", "wait_for_unshard", "shard")))


class _Recording:
    """What one unit's wrappers share: the recorder, the table, the issuers, the bytes."""

    def __init__(self, rec: Recorder, rows: Any, issuers: Issuers) -> None:
        self.rec = rec
        self.rows = rows
        self.issuers = issuers
        self.num_bytes = -1  # computed at the first recorded row (after lazy init)

    def should_record(self) -> bool:
        rec = self.rec
        # Eval/generation forwards run with gradients off and are never recorded (as FSDP2's).
        return rec.recording and not (rec.in_eval and not torch.is_grad_enabled())

    def append(self, seq: int, t_ns: int, backward: bool, unit: int, event: int, kind: int,
               source: int, state: Any, detail: int) -> None:
        rec = self.rec
        if self.num_bytes < 0:
            self.num_bytes = bytes_of(state)
        self.rows.append((seq, t_ns, rec.step, rec.micro_step, 1 if backward else 0, unit,
                          NO_GROUP, event, kind, source, self.num_bytes, detail))


def bytes_of(state: Any) -> int:
    """Bytes of the unit's gathered parameters (the sharded ones), in the dtype gathered in."""
    total = 0
    for hsdp_param in getattr(state, "sharded_hsdp_params", ()) or ():
        size = getattr(hsdp_param, "_orig_size", None)
        dtype: torch.dtype = (getattr(hsdp_param, "param_dtype", None)
                              or getattr(hsdp_param, "orig_dtype", None) or torch.float32)
        if size is not None:
            total += int(torch.Size(size).numel()) * dtype.itemsize
    return total


def is_pending(state: Any) -> bool:
    """A gather issued and not waited for: 0.1's ``prefetch_handle``, or a newer release's
    ``allgather_comm_ctx.allgather_handle``."""
    for hsdp_param in getattr(state, "sharded_hsdp_params", ()) or ():
        if getattr(hsdp_param, "prefetch_handle", None) is not None:
            return True
        ctx = getattr(hsdp_param, "allgather_comm_ctx", None)
        if ctx is not None and getattr(ctx, "allgather_handle", None) is not None:
            return True
    return False


def call_through(obj: Any, name: str) -> Callable[..., Any]:
    """Another tool's instance-level wrapper found at attach, else the class attribute looked
    up at each call (a class-level wrapper installed later still runs)."""
    earlier = obj.__dict__.get(name)
    if earlier is not None:
        return earlier  # type: ignore[no-any-return]
    cls = type(obj)
    return lambda *args, **kwargs: getattr(cls, name)(obj, *args, **kwargs)


def wrapper_codes() -> frozenset[Any]:
    """The code objects our ``unshard`` wrapper runs in (the wrapper and its call-through),
    for readers of the stack to step over."""
    codes = [*_wrap_unshard.__code__.co_consts, *call_through.__code__.co_consts]
    return frozenset(c for c in codes if getattr(c, "co_name", None) in ("unshard", "<lambda>"))


def _wrap_state(prov: _Recording, unit: int, state: Any) -> InstanceAttributePatch:
    opened = [False]  # an issue recorded and not yet consumed
    return InstanceAttributePatch(state, {
        "unshard": _wrap_unshard(prov, unit, state, opened),
        "wait_for_unshard": _wrap_wait(prov, unit, state, opened),
        "shard": _wrap_shard(prov, unit, state),
    })


def _wrap_unshard(prov: _Recording, unit: int, state: Any, opened: list[bool]
                  ) -> Callable[..., Any]:
    rec = prov.rec
    call = call_through(state, "unshard")
    issuer_of = prov.issuers.of

    def unshard(*args: Any, **kwargs: Any) -> Any:
        if not rec.recording or (rec.in_eval and not torch.is_grad_enabled()):
            return call(*args, **kwargs)
        try:
            seq, t_ns = rec.next_seq(), time.monotonic_ns()
            backward = _graph_task_id() != -1
            # hyper_parallel's own order: an unsharded unit returns at once, then a parameter
            # whose gather is pending is skipped.
            if state.is_shard is False:
                detail = UNSHARDED
            elif is_pending(state):
                detail = PENDING
            else:
                detail = -1
                opened[0] = True  # a blocking gather's inner wait consumes it
            kind, source = issuer_of(sys._getframe(1), unit, backward)
        except Exception as error:
            rec.disable(f"all-gather provenance failed: {type(error).__name__}: {error}")
            return call(*args, **kwargs)
        out = call(*args, **kwargs)
        try:
            event = NOOP
            if detail == -1:
                if state.is_shard is False or is_pending(state):
                    event = ISSUE
                else:
                    detail, opened[0] = SKIPPED, False
            prov.append(seq, t_ns, backward, unit, event, kind, source, state, detail)
        except Exception as error:
            rec.disable(f"all-gather provenance failed: {type(error).__name__}: {error}")
        return out

    return unshard


def _wrap_wait(prov: _Recording, unit: int, state: Any, opened: list[bool]
               ) -> Callable[..., Any]:
    """``wait_for_unshard``: a consume when it takes the unit from sharded to unsharded.

    Most calls find the unit unsharded already (HSDP's pre-forward after a prefetch does not,
    every ``_UnshardHandle.wait`` after a blocking one does): those read one attribute.
    """
    rec = prov.rec
    call = call_through(state, "wait_for_unshard")

    def wait_for_unshard(*args: Any, **kwargs: Any) -> Any:
        was_sharded = state.is_shard is True
        t_ns = time.monotonic_ns() if was_sharded else 0
        out = call(*args, **kwargs)
        if not was_sharded or not rec.recording:
            return out
        try:
            if state.is_shard is False and opened[0]:
                opened[0] = False
                if prov.should_record():
                    prov.append(rec.next_seq(), t_ns, _graph_task_id() != -1, unit, CONSUME,
                                -1, -1, state, -1)
        except Exception as error:
            rec.disable(f"all-gather provenance failed: {type(error).__name__}: {error}")
        return out

    return wait_for_unshard


def _wrap_shard(prov: _Recording, unit: int, state: Any) -> Callable[..., Any]:
    """``shard``: a reshard row when the unit's unsharded parameters are freed."""
    rec = prov.rec
    call = call_through(state, "shard")

    def shard(*args: Any, **kwargs: Any) -> Any:
        unsharded = state.is_shard is False
        out = call(*args, **kwargs)
        if not unsharded or not rec.recording:
            return out
        try:
            if state.is_shard is True and prov.should_record():
                prov.append(rec.next_seq(), time.monotonic_ns(), _graph_task_id() != -1, unit,
                            RESHARD, -1, -1, state, -1)
        except Exception as error:
            rec.disable(f"all-gather provenance failed: {type(error).__name__}: {error}")
        return out

    return shard
