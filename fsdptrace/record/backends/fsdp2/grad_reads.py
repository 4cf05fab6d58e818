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

The answers are those of ``grads.grad_token`` and ``units._grad_source``, value for value
(``tests/test_recorded_for_checks.py`` compares them on a real job).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import torch

from fsdptrace.record.backends.fsdp2.grads import grad_token

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
