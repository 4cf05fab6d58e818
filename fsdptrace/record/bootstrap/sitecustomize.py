"""Switches on zero-code recording in every Python process ``fsdptrace record`` starts.

``fsdptrace record`` puts this folder first on ``PYTHONPATH``; Python's ``site`` imports
``sitecustomize`` at start-up (not under ``python -S``, ``-I`` or ``-E``). With
``$FSDPTRACE_RUN_DIR`` set it arranges for ``fsdptrace.record.auto`` to install its hooks once
the script imports torch (torch is not imported here; see ``install_on_torch_import``). Then it
runs the ``sitecustomize`` this one shadows, if any, so an environment's own start-up code
still runs. Stdlib imports only until recording is asked for.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
# fsdptrace.store.env.RUN_DIR_ENV, spelled here: this file runs in every process `fsdptrace record`
# starts, where fsdptrace may not be importable (tests/test_import_graph.py holds them equal).
RUN_DIR_ENV = "FSDPTRACE_RUN_DIR"


def _start_recording() -> None:
    if not os.environ.get(RUN_DIR_ENV):
        return
    try:
        from fsdptrace.record.auto import install_on_torch_import

        install_on_torch_import()
    except Exception as error:  # never stop the command from starting
        warnings.warn(
            f"fsdptrace: zero-code recording not started: {type(error).__name__}: {error}",
            RuntimeWarning,
            stacklevel=2,
        )


def _run_shadowed_sitecustomize() -> None:
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or spec.origin == __file__:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_start_recording()
_run_shadowed_sitecustomize()
