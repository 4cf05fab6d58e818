"""What a rank knows of its writer process: what it said on its status pipe, and how it ended.

The writer process (``record.part_writer``) reports on stdout: ``wrote BYTES``, ``error TYPE:
MESSAGE``, ``alive`` (every flush interval), ``done``. A thread of the rank reads those lines
(``read_status``); the rank's supervision (``record.writer``) judges from them, at flush time,
whether the process died, stalled or was stopped.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable


class WriterStatus:
    """What the writer process said: bytes written, whether it finished, when it last spoke."""

    def __init__(self) -> None:
        self.bytes_written = 0
        self.finished = False  # it said ``done``: every row is in Parquet (or the journal)
        self.exited = False  # its stdout closed: it ended (``finished`` says whether cleanly)
        self.last_heard = time.monotonic()
        self.done = threading.Event()  # it finished, or is gone


def read_status(process: subprocess.Popen[bytes], status: WriterStatus,
                on_error: Callable[[str], None]) -> None:
    """Follow the process's status lines until it ends (run on a thread of its own)."""
    assert process.stdout is not None
    for line in process.stdout:
        status.last_heard = time.monotonic()
        word, _, rest = line.decode(errors="replace").strip().partition(" ")
        if word == "wrote":
            status.bytes_written += int(rest or 0)
        elif word == "error":
            on_error(rest)
        elif word == "done":
            status.finished = True
            status.done.set()
    status.exited = True
    status.done.set()  # it exited (or was killed) without a word
    process.wait()


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (Linux ``/proc``; elsewhere never).

    Not a process sleeping in a filesystem call (state ``D``): killed, a write it has under
    way could still land in a file its replacement rewrites; that one is left to finish.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


def how_it_ended(returncode: int | None, *, stopped: bool = False) -> str:
    """``writer process N <this>``, for a marker and a warning."""
    if stopped:
        return "was stopped (SIGSTOP) and killed"
    if returncode is not None and returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with {returncode} before finishing"
