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
from fsdptrace.store.env import DEFAULT_RUNS_ROOT
from fsdptrace.store.run_mark import RUN_MARK, is_marked

DEFAULT_RUN_NAME = "{stamp}-{pid}-{token}"
LAUNCH_DIR = "launch-{index:03d}"
LAUNCH_PATTERN = re.compile(r"^launch-(\d+)$")

# What a recording leaves in its run dir: schema.TABLES, journal_format.JOURNAL_DIR and
# fatal_signals.DUMPS_DIR (tests keep the lists equal; importing them here would import pyarrow).
RECORDING_ENTRIES = ("meta", "units", "events", "markers", "prefetch", "gradients", "pending",
                     "allgathers", "findings", "backward_grads", "grads_written",
                     "eval_forwards", "settings", "collectives", "journal", "dumps")

MODES = ("new", "force", "append")

# The recorder's own file names inside a table's or the journal's rank partitions (parts and
# segments, the hidden temporaries of a write cut short, and the disk room a writer process
# sets aside, ``journal_hot.RESERVE_FILE``, left by one killed with its rank).
_RANK_DIR = re.compile(r"^rank=\d+$")
_PART_FILE = re.compile(r"^\.?part-[^/]*\.parquet(\.tmp)?$")
_SEGMENT_FILE = re.compile(r"^(\.?[a-z_]+-j[0-9_]+-\d{6,}\.seg(\.salvage)?|\.reserve-j[0-9_]+)$")


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
    """Whether ``run_dir`` holds a recording (or files named like one), at its top or in a
    launch directory."""
    return bool(is_marked(run_dir) or recording_entries(run_dir) or launch_dirs(run_dir))


def recording_entries(run_dir: Path) -> list[Path]:
    """The entries named like a recording's at the top of ``run_dir`` (not its launch
    directories); a symlink counts, dangling or not."""
    return [run_dir / name for name in (*RECORDING_ENTRIES, RUN_MARK)
            if os.path.lexists(run_dir / name)]


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


def foreign_entries(run_dir: Path) -> list[Path]:
    """What ``--force`` must not delete: entries named like a recording's that the recorder
    did not write (a user's ``settings/prod.yaml``, a file named ``meta``, a symlink).

    Judged by shape, without following a symlink: a table is ``rank=<n>`` folders of part
    files, the journal ``rank=<n>`` folders of segments, a launch folder a recording of its own.
    A run dir with no mark (written before the mark existed) is judged the same way.
    """
    names = [*RECORDING_ENTRIES, RUN_MARK,
             *(n for n in _names(run_dir) if LAUNCH_PATTERN.match(n))]
    foreign: list[Path] = []
    for name in names:
        path = run_dir / name
        if not os.path.lexists(path):
            continue
        if name == RUN_MARK:
            ok = path.is_file() and not path.is_symlink() and is_marked(run_dir)
            foreign += [] if ok else [path]
        elif LAUNCH_PATTERN.match(name):
            foreign += _foreign_launch(path)
        else:
            foreign += _foreign_table(path, _SEGMENT_FILE if name == "journal" else _PART_FILE)
    return foreign


def _names(directory: Path) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def _real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _foreign_launch(path: Path) -> list[Path]:
    if not _real_dir(path):
        return [path]
    known = {*RECORDING_ENTRIES, RUN_MARK}
    return [path / n for n in _names(path) if n not in known] + foreign_entries(path)


def _foreign_table(path: Path, files: re.Pattern[str]) -> list[Path]:
    if not _real_dir(path):
        return [path]
    foreign = []
    for name in _names(path):
        rank_dir = path / name
        if not _RANK_DIR.match(name) or not _real_dir(rank_dir):
            foreign.append(rank_dir)
            continue
        foreign += [rank_dir / n for n in _names(rank_dir)
                    if not files.match(n) or not (rank_dir / n).is_file()
                    or (rank_dir / n).is_symlink()]
    return foreign


def prepare_run_dir(run_dir: Path | None, *, mode: str = "new") -> Path:
    """The directory this launch records into, created before the job starts.

    ``None``: a new default run dir. Else ``run_dir`` itself, refused when it already holds a
    recording unless ``mode`` is ``force`` (the old recording is removed first; other files
    stay) or ``append`` (this launch goes to the next ``RUN_DIR/launch-<n>``). Entries named
    like a recording's that the recorder did not write (``foreign_entries``) are refused in
    every mode, before anything is removed.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if run_dir is None:
        return new_default_run_dir()
    if run_dir.is_symlink() and not run_dir.exists():
        raise RunDirError(f"{run_dir} is a symlink to {os.readlink(run_dir)}, which does not "
                          "exist: create that directory or give another --run-dir")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is not a directory: give --run-dir a directory")
    foreign = foreign_entries(run_dir) if run_dir.is_dir() else []
    if foreign and mode == "append":
        foreign = [p for p in foreign if LAUNCH_PATTERN.match(p.relative_to(run_dir).parts[0])]
    if foreign:
        what = str(foreign[0].relative_to(run_dir)) + (
            " (a symlink)" if foreign[0].is_symlink() else "")
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise RunDirError(f"{run_dir} holds {what}{more}, which fsdptrace did not write: "
                          "give a --run-dir of its own (nothing was removed)")
    if mode == "append":
        return _next_launch_dir(run_dir)
    if holds_recording(run_dir):
        if mode != "force":
            raise RunDirError(
                f"{run_dir} already holds a recording: give a new --run-dir, or --force to "
                "replace it, or --append to record this launch beside it")
        for entry in [*recording_entries(run_dir), *launch_dirs(run_dir)]:
            shutil.rmtree(entry) if _real_dir(entry) else entry.unlink()
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
