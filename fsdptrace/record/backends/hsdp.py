"""HSDP backend: units are modules that carry an ``hsdp_scheduler`` (hyper_parallel).

Nothing here imports the framework; every read is a ``getattr`` with a default, and an
attribute the backend needs but does not find costs one warning and that piece of data, never
the job. Two layouts of pending all-gathers exist and both are read:

- hyper_parallel 0.1 keeps them per parameter: ``prefetch_handle`` (a ``dist.Work`` while an
  async all-gather is pending, None once waited) and ``all_gather_outputs`` (the gathered
  buffers, storage freed when the unit reshards);
- the newer layout the reference checker reads keeps fused buckets
  (``hsdp_state.param_group.all_gather_buckets[i].all_gather_result.handle``) and a
  per-parameter ``allgather_comm_ctx`` (``allgather_handle``, ``allgather_output``).

A layout is missing only when a unit has neither (one warning then). All-gather provenance
(who issued each gather, when it was consumed and freed) lives in ``hsdp_provenance``, the
collectives with their sequence numbers in ``hsdp_collectives``, and who issued a gather in
``hsdp_issuers``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from fsdptrace.record.backends import hsdp_collectives, hsdp_provenance
from fsdptrace.record.backends.base import (
    GradientPresence,
    InstanceAttributePatch,
    PendingAllGather,
    Unit,
    unit_name,
    untracked_name,
)
from fsdptrace.record.backends.fsdp2.grads import BACKWARD, grad_token, param_states
from fsdptrace.store import schema

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder

_CELLS_ATTR = {"forward": "forward_prefetch_cells", "backward": "backward_prefetch_cells"}
# (owner attribute or None for the parameter itself, attribute, grad_source), first hit wins.
_GRAD_SOURCES = (
    ("sharded_param", "grad", "sharded"),
    ("sharded_param", "main_grad", "main_grad"),
    (None, "_grad", "param_grad"),
    # A no-sync micro-step (reduce_grads=False) leaves the gradient on the unsharded parameter,
    # or in unsharded_accumulated_grad when the reduce dtype differs.
    ("_unsharded_param", "grad", "unsharded"),
    (None, "unsharded_accumulated_grad", "accumulated"),
    (None, "unsharded_accumulated_grad_data", "accumulated_data"),
)
# docs/checks.md's setting name -> (where, attribute) on the scheduler.
_SETTINGS = {
    "requires_gradient_sync": ("hsdp_state", "reduce_grads"),
    "requires_all_reduce": ("hsdp_state", "requires_all_reduce"),
    "is_last_backward": ("scheduler_ctx", "is_last_backward"),
    "reshard_after_forward": (None, "reshard_after_forward"),
    "reshard_after_backward": ("hsdp_state", "reshard_after_backward"),
}
_MISSING = object()
_graph_task_id = torch._C._current_graph_task_id


def has_hsdp_units(parts: Sequence[nn.Module]) -> bool:
    return any(getattr(m, "hsdp_scheduler", None) is not None
               for part in parts for m in part.modules())


def _original_type_name(module: nn.Module) -> str:
    """The user's class: ``fully_shard`` swaps in a dynamic ``HSDP<Name>`` subclass."""
    for cls in type(module).__mro__:
        if not any(base.__name__ == "HSDPModule" for base in cls.__mro__):
            return cls.__name__
    return type(module).__name__


