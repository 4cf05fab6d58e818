"""Gradient presence and tokens of a unit's FSDP2 parameters, read in bulk at the boundaries.

Checks 2 and 10 read every managed parameter's gradient twice a step (the baseline at the
first micro-step, the boundary before ``optimizer.step()``). Read one attribute at a time, a
parameter cost ~5 µs a step: ``DTensor.grad`` and ``DTensor._version`` each go through torch's
``__torch_function__`` check (~0.5 µs), and ``sharded_param.grad`` was read three times. Here:

- each gradient is read once per snapshot, by ``operator.attrgetter`` mapped over the unit's
  parameters (a C loop), under ``DisableTorchFunctionSubclass``: every class that
  could answer (``DTensor``, ``nn.Parameter``) has the disabled ``__torch_function__`` anyway, so
  the same gradient comes back, without the per-call dispatch check;
- the ``FSDPParam`` objects are those ``FSDP2Backend._params_of`` already caches; the
  ``sharded_param`` behind each is read again every time (``reset_sharded_param`` replaces it);
- a token is built only where a gradient exists (most parameters hold none at a step's start).

- at 256 units the reads cost more in cache misses than in instructions (~1 µs a parameter
  after a backward, ~0.3 µs warm): the ``FSDPParam`` objects are the first misses, so
  ``ParamObjects`` keeps the parameter objects behind them in one list, read once. FSDP2
  replaces ``sharded_param`` only in ``reset_sharded_param`` (lazy init, ``_apply``,
  ``load_state_dict``), which ``KeptObjects.watch`` wraps to drop the lists, and creates
  ``_unsharded_param`` once, at the first all-gather.

The answers are those of ``grads.grad_token`` and ``units._grad_source``, value for value
(``tests/test_recorded_for_checks.py`` and ``tests/test_grad_reads.py`` compare them on real
jobs).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import torch

from fsdptrace.record.backends.base import InstanceAttributePatch
from fsdptrace.record.backends.fsdp2.grads import grad_token, token_of

_sharded = operator.attrgetter("sharded_param")
_unsharded = operator.attrgetter("_unsharded_param")
_accumulated = operator.attrgetter("unsharded_accumulated_grad")
_grad = operator.attrgetter("grad")
_no_subclass_dispatch = torch._C.DisableTorchFunctionSubclass

# (has_grad, grad_source): the four answers a parameter's gradient presence can give.
SHARDED, UNSHARDED, ACCUMULATED, NONE = (
    (True, "sharded"), (True, "unsharded"), (True, "accumulated"), (False, "none"))


def sources(fsdp_params: Sequence[Any]) -> list[tuple[bool, str]]:
    """Where each parameter's gradient is: on the sharded parameter (after the reduce-scatter),
    kept unsharded or accumulated by a no-sync micro-step, or nowhere."""
    with _no_subclass_dispatch():
        sharded = _read(fsdp_params)
        if not any(map(operator.is_, sharded, repeat(None))):
            # The usual boundary: every gradient reduce-scattered.
            return [SHARDED] * len(sharded)
        kept, accumulated = _read_unsharded(fsdp_params)
    return [SHARDED if s is not None else UNSHARDED if k is not None
            else ACCUMULATED if a is not None else NONE
            for s, k, a in zip(sharded, kept, accumulated, strict=True)]


def tokens(fsdp_params: Sequence[Any]) -> list[object]:
    """``grads.grad_token`` of each parameter: None without a gradient."""
    with _no_subclass_dispatch():
        sharded = _read(fsdp_params)
        kept, accumulated = _read_unsharded(fsdp_params)
        if _all_none(sharded) and _all_none(kept) and _all_none(accumulated):
            return sharded  # no gradient anywhere, the usual step start: every token None
        return [grad_token(p) if s is not None or k is not None or a is not None else None
                for p, s, k, a in zip(fsdp_params, sharded, kept, accumulated, strict=True)]


def _all_none(values: list[Any]) -> bool:
    # By identity: ``in``/``count`` would compare tensors with ``==``, a torch op each.
    return all(map(operator.is_, values, repeat(None)))


def _read(fsdp_params: Sequence[Any]) -> list[Any]:
    """Each sharded parameter's gradient; the parameters are read anew (FSDP may replace them)."""
    try:
        return list(map(_grad, map(_sharded, fsdp_params)))
    except AttributeError:  # a parameter without a sharded one: read each as grad_token does
        return [getattr(getattr(p, "sharded_param", None), "grad", None) for p in fsdp_params]


