"""All-gather provenance (FSDP2): who issued each parameter group's all-gather, who used it.

Checks 8 and 9 need more than the boundary snapshot of check 3: a prefetch whose result waits
into backward, or one FSDP2 silently turns into a no-op, leaves nothing behind at
``optimizer.step()``. So each ``FSDPParamGroup`` *instance* gets wrappers on ``unshard``,
``wait_for_unshard``, ``finalize_backward`` and ``_reset_iter_state`` (instance attributes:
other groups, other models and the class stay untouched, and ``close`` removes them). A wrapper
calls FSDP's method unchanged and only compares ``_all_gather_result`` before and after:
None -> set is an ``issue``, set -> None in a wait is a ``consume``, in the end-of-backward
paths a ``drop``; an ``unshard`` that changes nothing is a ``noop``. ``reshard`` is wrapped too:
a group that leaves the unsharded state there is a ``reshard`` row, the end of the memory the
all-gather held (``fsdptrace.reading.unsharded`` builds the ledger from issue to reshard).

Who issued a gather is read from the call stack (``issuers``). Other tools wrap these
methods too, on the class or the instance, before or after us: our wrappers call through
whatever sits behind them, an instance-level wrapper found at attach, else the class attribute
looked up at each call, so a class-level wrapper installed later still runs. ``close``
removes only the attributes that are still ours and puts back what was there before; a
wrapper installed on top of ours keeps working, ours inside it becomes a pass-through.

Rows are tuples of small ints stored into the journal, like the recorder's events.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fsdptrace.record.backends.base import InstanceAttributePatch
from fsdptrace.record.backends.fsdp2.issuers import ISSUER_KINDS, Issuers, for_recorder
from fsdptrace.record.backends.fsdp2.state import param_groups
from fsdptrace.store import schema

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder

TABLE = "allgathers"
EVENTS = ("issue", "consume", "drop", "noop", "reshard")
ISSUE, CONSUME, DROP, NOOP, RESHARD = range(5)
DETAILS = ("pending", "unsharded", "skipped", "finalize_backward", "reset_iter_state")
PENDING, UNSHARDED, SKIPPED, FINALIZE, RESET = range(5)

_graph_task_id = torch._C._current_graph_task_id


class Provenance:
    """Turns wrapped-method calls into ``allgathers`` rows for one recorder."""

    def __init__(self, rec: Recorder, issuers: Issuers) -> None:
        self.rec = rec
        self.rows = rec.writer.buffer(TABLE, _vocab(rec.unit_names))
        self.issuers = issuers
        self.num_bytes: dict[int, int] = {}  # id(group) -> unsharded bytes, computed lazily

    def should_record(self) -> bool:
        rec = self.rec
        # Eval/generation forwards run with gradients off and are never recorded.
        return rec.recording and not (rec.in_eval and not torch.is_grad_enabled())

    def bytes_of(self, group: Any) -> int:
        """Bytes of the group's unsharded parameters in the dtype they are gathered in."""
        key = id(group)
        cached = self.num_bytes.get(key)
        if cached is None:
            cached = 0
            for fsdp_param in getattr(group, "fsdp_params", ()):
                size = getattr(fsdp_param, "_orig_size", None)
                dtype: torch.dtype = (getattr(fsdp_param, "param_dtype", None)
                                      or getattr(fsdp_param, "orig_dtype", None)
                                      or torch.float32)
                if size is not None:
                    cached += int(torch.Size(size).numel()) * dtype.itemsize
            self.num_bytes[key] = cached
        return cached


def install(rec: Recorder) -> list[InstanceAttributePatch]:
    """Wrap every parameter group of every unit; returns patches whose ``remove()`` undoes them."""
    groups = [(unit.index, group_index, group) for unit in rec.units
              for group_index, group in enumerate(param_groups(unit.handle))]
    issuers = for_recorder(rec)
    if not groups or issuers is None:
        return []
    prov = Provenance(rec, issuers)
    return [_wrap_group(prov, *entry) for entry in groups]


def _wrap_group(prov: Provenance, unit: int, group_index: int, group: Any
                ) -> InstanceAttributePatch:
    return InstanceAttributePatch(group, {
        "unshard": _wrap_unshard(prov, unit, group_index, group),
        "wait_for_unshard": _wrap_clear(prov, unit, group_index, group, "wait_for_unshard",
                                        CONSUME, -1),
        "finalize_backward": _wrap_clear(prov, unit, group_index, group, "finalize_backward",
                                         DROP, FINALIZE),
        "_reset_iter_state": _wrap_clear(prov, unit, group_index, group, "_reset_iter_state",
                                         DROP, RESET),
        "reshard": _wrap_reshard(prov, unit, group_index, group),
    })


def _earlier(group: Any, name: str) -> Callable[..., Any] | None:
    """Another tool's instance-level wrapper of ``group.<name>`` found at attach, or None.

    A wrapper calls it if there is one, else the class attribute looked up at each call, so
    a class-level wrapper installed after attach runs too (binding it now would skip it).
    """
    return group.__dict__.get(name)  # type: ignore[no-any-return]


