"""Where a rank's journal segments live while they are written: memory no filesystem can freeze.

The hooks store rows into memory-mapped segments (``record.journal``). Mapped from the run
dir's filesystem, a freeze (``fsfreeze``, a stalled NFS or Lustre server) write-protects those
pages and the next row written faults and waits for the thaw while holding Python's lock:
training and ``close()`` stop with it. So the segments are mapped from a per-user folder under
``/dev/shm`` (tmpfs: its pages are memory, never frozen, and like any file they outlive the
process). The writer process (``record.part_writer``) turns them into Parquet, mirrors the
open ones into ``RUN_DIR/journal/rank=<r>/`` every flush interval (a reader on another host
sees a hung rank's tail at most one interval late) and writes the rest when the recording
process ends, however it ends; a reader on the same host reads the folder directly.

``FSDPTRACE_HOT_DIR`` names another root for the folders; ``off`` maps segments in the run dir.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path

HOT_DIR_ENV = "FSDPTRACE_HOT_DIR"
DEFAULT_HOT_ROOT = "/dev/shm"
SEGMENT_SUFFIX = ".seg"
_PAGE = 4096
_COPY_CHUNK = 1 << 20


def hot_dir(cold: Path, *, create: bool) -> Path | None:
    """The private folder holding the segments of journal folder ``cold``, or None.

    None when hot segments are turned off, the root is missing or not writable, or the folder
    is not this user's alone (a folder another user planted is never read or written).
    """
    setting = os.environ.get(HOT_DIR_ENV, DEFAULT_HOT_ROOT)
    if setting.strip().lower() in ("", "off", "0", "none"):
        return None
    try:
        key = hashlib.sha256(os.fsencode(os.path.realpath(cold))).hexdigest()[:24]
        root = Path(setting) / f"fsdptrace-{os.getuid()}"
        folder = root / key
        if create:
            root.mkdir(mode=0o700, exist_ok=True)
        if not _private(root):
            return None
        if create:
            folder.mkdir(mode=0o700, exist_ok=True)
        return folder if _private(folder) else None
    except OSError:
        return None


def _private(path: Path) -> bool:
    info = os.lstat(path)
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
            and not info.st_mode & 0o077)


def segment_files(folder: Path, writer: str | None = None) -> list[Path]:
    """The segment files in ``folder`` (of one writer when given), sorted by name."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    prefix = f"-{writer}-" if writer else ""
    return [folder / n for n in names if n.endswith(SEGMENT_SUFFIX) and prefix in n]


def used_length(data: bytes | memoryview) -> int:
    """Bytes worth copying: up to the last non-zero byte, plus a page so no slot is cut short.

    Segments are allocated whole and zero-filled; a record never spans more than a page of
    trailing zero bytes (slots are a few dozen bytes, framed records end with a non-zero length).
    """
    last = len(bytes(data).rstrip(b"\0"))
    return min(len(data), -(-(last + _PAGE) // _PAGE) * _PAGE) if last else 0


def salvage(hot: Path, cold: Path, writer: str | None = None) -> int:
    """Copy every segment left in ``hot`` into ``cold`` (atomically each), then delete it.

    Returns the number of segments moved. A segment the writer already turned into Parquet is
    harmless in ``cold``: the reader skips segments a part covers.
    """
    moved = 0
    for path in segment_files(hot, writer):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        data = data[:used_length(data)]
        target = cold / path.name
        temp = cold / f".{path.name}.salvage"
        try:
            cold.mkdir(parents=True, exist_ok=True)
            temp.write_bytes(data)
            os.replace(temp, target)
            path.unlink()
            moved += 1
        except OSError:
            continue
    remove_if_empty(hot)
    return moved


def remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # another writer's segments are still there, or it is gone already


def wait_salvaged(cold: Path, timeout_s: float = 10.0) -> bool:
    """Wait until no hot folder is left for ``cold`` (tests, and tools that need the run dir)."""
    deadline = time.monotonic() + timeout_s
    while True:
        folder = hot_dir(cold, create=False)
        if folder is None or not folder.exists():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)

