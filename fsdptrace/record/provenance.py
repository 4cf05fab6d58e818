"""All-gather provenance (FSDP2): who issued each parameter group's all-gather, who used it.

Checks 8 and 9 need more than the boundary snapshot of check 3: a prefetch whose result waits
into backward, or one FSDP2 silently turns into a no-op, leaves nothing behind at
``optimizer.step()``. So each ``FSDPParamGroup`` *instance* gets wrappers on ``unshard``,
``wait_for_unshard``, ``finalize_backward`` and ``_reset_iter_state`` (instance attributes:
other groups, other models and the class stay untouched, and ``close`` removes them). A wrapper
calls FSDP's own method unchanged and only compares ``_all_gather_result`` before and after:
None -> set is an ``issue``, set -> None in a wait is a ``consume``, in the end-of-backward
paths a ``drop``; an ``unshard`` that changes nothing is a ``noop``.

The issuer is read from the caller's frame, not from flags we would have to keep in sync with
FSDP's control flow: ``pre_forward``/``pre_backward`` of the group itself is ``own``,
``FSDPParamGroup._prefetch_unshard`` called from a state's ``_pre_forward``/``_pre_backward`` is
an explicit ``prefetch`` (the source is that state), called from a group's
``_backward_prefetch`` it is FSDP2's ``implicit`` reverse-post-forward prefetch, and
``FSDPModule.unshard`` is ``manual``. Frames are classified once per code object. A gather
reached through the forward path while autograd runs backward is activation-checkpoint
recompute (``recompute``): FSDP2 re-runs the unit's pre-forward, forward prefetch included,
and CHECKS.md keeps recompute out of forward findings.

Rows are tuples of small ints appended to a deque, like the recorder's events.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch

from fsdptrace import schema
from fsdptrace.record.backends.base import InstanceAttributePatch
from fsdptrace.record.backends.fsdp2 import param_groups
from fsdptrace.record.writer import int_column, yield_gil

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder

TABLE = "allgathers"
EVENTS = ("issue", "consume", "drop", "noop")
ISSUE, CONSUME, DROP, NOOP = range(4)
ISSUER_KINDS = ("own", "prefetch", "implicit", "manual", "other", "recompute")
OWN, PREFETCH, IMPLICIT, MANUAL, OTHER, RECOMPUTE = range(6)
DETAILS = ("pending", "unsharded", "skipped", "finalize_backward", "reset_iter_state")
PENDING, UNSHARDED, SKIPPED, FINALIZE, RESET = range(5)

_graph_task_id = torch._C._current_graph_task_id
_PREFETCH_FRAME = -1  # ``_prefetch_unshard``: the issuer is one frame further out
_FORWARD_OWN = -2  # the unit's own pre-forward: recompute when it runs inside backward

# (file, function) of FSDP2's callers of ``FSDPParamGroup.unshard``.
_CALLERS: dict[tuple[str, str], int] = {
    ("_fsdp_param_group.py", "pre_forward"): _FORWARD_OWN,
    ("_fsdp_param_group.py", "pre_backward"): OWN,
    ("_fsdp_state.py", "_pre_forward"): _FORWARD_OWN,  # recompute re-gathers its own
    ("_fsdp_param_group.py", "_prefetch_unshard"): _PREFETCH_FRAME,
    ("_fully_shard.py", "unshard"): MANUAL,
}


def _caller_kind(code: CodeType, cache: dict[CodeType, int]) -> int:
    kind = cache.get(code)
    if kind is None:
        kind = _CALLERS.get((os.path.basename(code.co_filename), code.co_name), OTHER)
        cache[code] = kind
    return kind


class Provenance:
    """Turns wrapped-method calls into ``allgathers`` rows for one recorder."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.rows = rec.writer.buffer(TABLE, _columns(rec.unit_names))
        self.unit_of: dict[int, int] = {}  # id(state) or id(group) -> unit index
        self.num_bytes: dict[int, int] = {}  # id(group) -> unsharded bytes, computed lazily
        self._codes: dict[CodeType, int] = {}

    def should_record(self) -> bool:
        rec = self.rec
        # Eval/generation forwards run with gradients off and are never recorded.
        return rec._recording and not (rec._in_eval and not torch.is_grad_enabled())

    def issuer(self, frame: FrameType | None, unit: int, backward: bool) -> tuple[int, int]:
        """(issuer kind, issuer unit index or -1) for an ``unshard`` called from ``frame``."""
        if frame is None:
            return OTHER, -1
        kind = _caller_kind(frame.f_code, self._codes)
        if kind == _FORWARD_OWN:
            return (RECOMPUTE if backward else OWN), unit
        if kind == OWN:
            return OWN, unit
        if kind != _PREFETCH_FRAME:
            return kind, -1
        outer = frame.f_back
        if outer is None:
            return OTHER, -1
        source = outer.f_locals.get("self")
        source_unit = self.unit_of.get(id(source), -1)
        if outer.f_code.co_name == "_backward_prefetch":
            return IMPLICIT, source_unit
        if outer.f_code.co_name == "_pre_forward":
            return (RECOMPUTE if backward else PREFETCH), source_unit
        if outer.f_code.co_name == "_pre_backward":
            return PREFETCH, source_unit
        return OTHER, source_unit

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
    """Wrap every parameter group of every unit; returns patches whose ``remove()`` undoes them.

    Only the FSDP2 backend keeps ``FSDPParamGroup``s; other backends get nothing.
    """
    if rec.backend.name != "fsdp2":
        return []
    prov = Provenance(rec)
    groups = []
    for unit in rec.units:
        prov.unit_of[id(unit.handle)] = unit.index
        for group_index, group in enumerate(param_groups(unit.handle)):
            prov.unit_of[id(group)] = unit.index
            groups.append((unit.index, group_index, group))
    return [_wrap_group(prov, *entry) for entry in groups]


