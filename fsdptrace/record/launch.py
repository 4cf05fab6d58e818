"""Run a training command with zero-code recording switched on (``fsdptrace record``).

The child learns everything from its environment (``record_env``), so plain ``python`` and
``torchrun`` alike pass it on to every rank they start, and the script needs no change.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fsdptrace.errors import FsdptraceError
from fsdptrace.store.env import LAUNCH_ENV, OVERRIDES_ENV, RAISE_ENV, RUN_DIR_ENV, STEPS_ENV
from fsdptrace.store.run_mark import new_launch_id
from fsdptrace.store.steps import parse_steps

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "bootstrap"

_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def record_env(
    run_dir: str | os.PathLike[str],
    *,
    steps: str | None = None,
    raise_on_violation: bool = False,
    base_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment (``base_env``, default ``os.environ``) a recorded command runs in.

    Sets ``FSDPTRACE_RUN_DIR`` (absolute: ranks may change directory), a new
    ``FSDPTRACE_LAUNCH`` (every rank marks the run dir with it), ``FSDPTRACE_STEPS``
    and ``FSDPTRACE_RAISE`` exactly as asked (an inherited value is dropped, so the
    recording is what the arguments say), and puts the bootstrap ``sitecustomize`` first on
    ``PYTHONPATH``. A bad ``steps`` spec raises ``ValueError`` here, before anything runs.

    ``FSDPTRACE_OVERRIDES`` names the ``attach()`` arguments these settle over a script's own:
    ``run_dir`` always (the command analyzes that directory), ``steps`` and
    ``raise_on_violation`` when given.
    """
    parse_steps(steps)
    env = dict(os.environ if base_env is None else base_env)
    env[RUN_DIR_ENV] = str(Path(run_dir).resolve())
    env[LAUNCH_ENV] = new_launch_id()
    env.pop(STEPS_ENV, None)
    env.pop(RAISE_ENV, None)
    overrides = ["run_dir"]
    if steps:
        env[STEPS_ENV] = steps
        overrides.append("steps")
    if raise_on_violation:
        env[RAISE_ENV] = "1"
        overrides.append("raise_on_violation")
    env[OVERRIDES_ENV] = ",".join(overrides)
    bootstrap = str(BOOTSTRAP_DIR)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != bootstrap]
    env["PYTHONPATH"] = os.pathsep.join([bootstrap, *rest])
    return env


def run_recorded(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``command`` in ``env`` until it ends; returns its exit code.

    SIGTERM (a scheduler stopping the job) is passed on to the child, which stops its ranks
    and lets their recorders flush. SIGINT is passed on too, except when it came from the
    terminal: Ctrl-C already reached the child, and torchrun cuts its own shutdown short on a
    second one. A child killed by signal N gives ``128 + N``, as a shell would.
    """
    if not command:
        raise FsdptraceError(
            "no command to record: give one after `--`, e.g. `fsdptrace record -- python train.py`"
        )
    try:
        child = subprocess.Popen(list(command), env=dict(env))
    except FileNotFoundError as error:
        raise FsdptraceError(
            f"cannot run {command[0]!r}: no such program (is it on PATH?)"
        ) from error
    previous = _forward_signals(child)
    try:
        returncode = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - returncode if returncode < 0 else returncode


def _forward_signals(child: subprocess.Popen) -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and _terminal_sent_it():
            return
        if child.poll() is None:
            child.send_signal(signum)

    return {signum: signal.signal(signum, forward) for signum in _FORWARDED_SIGNALS}


def _terminal_sent_it() -> bool:
    """Whether we run in the terminal's foreground group, where Ctrl-C reaches every process."""
    try:
        return os.isatty(sys.stdin.fileno()) and os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False
