"""What a watcher saw when it judged a run hung, kept in the run dir beside the tables.

``fsdptrace watch`` (or ``record --watch``) writes one JSON file per hang it detected,
``RUN_DIR/watch/hang-<n>.json``: when it was detected, how long no rank had recorded
anything, the hang time in force, where each rank was, the stalled-rank verdict it printed
and the stack files it captured. The post-mortem reads them back with ``read_hangs``. Run dirs
come from other people's jobs: only JSON is parsed, bounded in size, and a file that is not a
record is skipped with a warning naming it.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from fsdptrace.errors import FsdptraceWarning

WATCH_DIR = "watch"
HANG_FILE = "hang-{index:03d}.json"
HANG_GLOB = "hang-*.json"
# A record holds one verdict: a few lines per rank. Larger is not one of ours.
MAX_RECORD_BYTES = 64 * 1024 * 1024
RECORD_VERSION = 1


def write_hang(run_dir: Path, record: dict[str, Any]) -> Path:
    """Write ``record`` as the run dir's next hang record (atomically); returns its path."""
    folder = run_dir / WATCH_DIR
    folder.mkdir(parents=True, exist_ok=True)
    index = len(list(folder.glob(HANG_GLOB)))
    while (folder / HANG_FILE.format(index=index)).exists():
        index += 1
    path = folder / HANG_FILE.format(index=index)
    temp = folder / f".{path.name}.{os.getpid()}.tmp"
    temp.write_text(json.dumps({"version": RECORD_VERSION, **record}, indent=1))
    os.replace(temp, path)
    return path


def read_hangs(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every hang record of a run dir, oldest first (empty when no watcher saw a hang)."""
    folder = Path(run_dir) / WATCH_DIR
    records = []
    for path in sorted(folder.glob(HANG_GLOB)) if folder.is_dir() else []:
        try:
            if path.stat().st_size > MAX_RECORD_BYTES:
                raise ValueError("larger than a hang record")
            record = json.loads(path.read_text())
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as error:
            warnings.warn(f"{path}: not a fsdptrace hang record ({error}); skipped",
                          FsdptraceWarning, stacklevel=2)
            continue
        records.append({**record, "path": str(path)})
    return records
