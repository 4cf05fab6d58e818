"""Record a death by SIGABRT, SIGSEGV, SIGBUS, SIGFPE or SIGILL, with every thread's stack.

No Python handler runs for these (``abort()`` re-raises when a handler returns), so the
recorder hands them to ``faulthandler``: at start it opens ``RUN_DIR/dumps/rank=<r>/
fatal-<pid>.txt`` and enables ``faulthandler`` on it with ``all_threads=True``. From the signal
handler, faulthandler writes each thread's Python stack to that file, restores the handler it
replaced and re-raises the signal: the process dies by the same signal, with the same exit
status, as without fsdptrace. The reader turns the file into the rank's ending
(``fsdptrace.store.fatal_signals``). Nothing runs on the training thread after start.

Python has one faulthandler file per process. One enabled before us (``python -X
faulthandler``, ``PYTHONFAULTHANDLER``, torchelastic's ``@record``, all writing to stderr) is
taken over while recording and given back, to stderr, at close; the stack it would have
printed is in the run dir instead. A forked child (a DataLoader worker) must not write its
crash into its parent's file: it gets the previous state back.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
from typing import IO, TYPE_CHECKING

from fsdptrace.store import fatal_signals

if TYPE_CHECKING:
    from fsdptrace.record.backends.base import RecorderView as Recorder  # recorder.py imports us

_file: IO[str] | None = None
_owner: int | None = None  # id of the recorder whose rank the file belongs to
_previously_enabled = False


def install(rec: Recorder) -> None:
    """Point faulthandler at ``rec``'s dump file (once per process: the first recorder)."""
    global _file, _owner, _previously_enabled
    if _file is not None:
        return
    folder = fatal_signals.dump_dir(rec.run_dir, rec.rank)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        file = open(folder / fatal_signals.FATAL_FILE.format(pid=os.getpid()), "w")  # noqa: SIM115
        file.write(fatal_signals.HEADER.format(rank=rec.rank, pid=os.getpid(),
                                               main=threading.main_thread().ident or 0))
        file.flush()
    except OSError:
        return  # an unwritable run dir: the writer reports it; the job runs on
    _previously_enabled = faulthandler.is_enabled()
    faulthandler.enable(file=file, all_threads=True)
    _file, _owner = file, id(rec)


def remove(rec: Recorder) -> None:
    """At ``rec``'s close: give faulthandler back. The dump file, which nothing wrote to, is
    removed by the rank's writer process when it finishes (``drop_unused``): an unlink on a
    stalled run-dir filesystem would block the training process's exit."""
    global _file, _owner
    if _file is None or _owner != id(rec):
        return
    _restore()
    with contextlib.suppress(OSError):
        _file.close()
    _file, _owner = None, None


def forked_off() -> None:
    """In a forked child: its fatal signals are its own, not its parent's rank's."""
    global _file, _owner
    if _file is not None:
        _restore()
        _file, _owner = None, None  # the parent's file object: never closed or removed here


def _restore() -> None:
    faulthandler.disable()
    if _previously_enabled:
        with contextlib.suppress(Exception):
            faulthandler.enable(file=sys.stderr, all_threads=True)


def drop_unused(run_dir: os.PathLike[str] | str, rank: int, pid: int) -> None:
    """In the writer process, once the recording process ``pid`` is done with it: remove its
    dump file if no fatal signal was written into it."""
    from pathlib import Path

    path = fatal_signals.dump_dir(Path(run_dir), rank) / fatal_signals.FATAL_FILE.format(pid=pid)
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if fatal_signals.parse_fatal_dump(path.read_text()) is None:
            path.unlink()
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # empty unless a Flight Recorder dump lies beside it
