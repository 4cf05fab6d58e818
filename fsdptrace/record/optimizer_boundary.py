"""The optimizer boundary of plain and closure steps, on any optimizer a trainer hands us.

docs/checks.md "optimizer boundary": right before the optimizer updates the parameters. A plain
``optimizer.step()`` updates right after its step pre-hooks, so the boundary is the pre-hook.
``optimizer.step(closure)`` runs the forward and backward *inside* the step (Lightning's
automatic optimization, ``torch.optim.LBFGS``): its pre-hook fires before that forward, so the
boundary is taken when the closure returns, right before the update that follows. LBFGS calls
its closure once per inner iteration with an update after each, so every return is a boundary
(``max_iter=1`` gives one per ``step()``).

torch 2.13's step pre-hooks receive ``(optimizer, args, kwargs)`` with the optimizer as
``args[0]`` and the closure as ``args[1]`` or ``kwargs["closure"]``, and may return new
``(args, kwargs)`` (measured; torch.optim.optimizer ``profile_hook_step``): the closure is
wrapped there, which works for every optimizer that follows torch's ``step(closure)`` convention.

Trainers wrap the optimizer: accelerate's ``AcceleratedOptimizer`` and Lightning's
``LightningOptimizer`` subclass (or imitate) ``torch.optim.Optimizer`` without running its
``__init__``, so they have no step-hook table, and their ``step()`` is not the one that updates.
``find_real_optimizer`` unwraps them; an unknown wrapper gets its ``step`` wrapped instead.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

# Where wrappers keep the optimizer they wrap: accelerate and DeepSpeed-style wrappers
# (``.optimizer``), Lightning's ``LightningOptimizer`` (``._optimizer``).
_INNER_ATTRIBUTES = ("optimizer", "_optimizer")
_MAX_WRAPPING_DEPTH = 8

Boundary = Callable[[], None]
StepArgs = tuple[tuple[Any, ...], dict[str, Any]]


def closure_step_args(args: tuple[Any, ...], kwargs: dict[str, Any], boundary: Boundary,
                      *, first: int = 1) -> StepArgs | None:
    """Take the boundary of one ``step(...)`` call whose positional arguments after the
    optimizer start at ``args[first]``.

    A plain step: call ``boundary`` now and return None (the arguments stay as they are). A
    closure step: return the arguments with the closure wrapped so that ``boundary`` runs each
    time it returns; an exception from the closure or from ``boundary`` (live raising) leaves
    the step before the update.
    """
    if callable(kwargs.get("closure")):
        return args, {**kwargs, "closure": _then(kwargs["closure"], boundary)}
    if len(args) > first and callable(args[first]):
        return (*args[:first], _then(args[first], boundary), *args[first + 1:]), kwargs
    boundary()
    return None


def _then(closure: Callable[..., Any], boundary: Boundary) -> Callable[..., Any]:
    @functools.wraps(closure)
    def closure_then_boundary(*args: Any, **kwargs: Any) -> Any:
        result = closure(*args, **kwargs)
        boundary()
        return result

    return closure_then_boundary


def has_step_hooks(optimizer: object) -> bool:
    """Whether ``optimizer`` is a torch optimizer whose ``step`` runs its own step pre-hooks.

    Read from the instance's own attributes: ``LightningOptimizer`` forwards unknown attributes
    to the optimizer it wraps, so ``getattr`` would find the inner one's hook table.
    """
    own = getattr(optimizer, "__dict__", {})
    return isinstance(optimizer, torch.optim.Optimizer) and isinstance(
        own.get("_optimizer_step_pre_hooks"), dict)


def find_real_optimizer(optimizer: object) -> torch.optim.Optimizer | None:
    """The torch optimizer that actually updates, under the trainers' wrappers; None if none."""
    seen: set[int] = set()
    for _ in range(_MAX_WRAPPING_DEPTH):
        if has_step_hooks(optimizer):
            assert isinstance(optimizer, torch.optim.Optimizer)
            return optimizer
        seen.add(id(optimizer))
        inner = None
        for name in _INNER_ATTRIBUTES:
            try:
                candidate = getattr(optimizer, name, None)
            except Exception:  # a wrapper's property may raise before training starts
                candidate = None
            if candidate is not None and id(candidate) not in seen:
                inner = candidate
                break
        if inner is None:
            return None
        optimizer = inner
    return None


def hook_optimizer(optimizer: object, boundary: Boundary) -> Any:
    """Call ``boundary`` at each optimizer boundary of ``optimizer`` (a torch optimizer or a
    trainer's wrapper of one); returns a handle with ``remove()``, or None with one warning.

    Never raises: the recorder must not break training over an optimizer it cannot hook.
    """
    try:
        real = find_real_optimizer(optimizer)
        if real is not None:
            return real.register_step_pre_hook(
                lambda _optimizer, args, kwargs: closure_step_args(args, kwargs, boundary))
        if callable(getattr(optimizer, "step", None)):
            warnings.warn(
                f"fsdptrace: no torch optimizer found inside {type(optimizer).__name__} "
                "(looked for .optimizer and ._optimizer): optimizer boundaries are taken at "
                "its step(); pass the torch optimizer to attach(optimizer=...) if that step "
                "does not update every time", RuntimeWarning, stacklevel=3)
            return StepWrapper(optimizer, boundary)
        reason = f"{type(optimizer).__name__} has no step()"
    except Exception as error:
        reason = f"{type(error).__name__}: {error}"
    warnings.warn(
        f"fsdptrace: cannot hook the optimizer ({reason}): no optimizer boundaries will be "
        "recorded; call recorder.before_optimizer_step() before each update", RuntimeWarning,
        stacklevel=3)
    return None


class StepWrapper:
    """Boundaries from an optimizer-like object with no torch step hooks: its ``step`` method
    is replaced on the instance (the class is untouched); ``remove`` puts it back."""

    def __init__(self, optimizer: Any, boundary: Boundary) -> None:
        self.optimizer = optimizer
        original = optimizer.step

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            new = closure_step_args(args, kwargs, boundary, first=0)
            if new is not None:
                args, kwargs = new
            return original(*args, **kwargs)

        self._had_own_step = "step" in vars(optimizer)
        self._original = original
        optimizer.step = step

    def remove(self) -> None:
        if self.optimizer is None:
            return
        if self._had_own_step:
            self.optimizer.step = self._original
        else:
            del self.optimizer.step
        self.optimizer = None
