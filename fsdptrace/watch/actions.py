"""What a watcher does after the verdict (``--on-hang``): nothing more, end the job, or run a
command with the verdict as JSON on its stdin (a Slack webhook, a Slurm requeue, an
exclude-node script)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdptrace.errors import UsageError

REPORT = "report"
TERMINATE = "terminate"
EXEC = "exec"
ACTIONS = (REPORT, TERMINATE, EXEC)
# A hook that hangs itself must not keep the watcher (and a record --watch job) waiting.
EXEC_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class OnHang:
    """``--on-hang``: an action, and for ``exec`` the command line to run."""

    action: str = REPORT
    command: str = ""


def parse_on_hang(text: str) -> OnHang:
    """``report``, ``terminate`` or ``exec CMD...``; anything else is a ``UsageError``."""
    action, _, command = text.strip().partition(" ")
    if action not in ACTIONS:
        raise UsageError(f"--on-hang {text!r}: expected report, terminate or 'exec CMD' "
                         "(e.g. --on-hang 'exec ./notify.sh')")
    if action == EXEC and not command.strip():
        raise UsageError("--on-hang exec needs a command: --on-hang 'exec ./notify.sh'")
    if action != EXEC and command.strip():
        raise UsageError(f"--on-hang {action} takes no command (only exec does)")
    return OnHang(action, command.strip())


def local_rank_pids(meta_rows: list[dict[str, Any]]) -> dict[int, int]:
    """``rank -> pid`` of the ranks recorded on this host (``meta``'s ``host`` and ``pid``)."""
    host = socket.gethostname()
    return {int(row["rank"]): int(row["pid"]) for row in meta_rows
            if row.get("host") == host and row.get("pid")}


def terminate(pids: dict[int, int]) -> list[int]:
    """SIGTERM to each rank (its recorder writes the ending *terminated*); the ranks signalled."""
    sent = []
    for rank, pid in sorted(pids.items()):
        try:
            os.kill(pid, signal.SIGTERM)
            sent.append(rank)
        except (ProcessLookupError, PermissionError):
            continue
    return sent


def run_hook(command: str, verdict: dict[str, Any], *, cwd: Path | None = None) -> int:
    """Run ``command`` (a shell command line) with ``verdict`` as JSON on stdin; its exit code
    (``-1`` when it ran past ``EXEC_TIMEOUT_S`` and was killed, 127 when it cannot start)."""
    try:
        done = subprocess.run(["/bin/sh", "-c", command], input=json.dumps(verdict).encode(),
                              timeout=EXEC_TIMEOUT_S, cwd=cwd, check=False)
    except subprocess.TimeoutExpired:
        return -1
    except OSError:
        return 127
    return done.returncode


__all__ = ["ACTIONS", "OnHang", "local_rank_pids", "parse_on_hang", "run_hook", "terminate"]
