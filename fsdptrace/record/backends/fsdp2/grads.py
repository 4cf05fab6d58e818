"""What each FSDP2 unit's backward produced, read before its reduce-scatter; and its settings.

``FSDPParamGroup.post_backward`` is where FSDP2 decides what to reduce-scatter: it runs once per
group per backward, from the autograd hook on the unit's inputs or, for a group that did not
run backward, from the root's end-of-backward callback (training state still ``IDLE``). Each
group *instance* gets a wrapper (like ``provenance``) that reads, before calling through, the
state ``post_backward`` is about to read:

- ``_unsharded_param.grad``: a gradient of this backward, or one kept from an earlier no-sync
  micro-step (``set_requires_gradient_sync(False)`` leaves it there and autograd accumulates in
  place, bumping its ``_version``). The wrapper remembers (step, id, ``_version``) of each kept
  gradient, so an unchanged one is ``carried``, a changed or new one ``received``;
- ``unsharded_accumulated_grad``: kept in the reduce dtype from an earlier no-sync micro-step;
- ``reduce_scatter_unused_params``: FSDP2 then reduce-scatters zeros for the missing ones.

Nothing is called that FSDP2 would not call, and no tensor is kept alive (ids and versions
only). Costs about 0.3 µs per parameter per unit backward (``docs/recorded_for_checks.md``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fsdptrace.record.backends.base import InstanceAttributePatch
from fsdptrace.record.backends.fsdp2.state import param_groups
from fsdptrace.store import schema

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder

RECEIVED, CARRIED, ZERO_FILLED, NONE = range(len(schema.GRAD_STATES))
BACKWARD, IDLE, UNKNOWN = range(len(schema.GRAD_VIAS))

# The group attributes behind FSDP2's setters, read in one C-level call.
group_settings = operator.attrgetter("reduce_grads", "all_reduce_grads",
                                      "post_forward_mesh_info", "mesh_info",
                                      "reshard_after_backward", "reduce_scatter_unused_params")


# Told, around each group's post-backward, whether the group may now keep unsharded or
# accumulated gradients: (group, may_keep). See ``grad_reads.KeptObjects.note``.
OnKept = Callable[[Any, bool], None]


def install(rec: Recorder, on_kept: OnKept | None = None) -> list[InstanceAttributePatch]:
    """Wrap ``post_backward`` of every parameter group of every unit."""
    patches = []
    for unit in rec.units:
        first = 0
        for group in param_groups(unit.handle):
            patches.append(InstanceAttributePatch(group, {
                "post_backward": _wrap_post_backward(rec, unit.index, first, group, on_kept)}))
            first += len(getattr(group, "fsdp_params", ()))
    return patches


def _wrap_post_backward(rec: Recorder, unit: int, first: int, group: Any,
                        on_kept: OnKept | None) -> Callable[..., Any]:
    earlier, cls = group.__dict__.get("post_backward"), type(group)
    fsdp_params = list(getattr(group, "fsdp_params", ()))
    kept: list[tuple[int, int, int] | None] = [None] * len(fsdp_params)

    def post_backward(*args: Any) -> Any:
        if rec.recording:
            try:
                reduce = bool(group.reduce_grads)
                states = param_states(fsdp_params, kept, rec.step, reduce,
                                 reduce and bool(group.reduce_scatter_unused_params))
                via = IDLE if getattr(group._training_state, "name", "") == "IDLE" else BACKWARD
                rec.record_backward_grads(unit, first, states, via)
            except Exception as error:
                rec.disable(f"backward gradients failed: {type(error).__name__}: {error}")
        if on_kept is None:
            return earlier(*args) if earlier is not None else cls.post_backward(group, *args)
        on_kept(group, True)  # until it has returned (it may raise)
        result = earlier(*args) if earlier is not None else cls.post_backward(group, *args)
        on_kept(group, not clears_kept(group))
        return result

    return post_backward


def clears_kept(group: Any) -> bool:
    """Whether a post-backward of ``group`` that returned left no unsharded or accumulated
    gradient: a reducing one hands them all to the reduce-scatter and sets them to None
    (torch 2.13 ``FSDPParamGroup.post_backward``), and a resharding one leaves the sharded
    parameters on the modules, so no later autograd pass can write an unsharded gradient
    without FSDP2's hooks (and so this wrapper) running again."""
    return (getattr(group, "reduce_grads", None) is True
            and getattr(group, "reshard_after_backward", None) is True)