def _wrap_unshard(prov: Provenance, unit: int, group_index: int, group: Any
                  ) -> Callable[..., Any]:
    """``unshard`` recording issue/noop; the caller's frame is read only when recording."""
    rec = prov.rec
    earlier, cls = _earlier(group, "unshard"), type(group)
    issuer_of = prov.issuers.of
    num_bytes: list[int] = []  # filled at the first recorded call (after lazy init)

    def unshard(*args: Any, **kwargs: Any) -> Any:
        before = group._all_gather_result
        t_ns = time.monotonic_ns()
        # FSDP2 passes one argument (async_op); spelling that call out saves re-packing it.
        if earlier is not None:
            out = earlier(*args, **kwargs)
        elif len(args) == 1 and not kwargs:
            out = cls.unshard(group, args[0])
        else:
            out = cls.unshard(group, *args, **kwargs)
        if not rec.recording:
            return out
        try:
            if prov.should_record():
                phase = 1 if _graph_task_id() != -1 else 0
                kind, source = issuer_of(sys._getframe(1), unit, phase == 1)
                if before is None and group._all_gather_result is not None:
                    event, detail = ISSUE, -1
                elif before is not None:
                    event, detail = NOOP, PENDING
                else:
                    event = NOOP
                    detail = UNSHARDED if getattr(group, "is_unsharded", False) else SKIPPED
                if not num_bytes:
                    num_bytes.append(prov.bytes_of(group))
                prov.rows.append((rec.next_seq(), t_ns, rec.step, rec.micro_step, phase, unit,
                                  group_index, event, kind, source, num_bytes[0], detail))
        except Exception as error:
            rec.disable(f"all-gather provenance failed: {type(error).__name__}: {error}")
        return out

    return unshard


def unshard_code() -> Any:
    """The code object of the ``unshard`` wrapper, for readers of the stack to step over."""
    probe = _wrap_unshard.__code__.co_consts
    return next(c for c in probe if getattr(c, "co_name", None) == "unshard")


def _wrap_clear(prov: Provenance, unit: int, group_index: int, group: Any, name: str,
                event: int, detail: int) -> Callable[..., Any]:
    """A method that may clear ``_all_gather_result``: a consume (wait) or a drop.

    Most calls find nothing pending (``wait_for_unshard`` after a blocking gather, every
    ``_reset_iter_state``): those only read one attribute before calling through.
    """
    rec = prov.rec
    earlier, cls = _earlier(group, name), type(group)

    def cleared(*args: Any, **kwargs: Any) -> Any:
        pending = group._all_gather_result is not None
        t_ns = time.monotonic_ns() if pending else 0
        # FSDP2 passes no arguments; spelling that call out saves re-packing them.
        if earlier is not None:
            out = earlier(*args, **kwargs)
        elif not args and not kwargs:
            out = getattr(cls, name)(group)
        else:
            out = getattr(cls, name)(group, *args, **kwargs)
        if not pending:
            return out
        try:
            if group._all_gather_result is None and prov.should_record():
                phase = 1 if _graph_task_id() != -1 else 0
                prov.rows.append((rec.next_seq(), t_ns, rec.step, rec.micro_step, phase, unit,
                                  group_index, event, -1, -1, prov.bytes_of(group), detail))
        except Exception as error:
            rec.disable(f"all-gather provenance failed: {type(error).__name__}: {error}")
        return out

    return cleared


def _wrap_reshard(prov: Provenance, unit: int, group_index: int, group: Any
                  ) -> Callable[..., Any]:
    """``reshard`` recording when the group's unsharded parameters are freed.

    FSDP2 calls it after every unit forward and backward; with ``reshard_after_forward=False``
    the forward call keeps the parameters, and no row is written.
    """
    rec = prov.rec
    earlier, cls = _earlier(group, "reshard"), type(group)

    def reshard(*args: Any, **kwargs: Any) -> Any:
        unsharded = group.is_unsharded
        if earlier is not None:
            out = earlier(*args, **kwargs)
        elif not args and not kwargs:
            out = cls.reshard(group)
        else:
            out = cls.reshard(group, *args, **kwargs)
        if not unsharded or not rec.recording:
            return out
        try:
            if not group.is_unsharded and prov.should_record():
                phase = 1 if _graph_task_id() != -1 else 0
                prov.rows.append((rec.next_seq(), time.monotonic_ns(), rec.step,
                                  rec.micro_step, phase, unit, group_index, RESHARD, -1, -1,
                                  prov.bytes_of(group), -1))
        except Exception as error:
            rec.disable(f"all-gather provenance failed: {type(error).__name__}: {error}")
        return out

    return reshard


def _vocab(unit_names: list[str]) -> dict[str, Sequence[str]]:
    """Rows hold codes (-1 for none); these are the words they stand for."""
    return {"phase": schema.PHASES, "unit": unit_names, "event": EVENTS,
            "issuer_kind": ISSUER_KINDS, "issuer_unit": unit_names, "detail": DETAILS}