class HSDPBackend:
    """Reads hyper_parallel's HSDP units (release 0.1 and the reference's newer layout)."""

    name = "hsdp"
    # Checkpoint recompute re-runs forward inside backward; its outputs' gradients are not
    # a unit's backward begin (the reference skips them too).
    watch_backward_in_recompute = False

    def __init__(self) -> None:
        self._name_by_module: dict[int, str] = {}
        self._params: dict[int, list[tuple[Any, str]]] = {}  # unit index -> (param, label)
        self._warned: set[str] = set()

    # ----------------------------------------------------------------- discovery
    def discover_units(self, parts: Sequence[nn.Module]) -> list[Unit]:
        units: list[Unit] = []
        for part_index, part in enumerate(parts):
            fqn_of = {id(m): fqn for fqn, m in part.named_modules()}
            for fqn, module in part.named_modules():
                scheduler = getattr(module, "hsdp_scheduler", None)
                if scheduler is None or id(module) in self._name_by_module:
                    continue
                name = unit_name(part_index, fqn, num_parts=len(parts))
                self._name_by_module[id(module)] = name
                unit = Unit(index=len(units), name=name, part=part_index, fqn=fqn,
                            modules=(module,), handle=scheduler, is_root=fqn == "",
                            module_type=_original_type_name(module))
                labelled = [(p, _param_label(p, i, fqn_of))
                            for i, p in enumerate(self._hsdp_params(unit))]
                self._params[unit.index] = labelled
                unit.param_names = [label for _, label in labelled]
                unit.num_param_elements = sum(_num_elements(p) for p, _ in labelled)
                units.append(unit)
        return units

    def _hsdp_params(self, unit: Unit) -> list[Any]:
        state = self._read(unit, unit.handle, "hsdp_state", "gradients and pending all-gathers")
        params = self._read(unit, state, "hsdp_params", "gradients and pending all-gathers")
        return list(params or ())

    # ----------------------------------------------------------------- prefetch edges
    def prefetch_targets(self, unit: Unit, phase: str) -> list[str]:
        cells = self._read(unit, unit.handle, _CELLS_ATTR[phase], f"{phase} prefetch edges")
        return [self._name_by_module.get(id(cell), untracked_name(cell)) for cell in cells or ()]

    def prefetch_key(self, units: Sequence[Unit]) -> list[tuple[Any, ...]] | None:
        """Every unit's raw cell lists, compared with ``==`` to skip resolving unchanged edges."""
        try:
            return [(u.handle.forward_prefetch_cells, u.handle.backward_prefetch_cells)
                    for u in units]
        except AttributeError:  # prefetch_targets warns once and records what it can
            return None

    @staticmethod
    def freeze_prefetch_key(key: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """A copy of ``key`` that later edits of the scheduler's lists cannot change."""
        return [tuple(list(cells or ()) for cells in lists) for lists in key]

    # ----------------------------------------------------------------- boundary reads
    def gradients(self, unit: Unit) -> list[GradientPresence]:
        rows = []
        for hsdp_param, label in self._params.get(unit.index, ()):
            has_grad, source = False, "none"
            for owner_attr, attr, grad_source in _GRAD_SOURCES:
                if owner_attr is None:
                    owner = hsdp_param
                elif owner_attr.startswith("_"):  # never run a property for a private read
                    owner = getattr(hsdp_param, "__dict__", {}).get(owner_attr)
                else:
                    owner = getattr(hsdp_param, owner_attr, None)
                if getattr(owner, attr, None) is not None:
                    has_grad, source = True, grad_source
                    break
            rows.append(GradientPresence(label, has_grad, source))
        return rows

    def all_gradients(self, units: Sequence[Unit]) -> list[list[GradientPresence]]:
        return [self.gradients(unit) for unit in units]

    def all_grad_tokens(self, units: Sequence[Unit]) -> list[list[object]]:
        return [self.grad_tokens(unit) for unit in units]

    def all_pending_all_gathers(self, units: Sequence[Unit]) -> list[list[PendingAllGather]]:
        return [self.pending_all_gathers(unit) for unit in units]

    def pending_all_gathers(self, unit: Unit) -> list[PendingAllGather]:
        """Issued all-gathers not consumed, from both layouts, and parameters left unsharded."""
        state = getattr(unit.handle, "hsdp_state", None)
        pending = _fused_buckets(state)
        per_param_layout = False
        for hsdp_param, label in self._params.get(unit.index, ()):
            details: list[str] = []
            if hasattr(hsdp_param, "prefetch_handle"):
                per_param_layout = True
                details += _release_param_state(hsdp_param, state)
            if hasattr(hsdp_param, "allgather_comm_ctx"):
                per_param_layout = True
                details += _comm_ctx_state(hsdp_param.allgather_comm_ctx)
            if details:
                pending.append(PendingAllGather("param", label, ", ".join(details)))
        if self._params.get(unit.index) and not per_param_layout and not _has_buckets(state):
            self._warn("prefetch_handle", unit,
                       "prefetch_handle (hyper_parallel 0.1), allgather_comm_ctx nor "
                       "param_group.all_gather_buckets (newer)", "pending all-gathers")
        if getattr(state, "is_shard", True) is False:
            pending.append(PendingAllGather("unit", "parameters", "unsharded-held"))
        return pending

    def settings(self, unit: Unit) -> dict[str, object]:
        """The unit's state that decides which collectives run (docs/checks.md's names).

        ``requires_gradient_sync`` is HSDP's ``reduce_grads``; ``mesh_shape`` is the device
        mesh's shape. A setting the framework does not have is None (and warns once).
        """
        scheduler = unit.handle
        values: dict[str, object] = {}
        for setting, (where, attr) in _SETTINGS.items():
            owner = scheduler if where is None else self._read(unit, scheduler, where,
                                                               "settings")
            values[setting] = self._read(unit, owner, attr, f"the {setting} setting")
        mesh = getattr(scheduler, "mesh", None)
        shape = getattr(mesh, "mesh_shape", None) or getattr(mesh, "shape", None)
        values["mesh_shape"] = tuple(int(n) for n in shape) if shape is not None else None
        return values

    def settings_row(self, unit: Unit) -> tuple[object, ...]:
        """``settings`` in ``schema.SETTING_NAMES`` order; HSDP has no
        ``reduce_scatter_unused_params`` (None: unused parameters are skipped on every rank)."""
        values = self.settings(unit)
        return tuple(values.get(name) for name in schema.SETTING_NAMES)

    @staticmethod
    def settings_key(units: Sequence[Unit]) -> None:
        return None  # read every unit's settings at each micro-step

    def grad_tokens(self, unit: Unit) -> list[object]:
        """hyper_parallel keeps gradients under FSDP2's names (``sharded_param.grad``,
        ``_unsharded_param.grad``, ``unsharded_accumulated_grad``); ``main_grad`` is not read."""
        return [grad_token(p) for p, _ in self._params.get(unit.index, ())]

    def install_backward_grads(self, rec: Recorder) -> list[InstanceAttributePatch]:
        """Wrap each unit's ``hsdp_state.post_backward`` (called from the unit's backward hook,
        before its reduce-scatter); HSDP calls it only for units that ran backward."""
        patches = []
        for unit in rec.units:
            state = getattr(unit.handle, "hsdp_state", None)
            if state is not None and callable(getattr(state, "post_backward", None)):
                params = [p for p, _ in self._params.get(unit.index, ())]
                patches.append(InstanceAttributePatch(state, {
                    "post_backward": _wrap_post_backward(rec, unit.index, state, params)}))
        return patches

    def is_recompute(self, unit: Unit) -> bool:
        # Recompute is a forward inside autograd's backward. The reference reads
        # scheduler_ctx.root_bp_state, which hyper_parallel 0.1 does not have (it keeps a
        # root_bp_state on the scheduler class); the graph task is the same on every release.
        return bool(_graph_task_id() != -1)

    def in_backward(self) -> bool:
        return bool(torch._C._current_graph_task_id() != -1)

    def install_provenance(self, rec: Recorder) -> list[InstanceAttributePatch]:
        """Wrappers on each unit's ``hsdp_state`` gathers (``hsdp_provenance``)."""
        return hsdp_provenance.install(rec)

    def install_collectives(self, rec: Recorder) -> list[InstanceAttributePatch]:
        """Wrappers on each sharded parameter's collectives (``hsdp_collectives``)."""
        return hsdp_collectives.install(rec)

    def patch_forward_methods(
        self, unit: Unit, on_pre: Any, on_post: Any
    ) -> InstanceAttributePatch | None:
        return None  # HSDP has no registered forward methods that bypass module hooks

    # ----------------------------------------------------------------- defensive reads
    def _read(self, unit: Unit, owner: Any, attr: str, what: str) -> Any:
        """``owner.attr``, or None after one warning per attribute name (never for a missing
        owner: its own warning already said what is lost)."""
        if owner is None:
            return None
        value = getattr(owner, attr, _MISSING)
        if value is _MISSING:
            self._warn(attr, unit, attr, what)
            return None
        return value

    def _warn(self, key: str, unit: Unit, missing: str, what: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(f"fsdptrace: HSDP unit {unit.name} has no {missing}, so {what} cannot "
                      "be recorded (a hyper_parallel release that keeps them elsewhere?); "
                      "training goes on", RuntimeWarning, stacklevel=3)


def _wrap_post_backward(rec: Recorder, unit: int, state: Any, params: list[Any]) -> Any:
    original = state.post_backward
    kept: list[tuple[int, int, int] | None] = [None] * len(params)

    def post_backward(*args: Any) -> Any:
        if rec.recording:
            try:
                reduce = bool(getattr(state, "reduce_grads", True))
                rec.record_backward_grads(unit, 0, param_states(params, kept, rec.step, reduce,
                                                                False), BACKWARD)
            except Exception as error:
                rec.disable(f"backward gradients failed: {type(error).__name__}: {error}")
        return original(*args)

    return post_backward


def _param_label(hsdp_param: Any, index: int, fqn_of: dict[int, str]) -> str:
    """The parameter's FQN in its part: ``_param_fqn`` when set, else from its module info.

    hyper_parallel 0.1 leaves ``_param_fqn`` None and keeps (module, param_name) instead.
    """
    fqn = getattr(hsdp_param, "_param_fqn", None)
    if fqn:
        return str(fqn)
    info = getattr(hsdp_param, "_module_info", None)
    module_fqn = fqn_of.get(id(getattr(info, "module", None)))
    param_name = getattr(info, "param_name", None)
    if module_fqn is not None and param_name:
        return f"{module_fqn}.{param_name}" if module_fqn else str(param_name)
    return f"param[{index}]"


def _num_elements(hsdp_param: Any) -> int:
    size = getattr(hsdp_param, "_orig_size", None)
    return int(torch.Size(size).numel()) if size is not None else 0


def _has_buckets(state: Any) -> bool:
    return getattr(getattr(state, "param_group", None), "all_gather_buckets", None) is not None


def _fused_buckets(state: Any) -> list[PendingAllGather]:
    group = getattr(state, "param_group", None)
    pending = []
    for index, bucket in enumerate(getattr(group, "all_gather_buckets", ()) or ()):
        result = getattr(bucket, "all_gather_result", None)
        if result is not None:
            status = ("handle=set" if getattr(result, "handle", None) is not None
                      else "completed-not-consumed")
            pending.append(PendingAllGather("fused_bucket", f"fused_bucket[{index}]", status))
    return pending


def _release_param_state(hsdp_param: Any, state: Any) -> list[str]:
    """hyper_parallel 0.1: a handle still set, or gathered buffers the unit never waited for.

    ``wait_for_unshard`` clears the handle and marks the state unsharded; until then
    (``is_shard`` still True) allocated ``all_gather_outputs`` are an unconsumed gather.
    """
    details = []
    if getattr(hsdp_param, "prefetch_handle", None) is not None:
        details.append("handle=set")
    if getattr(state, "is_shard", False) is True and any(
            _holds_storage(t) for t in getattr(hsdp_param, "all_gather_outputs", ()) or ()):
        details.append("output=not-consumed")
    return details


def _comm_ctx_state(ctx: Any) -> list[str]:
    details = []
    if getattr(ctx, "allgather_handle", None) is not None:
        details.append("handle=set")
    if getattr(ctx, "allgather_output", None) is not None:
        details.append("output=not-consumed")
    return details


def _holds_storage(tensor: Any) -> bool:
    try:
        return bool(tensor.untyped_storage().size() > 0)
    except (AttributeError, RuntimeError):
        return False
