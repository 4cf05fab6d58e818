"""Which model parts are already recorded in this process.

``fsdptrace record`` attaches automatically; a script that also calls ``attach`` must not be
recorded twice, so an explicit attach replaces the automatic recorder of the same modules.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch.nn as nn

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder

_by_module: weakref.WeakKeyDictionary[nn.Module, Recorder] = weakref.WeakKeyDictionary()


def recorder_of(module: nn.Module) -> Recorder | None:
    return _by_module.get(module)


def remember(parts: Sequence[nn.Module], recorder: Recorder) -> None:
    for part in parts:
        for module in part.modules():
            _by_module[module] = recorder


def forget(parts: Sequence[nn.Module]) -> None:
    """Close recorders already attached to any module of ``parts``."""
    for part in parts:
        for module in part.modules():
            recorder = _by_module.pop(module, None)
            if recorder is not None:
                recorder.close()


def live_recorders() -> list[Recorder]:
    """The distinct recorders of this process that are not closed."""
    unique = {id(r): r for r in list(_by_module.values())}
    return [r for r in unique.values() if not r._closed]
