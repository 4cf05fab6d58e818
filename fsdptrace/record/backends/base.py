"""The small interface every FSDP backend implements for the recorder.

FSDP2 and HSDP frameworks differ in *where* they keep prefetch targets, pending all-gathers
and gradients, not in *what* the recorder asks of them. A backend finds the units of the model
parts and answers four questions about a unit at a given moment; the recorder does the rest
(hooks, step bookkeeping, buffering, writing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch.nn as nn


@dataclass
class Unit:
    """One FSDP unit: the modules that share one parameter group and its backend handle."""

    index: int
    name: str
    part: int
    fqn: str
    modules: tuple[nn.Module, ...]
    handle: Any
    is_root: bool
    module_type: str
    param_names: list[str] = field(default_factory=list)
    num_param_elements: int = 0


class GradientPresence(NamedTuple):
    """Whether one managed parameter holds a gradient, and where (a boundary row's tail).

    A tuple, not a dataclass: the boundary snapshot builds one per parameter per optimizer
    step and appends ``(step, micro_step, unit) + presence`` as the stored row.
    """

    param: str
    has_grad: bool
    source: str


class PendingAllGather(NamedTuple):
    """One all-gather issued and not consumed at the boundary (a ``pending`` row's tail)."""

    kind: str
    bucket: str
    state: str


class Backend(Protocol):
    """What the recorder needs from an FSDP implementation."""

    name: str
    # Reentrant checkpoint recompute runs the graph whose output gradients fire (FSDP2);
    # HSDP's recompute outputs never get them and the reference skips them.
    watch_backward_in_recompute: bool

    def discover_units(self, parts: Sequence[nn.Module]) -> list[Unit]:
        """Every unit of the model parts, named as CHECKS.md says, roots first per part."""
        ...

    def prefetch_targets(self, unit: Unit, phase: str) -> list[str]:
        """The names of the units ``unit`` is configured to prefetch in ``phase``."""
        ...

    def gradients(self, unit: Unit) -> list[GradientPresence]:
        """For each managed parameter of ``unit``: does it hold a gradient, and where."""
        ...

    def pending_all_gathers(self, unit: Unit) -> list[PendingAllGather]:
        """All-gathers of ``unit`` issued and not yet consumed, read without touching them."""
        ...

    def is_recompute(self, unit: Unit) -> bool:
        """True while activation-checkpoint recompute re-runs forward inside backward."""
        ...

    def patch_forward_methods(
        self, unit: Unit, on_pre: Any, on_post: Any
    ) -> InstanceAttributePatch | None:
        """Catch units run through paths that bypass module hooks (registered methods)."""
        ...


class InstanceAttributePatch:
    """Undo instance attributes that shadow class methods (``remove()`` like a hook handle)."""

    def __init__(self, obj: Any, names: tuple[str, ...]) -> None:
        self.obj = obj
        self.names = names

    def remove(self) -> None:
        for name in self.names:
            self.obj.__dict__.pop(name, None)


def unit_name(part: int, fqn: str, *, num_parts: int) -> str:
    """The unit naming rule of CHECKS.md: ``<root>``, ``layers.0``, ``part[1].layers.0``."""
    if num_parts > 1:
        return f"part[{part}].{fqn}" if fqn else f"part[{part}]"
    return fqn or "<root>"


def untracked_name(obj: Any) -> str:
    return f"<untracked:{type(obj).__name__}>"
