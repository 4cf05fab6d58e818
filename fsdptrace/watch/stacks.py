"""Every rank's Python stack at hang time, taken while the ranks are still alive.

``capture_stacks`` signals each recording process of this host (only a process on the same
host can be signalled) and copies the dump its ``faulthandler`` writes into a capture file of
the run dir, ``dumps/rank=<r>/stacks-<UTC time>.txt``, one per capture (the recorder's side and
the file formats: ``record/stack_dump.py``, ``fsdptrace.store.stack_dumps``). Which processes: the
live files' headers, written by each rank as it registered the signal, name its rank, pid,
host, signal and start time; the rank meta holds the host and pid too, but not the signal, and
reaches the disk later. A process is signalled only while its pid still has the start time
its header gave: a pid reused by another program is never sent a signal it might die of.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from fsdptrace.record.stack_dump import process_start
from fsdptrace.store import fatal_signals, stack_dumps
from fsdptrace.store.stack_dumps import StackCapture

POLL_S = 0.02
# A rank whose signal thread cannot run (no wakeup: a handler installed outside Python held
# the signal) writes no end line: its dump is taken once the file stops growing for this long.
SETTLE_S = 2.0
_END_PREFIX = stack_dumps.END_LINE.split("{", 1)[0].encode()


@dataclass
class _Target:
    rank: int
    pid: int
    host: str
    signal: int
    main: str
    live: Path
    offset: int = 0  # the live file's size when the signal was sent
    grew_at: float = 0.0
    size: int = 0
    dump: bytes = b""
    end: str | None = None  # the end line, once written


def capture_stacks(run_dir: Path, *, timeout_s: float = 10.0) -> dict[int, Path]:
    """Signal every live rank of this host in ``run_dir`` and keep each one's stacks.

    Returns rank -> capture file, for the ranks whose dump came within ``timeout_s`` (a
    dump still growing at the deadline is kept as it is, marked incomplete).
    """
    run_dir = Path(run_dir)
    captured_at = datetime.now(timezone.utc)
    targets = [t for t in _live_targets(run_dir) if _signal(t)]
    deadline = time.monotonic() + timeout_s
    pending = list(targets)
    while pending and time.monotonic() < deadline:
        time.sleep(POLL_S)
        pending = [t for t in pending if not _read_dump(t)]
    return {t.rank: _keep(run_dir, t, captured_at) for t in targets if t.dump}


def read_stacks(run_dir: Path) -> dict[int, list[StackCapture]]:
    """Every rank's captured stacks in ``run_dir``, oldest first (``stack_dumps``)."""
    return stack_dumps.read_captures(Path(run_dir))


def _live_targets(run_dir: Path) -> list[_Target]:
    """The newest live process of each rank recorded on this host."""
    host = socket.gethostname()
    newest: dict[int, tuple[int, _Target]] = {}
    folder = run_dir / fatal_signals.DUMPS_DIR
    for live in sorted(folder.glob(f"rank=*/{stack_dumps.LIVE_PATTERN}")):
        if live.is_symlink() or not live.is_file():
            continue  # never a rank's: a FIFO would block the watcher, a link lead anywhere
        fields = _header(live)
        try:
            rank, pid, start = int(fields["rank"]), int(fields["pid"]), int(fields["start"])
            signum = int(fields["signal"])
        except (KeyError, ValueError):
            continue
        if fields.get("host") != host or not start or process_start(pid) != start:
            continue
        target = _Target(rank, pid, host, signum, fields.get("main_thread", ""), live)
        if rank not in newest or start > newest[rank][0]:
            newest[rank] = (start, target)
    return [target for _, target in sorted(newest.values(), key=lambda s: s[1].rank)]


def _header(live: Path) -> dict[str, str]:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open(live, "rb") as file:
            return stack_dumps.header_fields(file.readline(4096).decode())
    return {}


def _signal(target: _Target) -> bool:
    try:
        target.offset = target.size = target.live.stat().st_size
        os.kill(target.pid, target.signal)
    except OSError:  # gone since, or not ours to signal
        return False
    return True


def _read_dump(target: _Target) -> bool:
    """Read what the rank wrote since the signal; True once its dump is whole (or settled)."""
    try:
        with open(target.live, "rb") as file:
            file.seek(target.offset)
            data = file.read()
    except OSError:
        return False
    while data.startswith(_END_PREFIX) and b"\n" in data:
        # The end of an earlier capture that came after its watcher stopped waiting.
        line = data.index(b"\n") + 1
        target.offset, data = target.offset + line, data[line:]
    if len(data) != target.size - target.offset:
        target.size, target.grew_at = target.offset + len(data), time.monotonic()
    end = data.find(_END_PREFIX)
    if end >= 0:
        target.dump = data[:end]
        target.end = data[end:].split(b"\n", 1)[0].decode(errors="replace")
        return True
    target.dump = data
    return bool(data) and time.monotonic() - target.grew_at >= SETTLE_S


def _keep(run_dir: Path, target: _Target, captured_at: datetime) -> Path:
    """Write ``target``'s dump as a capture file of its own; returns its path."""
    flight = stack_dumps.header_fields(target.end or "").get("flight_recorder")
    if flight == stack_dumps.NO_FLIGHT_RECORDER:
        flight = None
    text = stack_dumps.capture_text(
        target.rank, target.pid, target.host, captured_at.isoformat(timespec="microseconds"),
        target.end is not None, flight, target.main, target.dump.decode(errors="replace"))
    folder = fatal_signals.dump_dir(run_dir, target.rank)
    path = folder / stack_dumps.CAPTURE_FILE.format(
        stamp=captured_at.strftime("%Y%m%dT%H%M%S.%fZ"))
    temp = folder / f".{path.name}.tmp"
    temp.write_text(text)
    temp.replace(path)  # a reader never sees half a capture
    return path
