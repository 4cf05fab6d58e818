"""Which model parts are already recorded in this process.

``fsdptrace record`` attaches automatically; a script that also calls ``attach`` must not be
recorded twice, so an explicit attach replaces the automatic recorder of the same modules.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch.nn as nn

from fsdptrace.errors import FsdptraceError

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder

# Values are weak too: a Recorder holds its modules, so a strong value would keep its own key
# (and the whole model) alive forever.
_by_module: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Recorder]] = (
    weakref.WeakKeyDictionary())


def recorder_of(module: nn.Module) -> Recorder | None:
    ref = _by_module.get(module)
    return ref() if ref is not None else None


def remember(parts: Sequence[nn.Module], recorder: Recorder) -> None:
    ref = weakref.ref(recorder)
    for part in parts:
        for module in part.modules():
            _by_module[module] = ref


def forget(parts: Sequence[nn.Module]) -> None:
    """Close recorders already attached to any module of ``parts``."""
    for part in parts:
        for module in part.modules():
            ref = _by_module.pop(module, None)
            recorder = ref() if ref is not None else None
            if recorder is not None:
                recorder.close()


def live_recorders() -> list[Recorder]:
    """The distinct recorders of this process that are not closed."""
    unique = {id(r): r for r in (ref() for ref in list(_by_module.values())) if r is not None}
    return [r for r in unique.values() if not r._closed]


def refuse_shared_run_dir(run_dir: Path, rank: int) -> None:
    """Two models recorded into one run dir as one rank would merge silently: refuse."""
    wanted = run_dir.resolve()
    for other in live_recorders():
        if other.rank == rank and other.run_dir.resolve() == wanted:
            raise FsdptraceError(
                f"rank {rank} already records another model into {run_dir}: give each model "
                "its own run_dir, or close() the first recorder before attaching the second")
