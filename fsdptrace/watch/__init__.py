"""The watcher: the hang verdict while the job hangs (docs/checks.md v3, "Watching a live run").

``probe`` reads the ranks' journal segments cheaply (their hot folders on this host, else the
run dir's mirror) and never touches a training process; ``rule`` decides, from what the probe
saw, whether the run is hung or a rank straggles; ``loop`` polls and, on a hang, runs the same
stalled-rank analysis as ``fsdptrace analyze --check stalled-rank``, keeps the watcher's record
in the run dir (``fsdptrace.store.watch_records``), captures the ranks' stacks and acts
(``actions``). ``claim`` keeps one watcher acting when every node runs one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdptrace.watch.loop import Hang, WatchSettings, watch

_LAZY = {"watch": "loop", "WatchSettings": "loop", "Hang": "loop"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"fsdptrace.watch.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'fsdptrace.watch' has no attribute {name!r}")


__all__ = ["Hang", "WatchSettings", "watch"]
