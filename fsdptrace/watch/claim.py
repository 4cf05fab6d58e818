"""One watcher acts on a hang: with ``record --watch`` on every node of a multi-node job, each
sees the same run dir and the same silence, and only the first to claim it prints, writes the
record and runs ``--on-hang``; the others stay quiet (each still captures its own node's
stacks and, with ``terminate``, ends its own node's ranks).

The claim is a file created with ``O_EXCL`` in the run dir, which every node sees: NFS (v3
on) and Lustre create exclusively across clients.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from fsdptrace.store.watch_records import WATCH_DIR

CLAIM_FILE = "acting-watcher.json"


def claim(run_dir: Path) -> bool:
    """True for the first watcher of ``run_dir`` to call this; False for every later one."""
    folder = run_dir / WATCH_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / CLAIM_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True  # a run dir we cannot write in: no other watcher can claim it either
    with os.fdopen(fd, "w") as file:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()},
                  file)
    return True
