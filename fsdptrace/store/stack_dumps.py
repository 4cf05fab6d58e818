"""Every rank's Python stack while it hangs: the file names, their header lines, and the reader.

A hung rank's main thread often sits inside C++ (a gloo or NCCL wait), where no Python code
runs; a C-level signal handler still does. So each recording process registers
``faulthandler`` on a signal of its own (``record/stack_dump.py``) writing every thread's
stack to ``RUN_DIR/dumps/rank=<r>/signal-stacks-<pid>.txt`` (the *live file*: its first line
says which process, host and signal; each dump is followed by an end line once the rank's
signal thread has saved the Flight Recorder's dump beside it). The watcher
(``watch/stacks.py``) sends the signal and copies each new dump into a *capture file*,
``RUN_DIR/dumps/rank=<r>/stacks-<UTC time>.txt``, one per capture, which the loader, the
report and ``read_captures`` read back.

No pyarrow, no torch: the recorder writes these names at attach, the watcher reads them.
Files come from other people's jobs: a missing or damaged header skips the file with a
warning naming it; a dump cut short is read as far as it goes.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from fsdptrace.errors import SkippedDumpWarning
from fsdptrace.store import fatal_signals

LIVE_FILE = "signal-stacks-{pid}.txt"
LIVE_PATTERN = "signal-stacks-*.txt"
CAPTURE_FILE = "stacks-{stamp}.txt"
CAPTURE_PATTERN = "stacks-*.txt"
# ``start``: the process's start time in clock ticks since boot (/proc/<pid>/stat, field 22),
# so a watcher never signals another process that got the same pid later.
LIVE_HEADER = ("fsdptrace signal stacks: rank={rank} pid={pid} host={host} signal={signal} "
               "start={start} main_thread=0x{main:016x}\n")
END_LINE = "fsdptrace: end of stacks; flight_recorder={flight_recorder}\n"
CAPTURE_HEADER = ("fsdptrace stacks: rank={rank} pid={pid} host={host} captured_at={captured_at} "
                  "complete={complete} flight_recorder={flight_recorder} main_thread={main}\n")
NO_FLIGHT_RECORDER = "none"
# faulthandler writes at most 100 threads of 100 frames: a capture is far below this.
MAX_CAPTURE_BYTES = 4 << 20
_FIELD = re.compile(r"(\w+)=(\S*)")


@dataclass(frozen=True)
class ThreadStack:
    """One thread of a dump, innermost frame first ("func (file.py:line)")."""

    ident: str
    is_main: bool  # the thread that ran training (the recorder's main thread)
    frames: tuple[str, ...]


@dataclass(frozen=True)
class StackCapture:
    """One capture of one rank: when, whether its end line came, and every thread's stack."""

    rank: int
    pid: int
    captured_at: str  # UTC, ISO 8601
    complete: bool  # False: the dump had not ended when the watcher gave up waiting
    flight_recorder: str | None  # the Flight Recorder dump's file name beside it, if saved
    path: Path
    text: str  # faulthandler's text, every thread, most recent call first
    threads: tuple[ThreadStack, ...]

    @property
    def main_frames(self) -> tuple[str, ...]:
        """The training thread's frames, innermost first (empty if it was not in the dump)."""
        return next((t.frames for t in self.threads if t.is_main), ())


def header_fields(line: str) -> dict[str, str]:
    """The ``key=value`` fields of a live or capture header line."""
    return dict(_FIELD.findall(line))


def capture_text(rank: int, pid: int, host: str, captured_at: str, complete: bool,
                 flight_recorder: str | None, main: str, dump: str) -> str:
    """A capture file's whole text: its header, then the dump as faulthandler wrote it."""
    return CAPTURE_HEADER.format(
        rank=rank, pid=pid, host=host, captured_at=captured_at,
        complete="yes" if complete else "no",
        flight_recorder=flight_recorder or NO_FLIGHT_RECORDER, main=main) + dump


def parse_capture(text: str, path: Path) -> StackCapture:
    """A capture file's text as a ``StackCapture``; ValueError if its header is not ours."""
    first, _, dump = text.partition("\n")
    if not first.startswith("fsdptrace stacks: "):
        raise ValueError("no fsdptrace stacks header on its first line")
    fields = header_fields(first)
    try:
        rank, pid = int(fields["rank"]), int(fields["pid"])
    except (KeyError, ValueError) as error:
        raise ValueError(f"header without a rank and pid ({first[:200]!r})") from error
    main = fields.get("main_thread", "")
    threads = tuple(ThreadStack(ident, ident == main, frames)
                    for _, ident, frames in fatal_signals.thread_blocks(dump))
    flight = fields.get("flight_recorder", NO_FLIGHT_RECORDER)
    return StackCapture(rank, pid, fields.get("captured_at", ""), fields.get("complete") == "yes",
                        None if flight == NO_FLIGHT_RECORDER else flight, path, dump.strip(),
                        threads)


def read_captures(run_dir: Path) -> dict[int, list[StackCapture]]:
    """Every rank's captures in ``run_dir``, oldest first; ranks without one are absent."""
    found: dict[int, list[StackCapture]] = {}
    folder = run_dir / fatal_signals.DUMPS_DIR
    if not folder.is_dir():
        return found
    for path in sorted(folder.glob(f"rank=*/{CAPTURE_PATTERN}")):
        try:
            capture = parse_capture(_read_bounded(path), path)
        except (OSError, ValueError) as error:
            warnings.warn(f"{path}: not an fsdptrace stack capture ({error}); skipped",
                          SkippedDumpWarning, stacklevel=2)
            continue
        found.setdefault(capture.rank, []).append(capture)
    return {rank: sorted(c, key=lambda c: c.captured_at) for rank, c in sorted(found.items())}


def _read_bounded(path: Path) -> str:
    """A capture's text; a link, a FIFO or a device planted under its name is refused (it
    could point anywhere, or never end), and a huge file is read only as far as the bound."""
    if path.is_symlink() or not path.is_file():
        raise ValueError("not a regular file")
    with open(path, "rb") as file:
        return file.read(MAX_CAPTURE_BYTES).decode(errors="replace")
