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

A folder belongs to one recording: its name hashes the journal folder's real path *and* the
launch id of the run dir's mark (``run_mark``), so a new recording into the same path (after
``rm -rf`` or ``record --force``) never reads segments an earlier one left behind. Its owner
file names the run dir, rank, launch and version, and every process writing the folder (the
rank, its writer processes) holds a shared ``flock`` on it: a folder whose lock can be taken
exclusively was left by processes that are all gone (``record.hot_sweep`` settles it).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from fsdptrace.store.env import HOT_DIR_ENV
from fsdptrace.store.full_writes import write_all
from fsdptrace.store.journal_format import LOSS_WRITER
from fsdptrace.store.run_mark import read_launch

DEFAULT_HOT_ROOT = "/dev/shm"
SEGMENT_SUFFIX = ".seg"
OWNER_FILE = "owner.json"
_MAX_OWNER_BYTES = 64 * 1024
_PAGE = 4096
_COPY_CHUNK = 1 << 20
# Room a writer sets aside in its run dir journal (``reserve_room``): for its markers, what
# the markers recorded since the last mirror pass take, many times over; for the markers that
# say which rows did not fit (``record.unwritten``, under the ``LOSS_WRITER`` id), a few
# hundred bytes per table. Each is written into its room's own blocks (``write_in_room``), so
# no other writer on the same full disk can take that room first.
RESERVE_FILE = ".reserve-{writer}"
RESERVE_BYTES = 24 * 1024
LOSS_RESERVE_BYTES = 8 * 1024
# Segments ``salvage`` copies first: the markers say where a rank's rows stop and how it
# ended, meta and units make it a rank a reader can name; all three are small.
FIRST_SALVAGED = ("markers-", "meta-", "units-")


def hot_root() -> Path | None:
    """This user's folder of hot folders (it may not exist yet), or None when turned off."""
    setting = os.environ.get(HOT_DIR_ENV, DEFAULT_HOT_ROOT)
    if setting.strip().lower() in ("", "off", "0", "none"):
        return None
    return Path(setting) / f"fsdptrace-{os.getuid()}"


def hot_dir(cold: Path, *, create: bool, launch: str | None = None) -> Path | None:
    """The private folder holding the segments of journal folder ``cold``, or None.

    ``launch``: the recording's launch id; by default the one the run dir's mark names
    (``cold`` is ``RUN_DIR/journal/rank=<r>``). A run dir with no mark (recorded before the
    mark existed) keeps the folder name it always had.

    None when hot segments are turned off, the root is missing or not writable, or the folder
    is not this user's alone (a folder another user planted is never read or written).
    """
    root = hot_root()
    if root is None:
        return None
    try:
        if create:
            root.mkdir(mode=0o700, exist_ok=True)
        if not is_private(root):
            return None  # first: a reader on another host has no root, and no name to make
        if launch is None:
            launch = read_launch(cold.parent.parent)
        name = os.fsencode(os.path.realpath(cold)) + (b"\0" + launch.encode() if launch else b"")
        folder = root / hashlib.sha256(name).hexdigest()[:24]
        if create:
            folder.mkdir(mode=0o700, exist_ok=True)
        return folder if is_private(folder) else None
    except OSError:
        return None


