"""Save torch's Flight Recorder dump into the run dir when a rank's recording ends badly.

Where the Flight Recorder is on (``TORCH_FR_BUFFER_SIZE``, or NCCL's older
``TORCH_NCCL_TRACE_BUFFER_SIZE``, above 0; on by default for NCCL), torch keeps the last
collectives of every process group with their sequence numbers and states. At an ending that
is not clean (crashed, terminated, closed mid-step) the recorder writes
``torch._C._distributed_c10d._dump_fr_trace_json()`` to ``RUN_DIR/dumps/rank=<r>/
flight_recorder-<pid>.json``, and the analyzer joins it to ``collectives`` by (process group,
sequence number) (``fsdptrace.reading.flight_recorder``). It works on gloo in torch 2.13 (checked by
experiment). A fatal signal gets no dump: the dump takes the Flight Recorder's lock and
allocates, which is not safe from a signal handler in a process that may hold them.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from fsdptrace.store import fatal_signals

BUFFER_SIZE_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def is_on() -> bool:
    """Whether the job asked torch for a Flight Recorder buffer."""
    for name in BUFFER_SIZE_ENVS:
        with contextlib.suppress(ValueError):
            if int(os.environ.get(name, "0") or "0") > 0:
                return True
    return False


def save(run_dir: Path, rank: int) -> Path | None:
    """Write the Flight Recorder's dump for ``rank``; None when it is off or unreadable.

    Never raises: an ending is being recorded, and the job must end as it would have.
    """
    if not is_on():
        return None
    try:
        from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
            _dump_fr_trace_json,
        )

        text = _dump_fr_trace_json(includeCollectives=True, onlyActive=False)
        folder = fatal_signals.dump_dir(run_dir, rank)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / fatal_signals.FR_FILE.format(pid=os.getpid())
        temp = path.with_suffix(".tmp")
        # torch 2.13 returns bytes; older releases a str.
        temp.write_bytes(text if isinstance(text, bytes) else text.encode())
        temp.replace(path)  # a reader never sees half a dump
        return path
    except Exception:
        return None