def _wrap_group(prov: Provenance, unit: int, group_index: int, group: Any
                ) -> InstanceAttributePatch:
    names = ("unshard", "wait_for_unshard", "finalize_backward", "_reset_iter_state")
    originals = {name: getattr(group, name) for name in names}
    group.unshard = _wrap_unshard(prov, unit, group_index, group, originals["unshard"])
    group.wait_for_unshard = _wrap_clear(prov, unit, group_index, group,
                                         originals["wait_for_unshard"], CONSUME, -1)
    group.finalize_backward = _wrap_clear(prov, unit, group_index, group,
                                          originals["finalize_backward"], DROP, FINALIZE)
    group._reset_iter_state = _wrap_clear(prov, unit, group_index, group,
                                          originals["_reset_iter_state"], DROP, RESET)
    return InstanceAttributePatch(group, names)


def _wrap_unshard(prov: Provenance, unit: int, group_index: int, group: Any,
                  original: Callable[..., Any]) -> Callable[..., Any]:
    """``unshard`` recording issue/noop; the caller's frame is read only when recording."""
    rec = prov.rec
    num_bytes: list[int] = []  # filled at the first recorded call (after lazy init)

    def unshard(*args: Any, **kwargs: Any) -> Any:
        before = group._all_gather_result
        t_ns = time.monotonic_ns()
        out = original(*args, **kwargs)
        if not rec._recording:
            return out
        try:
            if prov.should_record():
                phase = 1 if _graph_task_id() != -1 else 0
                kind, source = prov.issuer(sys._getframe(1), unit, phase == 1)
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


def _wrap_clear(prov: Provenance, unit: int, group_index: int, group: Any,
                original: Callable[..., Any], event: int, detail: int) -> Callable[..., Any]:
    """A method that may clear ``_all_gather_result``: a consume (wait) or a drop.

    Most calls find nothing pending (``wait_for_unshard`` after a blocking gather, every
    ``_reset_iter_state``): those only read one attribute before calling through.
    """
    rec = prov.rec

    def cleared(*args: Any, **kwargs: Any) -> Any:
        if group._all_gather_result is None:
            return original(*args, **kwargs)
        t_ns = time.monotonic_ns()
        out = original(*args, **kwargs)
        try:
            if group._all_gather_result is None and prov.should_record():
                phase = 1 if _graph_task_id() != -1 else 0
                prov.rows.append((rec.next_seq(), t_ns, rec.step, rec.micro_step, phase, unit,
                                  group_index, event, -1, -1, prov.bytes_of(group), detail))
        except Exception as error:
            rec.disable(f"all-gather provenance failed: {type(error).__name__}: {error}")
        return out

    return cleared


def _columns(unit_names: list[str]) -> Callable[[list[tuple]], dict[str, Any]]:
    """Rows hold codes; the writer thread turns them into dictionary arrays."""
    dictionaries = {
        "phase": pa.array(list(schema.PHASES), pa.string()),
        "unit": pa.array(unit_names, pa.string()),
        "event": pa.array(list(EVENTS), pa.string()),
        "issuer_kind": pa.array(list(ISSUER_KINDS), pa.string()),
        "issuer_unit": pa.array(unit_names, pa.string()),
        "detail": pa.array(list(DETAILS), pa.string()),
    }
    names = schema.ALLGATHERS.names
    ints: dict[str, type[np.integer]] = {
        "seq": np.int64, "t_ns": np.int64, "step": np.int32, "micro_step": np.int32,
        "group": np.int32, "num_bytes": np.int64,
    }

    def to_columns(rows: list[tuple]) -> dict[str, Any]:
        columns = dict(zip(names, zip(*rows, strict=True), strict=True))
        out: dict[str, Any] = {}
        # Twelve columns of a few thousand rows hold the GIL ~0.5 ms: hand it over between
        # columns, so a training hook waits for one column, not the table (see writer).
        for name, dtype in ints.items():
            yield_gil()
            out[name] = int_column(columns[name], dtype)
        for name, values in dictionaries.items():
            yield_gil()
            codes = int_column(columns[name], np.int32)
            # -1 is "none" (no issuer unit, no detail): a null in the dictionary column.
            out[name] = pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), values)
        return out

    return to_columns
