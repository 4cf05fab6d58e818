"""Where ``fsdptrace record`` writes: a run dir of its own for every launch.

Two launches writing one run dir merge into a recording nobody can read ("rank 0 was recorded
by several processes"), and the analyzer only finds out after the second job ran. So the run
dir is settled before anything is launched: a new one is created atomically (``mkdir``
without ``exist_ok``), and one that already holds a recording is refused, replaced
(``force``) or given a new launch beside the old ones (``append``: ``RUN_DIR/launch-<n>``).

Light on purpose (no torch, no pyarrow): ``fsdptrace record`` imports it before the job starts.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from pathlib import Path

from fsdptrace.errors import RunDirError

DEFAULT_RUNS_ROOT = "fsdptrace_runs"  # recorder.DEFAULT_RUNS_ROOT; not imported (torch)
DEFAULT_RUN_NAME = "{stamp}-{pid}-{token}"
LAUNCH_DIR = "launch-{index:03d}"
LAUNCH_PATTERN = re.compile(r"^launch-(\d+)$")

# What a recording leaves in its run dir: schema.TABLES and journal_format.JOURNAL_DIR
# (tests keep the two lists equal; importing them here would import pyarrow).
RECORDING_ENTRIES = ("meta", "units", "events", "markers", "prefetch", "gradients", "pending",
                     "allgathers", "findings", "backward_grads", "grads_written",
                     "eval_forwards", "settings", "journal")

MODES = ("new", "force", "append")


def new_default_run_dir(root: str | os.PathLike[str] = DEFAULT_RUNS_ROOT) -> Path:
    """Create ``ROOT/<YYYYmmdd-HHMMSS>-<pid>-<random>``, unique even for jobs started at once."""
    Path(root).mkdir(parents=True, exist_ok=True)
    while True:
        name = DEFAULT_RUN_NAME.format(stamp=time.strftime("%Y%m%d-%H%M%S"), pid=os.getpid(),
                                       token=secrets.token_hex(2))
        path = Path(root) / name
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path


def holds_recording(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a recording, at its top or in a launch directory."""
    return bool(recording_entries(run_dir) or launch_dirs(run_dir))


def recording_entries(run_dir: Path) -> list[Path]:
    """The entries of a recording at the top of ``run_dir`` (not its launch directories)."""
    return [run_dir / name for name in RECORDING_ENTRIES if (run_dir / name).exists()]


def launch_dirs(run_dir: Path) -> list[Path]:
    """``run_dir``'s launch directories (``--append``), oldest first."""
    if not run_dir.is_dir():
        return []
    found = [(int(m[1]), p) for p in run_dir.iterdir()
             if (m := LAUNCH_PATTERN.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def _launch_index(path: Path) -> int:
    match = LAUNCH_PATTERN.match(path.name)
    return int(match[1]) if match else 0


def prepare_run_dir(run_dir: Path | None, *, mode: str = "new") -> Path:
    """The directory this launch records into, created before the job starts.

    ``None``: a new default run dir. Else ``run_dir`` itself, refused when it already holds a
    recording unless ``mode`` is ``force`` (the old recording is removed first; other files
    stay) or ``append`` (this launch goes to the next ``RUN_DIR/launch-<n>``).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if run_dir is None:
        return new_default_run_dir()
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is not a directory: give --run-dir a directory")
    if mode == "append":
        return _next_launch_dir(run_dir)
    if holds_recording(run_dir):
        if mode != "force":
            raise RunDirError(
                f"{run_dir} already holds a recording: give a new --run-dir, or --force to "
                "replace it, or --append to record this launch beside it")
        for entry in [*recording_entries(run_dir), *launch_dirs(run_dir)]:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _next_launch_dir(run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    index = 1 + max((_launch_index(p) for p in launch_dirs(run_dir)), default=0)
    while True:
        path = run_dir / LAUNCH_DIR.format(index=index)
        try:
            path.mkdir()  # two launches appending at once get different numbers
        except FileExistsError:
            index += 1
            continue
        return path