def claim(folder: Path, owner: dict[str, Any]) -> int | None:
    """Say whose ``folder`` is and hold a shared lock on it while the descriptor is open.

    Returns the descriptor (pass it on to the writer process: the lock lasts while any
    process holds it), or None when the folder is being settled by a sweep right now.
    """
    try:
        fd = os.open(folder / OWNER_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        data = json.dumps(owner).encode()
        write_all(fd, data, 0)  # every claimer of a folder writes the same owner
        os.ftruncate(fd, len(data))
        return fd
    except OSError:
        os.close(fd)
        return None


def lock_if_stale(folder: Path) -> tuple[int, dict[str, Any]] | None:
    """``(descriptor holding the exclusive lock, owner)`` when every process that wrote
    ``folder`` is gone; None while one lives, or for a folder with no owner file (written
    before owner files existed, or being created right now)."""
    try:
        fd = os.open(folder / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        owner = json.loads(os.read(fd, _MAX_OWNER_BYTES))
        if isinstance(owner, dict):
            return fd, owner
    except (OSError, ValueError):
        pass
    os.close(fd)
    return None


def is_private(path: Path) -> bool:
    """A real directory of this user's that nobody else may enter (lstat: no symlink)."""
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


def reserve_room(cold: Path, writer: str) -> None:
    """Set aside room on ``cold``'s disk for ``salvage`` and the loss markers: when the run
    dir's disk fills, the markers saying where the rank's rows stop and why still reach it."""
    for owner, size in ((writer, RESERVE_BYTES),
                        (LOSS_WRITER.format(writer=writer), LOSS_RESERVE_BYTES)):
        try:
            fd = os.open(cold / RESERVE_FILE.format(writer=owner), os.O_WRONLY | os.O_CREAT,
                         0o644)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError:
            release_room(cold, writer)  # a disk already full: nothing to set aside
            return


def release_room(cold: Path, writer: str, *, loss_too: bool = True) -> None:
    """Give back what ``reserve_room`` set aside (at the end of a recording, or to salvage);
    ``loss_too=False`` keeps the loss markers' room (they are written last)."""
    owners = (writer, LOSS_WRITER.format(writer=writer)) if loss_too else (writer,)
    for owner in owners:
        try:
            (cold / RESERVE_FILE.format(writer=owner)).unlink(missing_ok=True)
        except OSError:
            pass


def write_in_room(cold: Path, owner: str, data: bytes, target: Path) -> bool:
    """``data`` as ``target``, written into the blocks ``owner``'s room holds, which is then
    renamed: nothing new is allocated. False (nothing written) if the room is gone or small."""
    room = cold / RESERVE_FILE.format(writer=owner)
    try:
        fd = os.open(room, os.O_WRONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size < len(data):
            return False
        write_all(fd, data, 0)
        os.ftruncate(fd, len(data))
        os.replace(room, target)
        return True
    except OSError:
        room.unlink(missing_ok=True)  # half overwritten: no room any more
        return False
    finally:
        os.close(fd)


def salvage(hot: Path, cold: Path, writer: str | None = None) -> int:
    """Copy every segment left in ``hot`` into ``cold`` (atomically each), then delete it.

    Markers, meta and units first; the first markers segment into the room ``reserve_room``
    set aside, whose rest is freed for the others: on a full disk they are what says where
    the rows stop. The loss markers' room is kept. A copy that fails leaves no partial file
    behind. Returns the number of segments moved. A segment the writer already turned into
    Parquet is harmless in ``cold``: the reader skips segments a part covers.
    """
    moved = 0
    paths = sorted(segment_files(hot, writer),
                   key=lambda p: (not p.name.startswith(FIRST_SALVAGED), p.name))
    for at, path in enumerate(paths):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        data = data[:used_length(data)]
        try:
            cold.mkdir(parents=True, exist_ok=True)
            if not (at == 0 and writer is not None and path.name.startswith("markers-")
                    and write_in_room(cold, writer, data, cold / path.name)):
                if writer is not None:
                    release_room(cold, writer, loss_too=False)
                write_segment(data, cold / path.name)
            path.unlink()
            moved += 1
        except OSError:
            continue
    if writer is not None:
        release_room(cold, writer, loss_too=False)
    remove_if_empty(hot)
    return moved


def write_segment(data: bytes, target: Path) -> None:
    """``data`` as segment ``target``, atomically (by rename); a write that fails leaves no
    partial file behind, which would hold the disk's last room."""
    temp = target.with_name(f".{target.name}.salvage")
    try:
        temp.write_bytes(data)
        os.replace(temp, target)
    except OSError:
        try:
            temp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def remove_if_empty(folder: Path) -> None:
    """Remove ``folder`` (and its owner file) once no segment is left in it."""
    if segment_files(folder):
        return  # another writer's segments are still there
    try:
        (folder / OWNER_FILE).unlink(missing_ok=True)
        folder.rmdir()
    except OSError:
        pass  # it is gone already, or a segment appeared meanwhile


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

