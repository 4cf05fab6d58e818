"""HSDP backend: units are modules that carry an ``hsdp_scheduler``.

The HSDP framework is duck-typed from the outside (see the reference checker in
``shared/reference``): prefetch targets are ``forward_prefetch_cells`` /
``backward_prefetch_cells`` (modules), pending all-gathers live in fused buckets and in
per-parameter communication contexts, and gradients may sit in several places. Nothing here
imports the framework; every read is a ``getattr`` with a default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from fsdptrace.record.backends.base import (
    GradientPresence,
    InstanceAttributePatch,
    PendingAllGather,
    Unit,
    unit_name,
    untracked_name,
)

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder

_CELLS_ATTR = {"forward": "forward_prefetch_cells", "backward": "backward_prefetch_cells"}
_GRAD_SOURCES = (
    ("sharded_param", "grad", "sharded"),
    ("sharded_param", "main_grad", "main_grad"),
    (None, "_grad", "param_grad"),
    (None, "unsharded_accumulated_grad", "accumulated"),
    (None, "unsharded_accumulated_grad_data", "accumulated_data"),
)


def has_hsdp_units(parts: Sequence[nn.Module]) -> bool:
    return any(getattr(m, "hsdp_scheduler", None) is not None
               for part in parts for m in part.modules())


def _hsdp_params(unit: Unit) -> list[Any]:
    state = getattr(unit.handle, "hsdp_state", None)
    return list(getattr(state, "hsdp_params", ()) or ())


def _param_label(hsdp_param: Any, index: int) -> str:
    return getattr(hsdp_param, "_param_fqn", None) or f"param[{index}]"


class HSDPBackend:
    """Reads the reference's duck-typed HSDP interface."""

    name = "hsdp"
    watch_backward_in_recompute = False

    def __init__(self) -> None:
        self._name_by_module: dict[int, str] = {}

    def discover_units(self, parts: Sequence[nn.Module]) -> list[Unit]:
        units: list[Unit] = []
        for part_index, part in enumerate(parts):
            for fqn, module in part.named_modules():
                scheduler = getattr(module, "hsdp_scheduler", None)
                if scheduler is None or id(module) in self._name_by_module:
                    continue
                name = unit_name(part_index, fqn, num_parts=len(parts))
                self._name_by_module[id(module)] = name
                unit = Unit(index=len(units), name=name, part=part_index, fqn=fqn,
                            modules=(module,), handle=scheduler, is_root=fqn == "",
                            module_type=type(module).__name__)
                params = _hsdp_params(unit)
                unit.param_names = [_param_label(p, i) for i, p in enumerate(params)]
                units.append(unit)
        return units

    def prefetch_targets(self, unit: Unit, phase: str) -> list[str]:
        cells = getattr(unit.handle, _CELLS_ATTR[phase], ()) or ()
        return [self._name_by_module.get(id(cell), untracked_name(cell)) for cell in cells]

    def prefetch_key(self, units: Sequence[Unit]) -> None:
        return None  # cells are resolved to names at every check

    def freeze_prefetch_key(self, key: Any) -> Any:
        return key

    def gradients(self, unit: Unit) -> list[GradientPresence]:
        rows = []
        for index, hsdp_param in enumerate(_hsdp_params(unit)):
            has_grad, source = False, "none"
            for owner_attr, attr, label in _GRAD_SOURCES:
                owner = getattr(hsdp_param, owner_attr, None) if owner_attr else hsdp_param
                if getattr(owner, attr, None) is not None:
                    has_grad, source = True, label
                    break
            rows.append(GradientPresence(_param_label(hsdp_param, index), has_grad, source))
        return rows

    def pending_all_gathers(self, unit: Unit) -> list[PendingAllGather]:
        state = getattr(unit.handle, "hsdp_state", None)
        pending = []
        group = getattr(state, "param_group", None)
        for index, bucket in enumerate(getattr(group, "all_gather_buckets", ()) or ()):
            result = getattr(bucket, "all_gather_result", None)
            if result is not None:
                handle = getattr(result, "handle", None)
                status = "handle=set" if handle is not None else "completed-not-consumed"
                pending.append(PendingAllGather("fused_bucket", f"fused_bucket[{index}]", status))
        for index, hsdp_param in enumerate(_hsdp_params(unit)):
            ctx = getattr(hsdp_param, "allgather_comm_ctx", None)
            details = []
            if getattr(ctx, "allgather_handle", None) is not None:
                details.append("handle=set")
            if getattr(ctx, "allgather_output", None) is not None:
                details.append("output=not-consumed")
            if details:
                pending.append(PendingAllGather("param", _param_label(hsdp_param, index),
                                                ", ".join(details)))
        return pending

    def is_recompute(self, unit: Unit) -> bool:
        ctx = getattr(unit.handle, "scheduler_ctx", None)
        return bool(getattr(ctx, "root_bp_state", False))

    def in_backward(self) -> bool:
        return bool(torch._C._current_graph_task_id() != -1)

    def install_provenance(self, rec: Recorder) -> list[InstanceAttributePatch]:
        return []  # no all-gather provenance for HSDP yet

    def patch_forward_methods(
        self, unit: Unit, on_pre: Any, on_post: Any
    ) -> InstanceAttributePatch | None:
        return None
