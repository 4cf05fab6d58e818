"""The hooks the recorder puts on model parts and units.

Hook order matters: FSDP registers its forward pre-hook with ``prepend=True`` at
``fully_shard`` time; ours are registered later, also prepended, so they run before FSDP's
unshard, and the part-root hook (registered last) runs before the root unit's own hook.
Our forward hook is prepended too, so the output gradient hook it adds fires before FSDP's
``_pre_backward`` all-gathers: a rank blocked in a collective has already recorded its entry.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

from fsdptrace.record import guards

if TYPE_CHECKING:
    from fsdptrace.record.backends.base import RecorderView as Recorder  # recorder.py imports us


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    return [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _make_unit_pre(rec: Recorder, unit: Any) -> Callable[..., None]:
    index = unit.index
    is_recompute = rec.backend.is_recompute

    def unit_forward_pre_hook(module: Any, args: Any) -> None:
        try:
            if rec.recording:
                if rec.in_eval:
                    rec.record_eval(index)
                # Recompute re-enters forward during backward; it is not forward order.
                elif not is_recompute(unit):
                    rec.record_unit(index, 0)
        except Exception as error:
            rec.disable(f"forward pre-hook failed: {type(error).__name__}: {error}")

    return unit_forward_pre_hook


def _make_unit_post(rec: Recorder, unit: Any) -> Callable[..., None]:
    index = unit.index
    skip_in_recompute = not rec.backend.watch_backward_in_recompute
    is_recompute = rec.backend.is_recompute

    def unit_forward_hook(module: Any, args: Any, output: Any) -> None:
        try:
            if skip_in_recompute and is_recompute(unit):
                return
            if rec.recording and not rec.in_eval:
                # Registered during reentrant recompute too: there the recomputed outputs
                # are the ones whose gradients fire.
                _watch_backward_begin(rec, index, _grad_tensors(output))
        except Exception as error:
            rec.disable(f"forward hook failed: {type(error).__name__}: {error}")

    return unit_forward_hook


def _watch_backward_begin(rec: Recorder, index: int, tensors: list[torch.Tensor]) -> None:
    """Record the unit's backward begin at the first gradient reaching any of its outputs.

    The hooks stay on the tensors after firing (a ``fired`` check costs less than removing
    each handle, and the tensors die with the graph); a second backward through a retained
    graph is not recorded again, as before.
    """
    if not tensors:
        return
    fired = [False]

    def on_first_grad(grad: torch.Tensor) -> None:
        if fired[0]:
            return
        fired[0] = True
        try:
            if rec.recording:
                rec.record_unit(index, 1)
        except Exception as error:
            rec.disable(f"backward hook failed: {type(error).__name__}: {error}")

    for tensor in tensors:
        _add_grad_hook(tensor, on_first_grad)


# Our keys in a tensor's hook dict: negative, so never one of RemovableHandle's ids.
_hook_keys = itertools.count(-1, -1)


def _add_grad_hook(tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """``tensor.register_hook(hook)`` without building the ``RemovableHandle`` we never use.

    This runs for every unit output every micro-step, and the handle (a weakref, a class-wide
    id) is most of ``register_hook``'s cost: measured 2-4 µs of the ~5 µs. The hook goes into
    the same dict at the same place, so it fires exactly where ``register_hook``'s would
    (before FSDP's ``_pre_backward``, see above). A subclass (which may route
    ``register_hook`` through ``__torch_function__``) or a leaf takes the public call.
    """
    hooks = tensor._backward_hooks
    if hooks is None:
        grad_fn = tensor.grad_fn
        if type(tensor) is not torch.Tensor or grad_fn is None:
            tensor.register_hook(hook)
            return
        tensor._backward_hooks = hooks = OrderedDict()
        grad_fn._register_hook_dict(tensor)
    elif type(tensor) is not torch.Tensor:
        tensor.register_hook(hook)
        return
    hooks[next(_hook_keys)] = hook


def _make_part_pre(rec: Recorder, part: int) -> Callable[..., None]:
    in_backward = rec.backend.in_backward

    def part_forward_pre_hook(module: Any, args: Any) -> None:
        try:
            if not in_backward():
                rec.on_part_forward(part)
        except Exception as error:
            rec.disable(f"part pre-hook failed: {type(error).__name__}: {error}")

    return part_forward_pre_hook


def install(rec: Recorder) -> list[Any]:
    """Register every hook; returns handles whose ``remove()`` undoes them."""
    handles: list[Any] = []
    for unit in rec.units:
        pre = _make_unit_pre(rec, unit)
        post = _make_unit_post(rec, unit)
        for module in unit.modules:
            handles.append(module.register_forward_pre_hook(pre, prepend=True))
            handles.append(module.register_forward_hook(post, prepend=True))
        handles.append(_patch_methods(rec, unit, pre, post))
    for part_index, part in enumerate(rec.parts):
        handles.append(part.register_forward_pre_hook(_make_part_pre(rec, part_index),
                                                      prepend=True))
    handles.extend(_install_provenance(rec))
    handles.extend(_install_backward_grads(rec))
    handles.extend(_install_collectives(rec))
    handles.extend(_install_endings(rec))
    return [h for h in handles if h is not None]


def _install_provenance(rec: Recorder) -> list[Any]:
    try:
        return rec.backend.install_provenance(rec)
    except Exception as error:
        rec.disable(f"cannot record all-gather provenance: {error}")
        return []


def _install_collectives(rec: Recorder) -> list[Any]:
    try:
        return list(rec.backend.install_collectives(rec))
    except Exception as error:
        rec.disable(f"cannot record collectives: {error}")
        return []


def _install_backward_grads(rec: Recorder) -> list[Any]:
    try:
        return rec.backend.install_backward_grads(rec)
    except Exception as error:
        rec.disable(f"cannot record gradients per unit backward: {error}")
        return []


def _patch_methods(rec: Recorder, unit: Any, pre: Callable, post: Callable) -> Any:
    in_backward = rec.backend.in_backward

    def on_pre(module: Any) -> None:
        if unit.is_root and not in_backward():
            rec.on_part_forward(unit.part)
        pre(module, ())

    def on_post(module: Any, output: Any) -> None:
        post(module, (), output)

    try:
        return rec.backend.patch_forward_methods(unit, on_pre, on_post)
    except Exception as error:
        rec.disable(f"cannot watch registered forward methods: {error}")
        return None


class _ResetPatch:
    """``reset_iter_state`` wrapped on a root unit's instance; ``remove()`` unwraps it."""

    def __init__(self, rec: Recorder, module: Any) -> None:
        self.module = module
        original = module.reset_iter_state

        def reset_iter_state() -> None:
            try:
                rec.abort_micro_step()
            except Exception as error:
                rec.disable(f"reset_iter_state hook failed: {type(error).__name__}: {error}")
            original()

        module.reset_iter_state = reset_iter_state

    def remove(self) -> None:
        self.module.__dict__.pop("reset_iter_state", None)


def _install_endings(rec: Recorder) -> list[Any]:
    """What the endings need on the model: the exception stash and ``reset_iter_state``."""
    handles: list[Any] = [part.register_forward_hook(guards.stash_forward_exception(rec),
                                                     always_call=True) for part in rec.parts]
    for unit in rec.units:
        root = unit.modules[0] if unit.is_root and unit.modules else None
        if root is not None and callable(getattr(root, "reset_iter_state", None)):
            handles.append(_ResetPatch(rec, root))
    return handles
