"""fsdptrace: a flight recorder and post-mortem analyzer for PyTorch FSDP2 training jobs.

``fsdptrace.attach`` records (light: torch and pyarrow only). ``fsdptrace.load`` and
``fsdptrace.analyze`` read and check a run dir; ``analyze`` returns an ``Analysis``, which
``fsdptrace.write(analysis, "report.html")`` writes in any of ``FORMATS``. They import pandas on
first use, so a training process that only records never pays for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsdptrace.errors import FsdptraceError, LifecycleError, RunDirError
from fsdptrace.version import __version__

if TYPE_CHECKING:
    from fsdptrace.analysis.result import Analysis
    from fsdptrace.analysis.run import analyze, incomplete_ranges
    from fsdptrace.reading.trace import Trace, load
    from fsdptrace.record.attach import attach
    from fsdptrace.record.recorder import Recorder
    from fsdptrace.render.formats import FORMATS
    from fsdptrace.render.formats import save as write
    from fsdptrace.views.run_diff import RunDiff, diff

_LAZY = {
    "attach": ("fsdptrace.record.attach", "attach"),
    "Recorder": ("fsdptrace.record.recorder", "Recorder"),
    "load": ("fsdptrace.reading.trace", "load"),
    "Trace": ("fsdptrace.reading.trace", "Trace"),
    "analyze": ("fsdptrace.analysis.run", "analyze"),
    "Analysis": ("fsdptrace.analysis.result", "Analysis"),
    "FORMATS": ("fsdptrace.render.formats", "FORMATS"),
    "write": ("fsdptrace.render.formats", "save"),
    "incomplete_ranges": ("fsdptrace.analysis.run", "incomplete_ranges"),
    "diff": ("fsdptrace.views.run_diff", "diff"),
    "RunDiff": ("fsdptrace.views.run_diff", "RunDiff"),
}

__all__ = [
    "FORMATS",
    "Analysis",
    "FsdptraceError",
    "LifecycleError",
    "Recorder",
    "RunDiff",
    "RunDirError",
    "Trace",
    "__version__",
    "analyze",
    "attach",
    "diff",
    "incomplete_ranges",
    "load",
    "write",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fsdptrace' has no attribute {name!r}")
