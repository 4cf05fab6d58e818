"""The small interface every FSDP backend implements for the recorder.

FSDP2 and HSDP frameworks differ in *where* they keep prefetch targets, pending all-gathers
and gradients, not in *what* the recorder asks of them. A backend finds the units of the model
parts, answers questions about a unit at a given moment, and wraps what only it knows how to
wrap (all-gather provenance); the recorder does the rest (hooks, step bookkeeping, buffering,
writing). Every private attribute of an FSDP implementation is read inside its backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch.nn as nn

if TYPE_CHECKING:
    from pathlib import Path

    from fsdptrace.record.boundary_rows import BoundaryRows
    from fsdptrace.record.writer import ChunkWriter


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

    # ``rec`` in the ``install_*`` methods: the ``Recorder``, which each backend types as such
    # (its hooks reach further into it than ``RecorderView``); ``Any`` here, as this module
    # cannot import recorder.py, which imports it.

    name: str
    # Reentrant checkpoint recompute runs the graph whose output gradients fire (FSDP2);
    # HSDP's recompute outputs never get them and the reference skips them.
    watch_backward_in_recompute: bool

    def discover_units(self, parts: Sequence[nn.Module]) -> list[Unit]:
        """Every unit of the model parts, named as docs/checks.md says, roots first per part."""
        ...

    def prefetch_targets(self, unit: Unit, phase: str) -> list[str]:
        """The names of the units ``unit`` is configured to prefetch in ``phase``."""
        ...

    def prefetch_key(self, units: Sequence[Unit]) -> Any:
        """Every unit's raw prefetch targets, cheap to compare with ``==``; None: always changed.

        Lets the per-micro-step edge check skip resolving names when nothing changed.
        """
        ...

    def freeze_prefetch_key(self, key: Any) -> Any:
        """A copy of a ``prefetch_key`` answer that later edits of the lists cannot change."""
        ...

    def gradients(self, unit: Unit) -> list[GradientPresence]:
        """For each managed parameter of ``unit``: does it hold a gradient, and where."""
        ...

    def pending_all_gathers(self, unit: Unit) -> list[PendingAllGather]:
        """All-gathers of ``unit`` issued and not yet consumed, read without touching them."""
        ...

    def grad_tokens(self, unit: Unit) -> list[object]:
        """Per managed parameter (``gradients`` order): a value that changes whenever its
        gradient is written or replaced, None without one. Compared between a step's first
        micro-step and its boundary, it tells a gradient of this step from a leftover buffer.
        """
        ...

    def all_gradients(self, units: Sequence[Unit]) -> list[list[GradientPresence]]:
        """``gradients`` of every unit, in one call: the boundary reads them all at once, and a
        call per unit costs more than the reads themselves (~10 µs a unit on a busy box).

        The lists may be the ones the last call returned, when nothing changed: callers
        read them and never change them."""
        ...

    def all_grad_tokens(self, units: Sequence[Unit]) -> list[list[object]]:
        """``grad_tokens`` of every unit, in one call (the step's baseline)."""
        ...

    def all_pending_all_gathers(self, units: Sequence[Unit]) -> list[list[PendingAllGather]]:
        """``pending_all_gathers`` of every unit, in one call (the boundary)."""
        ...

    def settings_row(self, unit: Unit) -> tuple[object, ...]:
        """The unit's settings in ``schema.SETTING_NAMES`` order; None where unreadable."""
        ...

    def settings_key(self, units: Sequence[Unit]) -> Any:
        """Every unit's raw settings, cheap to compare with ``==``; None: always changed.

        Lets the per-micro-step settings check skip building rows when nothing changed.
        """
        ...

    def install_backward_grads(self, rec: Any) -> list[InstanceAttributePatch]:
        """Call ``rec.record_backward_grads`` at each unit post-backward, before its
        reduce-scatter is issued, with every managed parameter's state; [] if unknown."""
        ...

    def is_recompute(self, unit: Unit) -> bool:
        """True while activation-checkpoint recompute re-runs forward inside backward."""
        ...

    def in_backward(self) -> bool:
        """True while this thread runs a backward pass: a part's forward now is recompute."""
        ...

    def install_provenance(self, rec: Any) -> list[InstanceAttributePatch]:
        """Record who issues and who consumes each all-gather (``allgathers``); [] if unknown."""
        ...

    def patch_forward_methods(
        self, unit: Unit, on_pre: Any, on_post: Any
    ) -> InstanceAttributePatch | None:
        """Catch units run through paths that bypass module hooks (registered methods)."""
        ...

    def install_collectives(self, rec: Any) -> list[Any]:
        """Record each all-gather, reduce-scatter and all-reduce of a unit before it is issued,
        with its process group and that group's sequence number (``collectives``); returns
        handles whose ``remove()`` undoes it."""
        ...


@dataclass
class PrefetchSeen:
    """The prefetch edges last written, owned by ``record.snapshots``: the backend's raw
    target lists (``key``, compared first: cheap) and the edges by name (``config``)."""

    key: object = None
    config: dict[tuple[str, str], tuple[str, ...]] | None = None


class RecorderView(Protocol):
    """The recorder as its helpers see it: what hooks, guards, snapshots, the fatal-signal and
    live paths and the backends read and call on a ``record.recorder.Recorder``.

    The problem this solves: typed against ``Recorder`` itself, each of those modules imported
    ``recorder.py``, which imports them (an import circle, if only for types). They type
    against this view instead, and ``Recorder`` satisfies it. ``recording`` and ``in_eval``
    are read on every hook call (a plain attribute read is the cheapest); only the recorder
    writes them.
    """

    parts: list[nn.Module]
    backend: Backend
    units: list[Unit]
    unit_names: list[str]
    run_dir: Path
    rank: int
    step: int
    micro_step: int
    enabled: bool
    writer: ChunkWriter
    last_settings: list[tuple[object, ...] | None]
    settings_key: object
    grad_baseline: tuple[int, list[list[object]], list[int]] | None
    live_events: list[tuple] | None
    raise_on_violation: bool
    boundary_rows: BoundaryRows
    boundary_gradients: list[tuple]
    boundary_pending: list[tuple]
    boundary_written: list[tuple]
    recording: bool
    in_eval: bool
    prefetch_seen: PrefetchSeen

    def next_seq(self) -> int: ...

    def record_unit(self, unit_index: int, phase_code: int) -> None: ...

    def record_eval(self, unit_index: int) -> None: ...

    def record_backward_grads(self, unit_index: int, first: int, states: list[int],
                              via: int) -> None: ...

    def on_part_forward(self, part: int) -> bool: ...

    def abort_micro_step(self) -> None: ...

    def stash_exception(self, error: BaseException) -> None: ...

    def disable(self, reason: str) -> None: ...

    def flush(self) -> None: ...

    def close(self, *, error: str | None = None) -> None: ...

    def end_with_signal(self, name: str) -> bool: ...

    def end_with_exception(self, error: BaseException) -> bool: ...

    def forked_off(self) -> None: ...


class InstanceAttributePatch:
    """Instance attributes that shadow methods, set now and undone by ``remove()``.

    Other tools wrap the same methods. One whose instance-level wrapper was there first gets
    it back on ``remove()``; one that wrapped ours later keeps its wrapper (ours inside it
    must then pass calls through once recording stops).
    """

    def __init__(self, obj: Any, replacements: dict[str, Any]) -> None:
        self.obj = obj
        self.previous = {name: obj.__dict__.get(name, _ABSENT) for name in replacements}
        self.installed = dict(replacements)
        for name, value in replacements.items():
            setattr(obj, name, value)

    def remove(self) -> None:
        attributes = self.obj.__dict__
        for name, ours in self.installed.items():
            if attributes.get(name) is not ours:
                continue
            previous = self.previous[name]
            if previous is _ABSENT:
                del attributes[name]
            else:
                attributes[name] = previous


_ABSENT = object()


def unit_name(part: int, fqn: str, *, num_parts: int) -> str:
    """The unit naming rule of docs/checks.md: ``<root>``, ``layers.0``, ``part[1].layers.0``."""
    if num_parts > 1:
        return f"part[{part}].{fqn}" if fqn else f"part[{part}]"
    return fqn or "<root>"


def untracked_name(obj: Any) -> str:
    return f"<untracked:{type(obj).__name__}>"