def param_states(fsdp_params: list[Any], kept: list[tuple[int, int, int] | None], step: int,
            reduce: bool, zero_fill: bool) -> list[int]:
    """Each parameter's state code; updates ``kept`` with gradients FSDP will keep.

    HSDP's parameters keep their gradients under the same names, so its backend uses this too.
    """
    states = []
    for index, fsdp_param in enumerate(fsdp_params):
        unsharded = fsdp_param.__dict__.get("_unsharded_param")
        grad = unsharded.grad if unsharded is not None else None
        if grad is not None:
            token = (step, id(grad), grad._version)
            states.append(CARRIED if kept[index] == token else RECEIVED)
            # A reducing backward hands the gradient to the reduce-scatter and clears it.
            kept[index] = None if reduce else token
        elif getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
            states.append(CARRIED)
        elif zero_fill and unsharded is not None and unsharded.requires_grad:
            states.append(ZERO_FILLED)
        else:
            states.append(NONE)
    return states


def grad_token(fsdp_param: Any) -> object:
    """Changes whenever any gradient of the parameter is written or replaced; None if none.

    A DTensor gradient needs two versions: ``zero_grad`` bumps the wrapper's, FSDP2's
    reduce-scatter accumulation (``grad._local_tensor += ...``) only the local tensor's.
    """
    sharded = getattr(getattr(fsdp_param, "sharded_param", None), "grad", None)
    unsharded = fsdp_param.__dict__.get("_unsharded_param")
    kept = unsharded.grad if unsharded is not None else None
    accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
    if kept is None and accumulated is None:  # between steps, the common case: one gradient
        return token_of(sharded)
    return token_of(sharded), token_of(kept), token_of(accumulated)


def token_of(grad: Any) -> tuple[int, int, int] | None:
    """One gradient's part of a token: its id and versions (wrapper and local tensor)."""
    if grad is None:
        return None
    local = getattr(grad, "_local_tensor", None)
    return id(grad), grad._version, -1 if local is None else local._version


def settings_row(state: Any, mesh_shapes: dict[int, tuple[int, ...] | None]
                 ) -> tuple[object, ...]:
    """``schema.SETTING_NAMES`` of one FSDP2 state (its first group: the setters set all)."""
    context = getattr(state, "_state_ctx", None)
    is_last = getattr(context, "is_last_backward", None)
    groups = param_groups(state)
    if not groups:
        return (None, None, is_last, None, None, None, None)
    sync, all_reduce, post_mesh, mesh_info, after_backward, unused = group_settings(groups[0])
    return (sync, all_reduce, is_last, _after_forward(post_mesh, mesh_info),
            after_backward, unused, _mesh_shape(mesh_info, mesh_shapes))


def _after_forward(post_mesh: Any, mesh_info: Any) -> bool | int:
    """FSDP2 keeps ``reshard_after_forward`` as a mesh: none (False), the unit's (True), or a
    smaller one whose shard size is the int the user passed."""
    if post_mesh is None:
        return False
    if post_mesh is mesh_info or post_mesh == mesh_info:
        return True
    size = getattr(post_mesh, "shard_mesh_size", None)
    return int(size) if size is not None else True


def _mesh_shape(mesh_info: Any, cache: dict[int, tuple[int, ...] | None]
                ) -> tuple[int, ...] | None:
    mesh = getattr(mesh_info, "mesh", None)
    key = id(mesh)
    if key not in cache:
        shape = getattr(mesh, "shape", None)
        cache[key] = tuple(int(n) for n in shape) if shape is not None else None
    return cache[key]