def _read_unsharded(fsdp_params: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """What a no-sync micro-step keeps: the unsharded parameter's gradient, or (reduce dtype
    differing) ``unsharded_accumulated_grad``."""
    try:
        kept = list(map(_grad, map(_unsharded, fsdp_params)))
    except AttributeError:  # before the first all-gather FSDP has no unsharded parameter
        kept = [getattr(p.__dict__.get("_unsharded_param"), "grad", None) for p in fsdp_params]
    try:
        accumulated = list(map(_accumulated, fsdp_params))
    except AttributeError:
        accumulated = [getattr(p, "unsharded_accumulated_grad", None) for p in fsdp_params]
    return kept, accumulated


class ParamObjects:
    """The sharded and unsharded parameters behind a list of ``FSDPParam``s, read once.

    ``unsharded`` stays None until every parameter has one (FSDP2 makes them at the first
    all-gather and keeps them); until then the reads go through the ``FSDPParam``s.
    """

    def __init__(self, fsdp_params: Sequence[Any]) -> None:
        self.fsdp_params = fsdp_params
        self.sharded: list[Any] = list(map(_sharded, fsdp_params))  # AttributeError: none
        self.unsharded: list[Any] | None = None

    def unsharded_params(self) -> list[Any] | None:
        if self.unsharded is None:
            found = [p.__dict__.get("_unsharded_param") for p in self.fsdp_params]
            if not any(map(operator.is_, found, repeat(None))):
                self.unsharded = found
        return self.unsharded


def cached_sources(objects: ParamObjects) -> list[tuple[bool, str]]:
    """``sources`` of ``objects.fsdp_params``, reading the kept parameter objects."""
    with _no_subclass_dispatch():
        sharded = list(map(_grad, objects.sharded))
        if not any(map(operator.is_, sharded, repeat(None))):
            return [SHARDED] * len(sharded)
        kept, accumulated = _read_kept(objects)
    return [SHARDED if s is not None else UNSHARDED if k is not None
            else ACCUMULATED if a is not None else NONE
            for s, k, a in zip(sharded, kept, accumulated, strict=True)]


def cached_tokens(objects: ParamObjects, *, none_kept: bool = False) -> list[object]:
    """``tokens`` of ``objects.fsdp_params``, reading the kept parameter objects.

    ``none_kept``: no parameter can hold an unsharded or accumulated gradient
    (``KeptObjects.none_kept``), so only the sharded ones are read."""
    with _no_subclass_dispatch():
        sharded = list(map(_grad, objects.sharded))
        if none_kept:
            kept = accumulated = [None] * len(sharded)
        else:
            kept, accumulated = _read_kept(objects)
        if _all_none(sharded) and _all_none(kept) and _all_none(accumulated):
            return sharded
        # grads.grad_token's answer from the gradients read above (the same objects).
        return [None if s is None and k is None and a is None
                else token_of(s) if k is None and a is None
                else (token_of(s), token_of(k), token_of(a))
                for s, k, a in zip(sharded, kept, accumulated, strict=True)]


def _read_kept(objects: ParamObjects) -> tuple[list[Any], list[Any]]:
    unsharded = objects.unsharded_params()
    if unsharded is None:
        return _read_unsharded(objects.fsdp_params)
    try:
        accumulated = list(map(_accumulated, objects.fsdp_params))
    except AttributeError:
        accumulated = [getattr(p, "unsharded_accumulated_grad", None)
                       for p in objects.fsdp_params]
    return list(map(_grad, unsharded)), accumulated


class KeptObjects:
    """A backend's ``ParamObjects``, kept only while ``watch`` watches the resets that would
    make them stale (``reset_sharded_param`` of every managed parameter)."""

    def __init__(self) -> None:
        self.watching = False
        self.objects: ParamObjects | None = None
        # ids of the parameter groups that may keep unsharded or accumulated gradients: every
        # group until its post-backward is seen to clear them (``note``).
        self.keeping: set[int] = set()

    def watch(self, fsdp_params: Sequence[Any], groups: Sequence[Any] = ()) -> list[Any]:
        """Patches to remove when recording stops; none where torch has no such method.

        ``groups``: the parameter groups whose post-backwards call ``note``; until the first
        of each, they count as keeping gradients."""
        self.keeping = {id(g) for g in groups} or {0}  # none watched: never none kept
        if not all(callable(getattr(p, "reset_sharded_param", None)) for p in fsdp_params):
            return []
        patches: list[Any] = [InstanceAttributePatch(p, {"reset_sharded_param": _then_reset(
            p.__dict__.get("reset_sharded_param") or functools.partial(
                type(p).reset_sharded_param, p), self.forget)}) for p in fsdp_params]
        self.watching = True
        return [*patches, _StopWatching(self)]

    def forget(self) -> None:
        self.objects = None

    def note(self, group: Any, may_keep: bool) -> None:
        """Around each post-backward of ``group`` (``grads.install``): may it keep unsharded
        or accumulated gradients now? Those are FSDP2's own, written only in a backward
        whose post-backwards run again, so once no group may keep any, the step's baseline
        reads only the sharded gradients (~0.6 ms fewer cold reads at 256 units)."""
        if may_keep:
            self.keeping.add(id(group))
        else:
            self.keeping.discard(id(group))

    @property
    def none_kept(self) -> bool:
        return not self.keeping

    def objects_of(self, fsdp_params: list[Any]) -> ParamObjects | None:
        """The objects behind ``fsdp_params``; None when not watched (read through them)."""
        if not self.watching:
            return None
        objects = self.objects
        if objects is None or objects.fsdp_params is not fsdp_params:
            try:
                objects = self.objects = ParamObjects(fsdp_params)
            except AttributeError:  # a parameter without a sharded one
                return None
        return objects


class _StopWatching:
    def __init__(self, kept: KeptObjects) -> None:
        self.kept = kept

    def remove(self) -> None:
        self.kept.watching = False
        self.kept.objects = None
        self.kept.keeping = {0}


def _then_reset(earlier: Callable[..., Any], on_reset: Callable[[], None]
                ) -> Callable[..., Any]:
    def reset_sharded_param(*args: Any, **kwargs: Any) -> Any:
        try:
            return earlier(*args, **kwargs)
        finally:
            on_reset()

    return reset_sharded_param
