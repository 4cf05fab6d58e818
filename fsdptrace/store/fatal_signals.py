"""Fatal signals as endings: where a rank's dump lies in the run dir, and what it says.

SIGABRT, SIGSEGV, SIGBUS, SIGFPE and SIGILL kill a rank before any Python code can run (a
gloo size check aborts from a C++ thread; ``abort()`` re-raises if a handler returns). Only a
C-level handler sees them: the recorder points Python's ``faulthandler`` at a per-rank file
(``record/fatal.py``), which writes every thread's Python stack from the signal handler and
then lets the signal kill the process as before. The reader folds a dump that names a fatal
signal into the rank's markers as its ending (``schema.MARKER_FATAL_SIGNAL``).

No pyarrow, no torch: the recorder opens the file at start with these names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DUMPS_DIR = "dumps"  # RUN_DIR/dumps/rank=<r>/...: files a rank leaves besides its tables
# torch's Flight Recorder dumps there too, one file per process (``record.flight_recorder``).
FR_FILE = "flight_recorder-{pid}.json"
FR_PATTERN = "flight_recorder-*.json"
FATAL_FILE = "fatal-{pid}.txt"
FATAL_PATTERN = "fatal-*.txt"
# First line of the file, written when the recorder starts: the main thread's id as
# faulthandler prints thread ids, so the reader can find the thread that ran training.
HEADER = "fsdptrace fatal-signal dump: rank={rank} pid={pid} main_thread=0x{main:016x}\n"
_HEADER = re.compile(r"main_thread=(0x[0-9a-f]+)")

# faulthandler's first line per signal (Modules/faulthandler.c, ``faulthandler_handlers``).
SIGNAL_BY_TEXT = {"Aborted": "SIGABRT", "Segmentation fault": "SIGSEGV",
                  "Bus error": "SIGBUS", "Floating-point exception": "SIGFPE",
                  "Illegal instruction": "SIGILL"}
_FATAL = re.compile(r"^Fatal Python error: (.+)$", re.MULTILINE)
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$",
                     re.MULTILINE)
_FRAME = re.compile(r'^  File "(?P<path>.*)", line (?P<line>\d+) in (?P<func>.*)$')
NUM_QUOTED_FRAMES = 3


@dataclass(frozen=True)
class FatalDump:
    """One rank's death by a fatal signal: the signal and every thread's Python stack."""

    signal: str
    stack: str  # faulthandler's text, every thread, most recent call first
    innermost: tuple[str, ...]  # "func (file.py:line)" of the thread that ran training


def dump_dir(run_dir: Path, rank: int) -> Path:
    return run_dir / DUMPS_DIR / f"rank={rank}"


def read_fatal_dump(run_dir: Path, rank: int) -> FatalDump | None:
    """The rank's fatal-signal dump, or None if it did not die by one (newest file wins)."""
    folder = dump_dir(run_dir, rank)
    if not folder.is_dir():
        return None
    found = None
    for path in sorted(folder.glob(FATAL_PATTERN), key=_mtime):
        try:
            dump = parse_fatal_dump(path.read_text(errors="replace"))
        except OSError:
            continue
        found = dump or found
    return found


def parse_fatal_dump(text: str) -> FatalDump | None:
    """A ``FatalDump`` of faulthandler's output after our header; None if no fatal signal."""
    fatal = _FATAL.search(text)
    if fatal is None:
        return None
    name = SIGNAL_BY_TEXT.get(fatal[1].strip(), fatal[1].strip())
    stack = text[fatal.start():].strip()
    return FatalDump(name, stack, innermost_frames(text))


def innermost_frames(text: str) -> tuple[str, ...]:
    """The innermost frames of the thread that received the signal, or, when that thread
    has no Python frame (a C++ thread of gloo or NCCL), of the main thread: where training
    was when the process died (for a collective, the frame that issued it)."""
    header = _HEADER.search(text)
    main = header[1] if header else None
    blocks = thread_blocks(text)
    current = [frames for kind, _, frames in blocks if kind == "Current thread" and frames]
    on_main = [frames for _, ident, frames in blocks if ident == main and frames]
    frames = (current or on_main or [()])[0]
    return tuple(frames[:NUM_QUOTED_FRAMES])


def thread_blocks(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """faulthandler's thread blocks: (``Current thread`` or ``Thread``, id, frames innermost
    first); also read by ``stack_dumps`` for the stacks a watcher captures."""
    marks = list(_THREAD.finditer(text))
    blocks = []
    for index, mark in enumerate(marks):
        end = marks[index + 1].start() if index + 1 < len(marks) else len(text)
        frames = tuple(f"{m['func']} ({Path(m['path']).name}:{m['line']})"
                       for m in map(_FRAME.match, text[mark.end():end].splitlines()) if m)
        blocks.append((mark[1], mark[2], frames))
    return blocks


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def marker_detail(dump: FatalDump) -> str:
    """The ending's detail: the signal and the innermost frames, for one-line messages."""
    if not dump.innermost:
        return dump.signal
    return f"{dump.signal}; innermost frames: {', '.join(dump.innermost)}"
