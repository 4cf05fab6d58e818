"""How a rank's recording ends: exit guards that record the ending without changing it.

A job must live and die as it would without fsdptrace:
- a signal's effect is never delayed. A rank blocked in a collective has its main thread inside
  C++, where no Python handler runs; CPython's C-level handler still writes the signal number
  to the wakeup fd, so a daemon watcher thread reads it at once, records *terminated*, makes it
  durable within a bound, and then lets the signal act: a default action is re-raised (the
  process dies by that signal, as torchrun and schedulers expect), a Python handler
  (SIGINT's ``KeyboardInterrupt``, a trainer's own) runs in the main thread as before;
- an exception leaving the training code records *crashed* (``sys.excepthook``; under
  ``mp.spawn``, which catches it and calls ``sys.exit(1)``, the part roots' ``always_call``
  forward hook stashes it for the exit handler's close);
- a fatal signal (SIGABRT, SIGSEGV...) is left to ``faulthandler`` (``fatal``), which writes
  every thread's stack to the run dir and lets the signal kill the process as before;
- a forked child records nothing and never writes to its parent's files.
The first ending recorded wins.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any

from fsdptrace.record import fatal, stack_dump

if TYPE_CHECKING:
    from fsdptrace.record.backends.base import RecorderView as Recorder  # recorder.py imports us

# How long the watcher waits for the terminated marker to reach the disk before letting the
# signal act: the scheduler's grace period is the job's, not ours.
SIGNAL_SYNC_TIMEOUT_S = 0.5
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_live: weakref.WeakSet[Recorder] = weakref.WeakSet()
_previous: dict[int, Any] = {}  # signal -> the disposition our Python handler replaced
_previous_excepthook: Any = None
_previous_wakeup_fd = -1
_pipe: tuple[int, int] | None = None
_installed = False
_lock = threading.Lock()


def install(rec: Recorder) -> None:
    """Guard ``rec``'s ending; the process-wide hooks are installed once, from the main thread."""
    _live.add(rec)
    fatal.install(rec)
    stack_dump.install(rec)
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed = True
    _install_excepthook()
    _install_signal_handlers()
    _install_watcher()


def remove(rec: Recorder) -> None:
    _live.discard(rec)
    fatal.remove(rec)
    stack_dump.remove(rec)


def live() -> list[Recorder]:
    return list(_live)


# --------------------------------------------------------------------- exceptions
def _install_excepthook() -> None:
    global _previous_excepthook
    _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook


def _excepthook(kind: type[BaseException], value: BaseException,
                tb: TracebackType | None) -> None:
    for rec in list(_live):
        with contextlib.suppress(Exception):
            rec.end_with_exception(value)
    previous = _previous_excepthook or sys.__excepthook__
    previous(kind, value, tb)


# --------------------------------------------------------------------- signals
def _install_signal_handlers() -> None:
    """SIGTERM/SIGHUP get a Python handler only where none would be lost (never over SIG_IGN);
    SIGINT keeps its handler: the watcher sees it through the wakeup fd all the same."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            current = signal.getsignal(sig)
            if current is signal.SIG_DFL or (callable(current) and current is not _on_signal):
                signal.signal(sig, _on_signal)
                _previous[sig] = current
        except (ValueError, OSError):
            pass


def _on_signal(signum: int, frame: Any) -> None:
    """The main thread's view of SIGTERM/SIGHUP: the watcher usually recorded it already."""
    record_terminated(signum)
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    else:
        _die_by(signum)


def record_terminated(signum: int) -> None:
    """Write *terminated* on every live recorder and wait, within a bound, for the disk."""
    name = signal.Signals(signum).name
    # Held through the sync: the other thread seeing the same signal waits for the disk too.
    with _lock:
        for rec in list(_live):
            if rec.end_with_signal(name):
                with contextlib.suppress(Exception):
                    rec.writer.sync(SIGNAL_SYNC_TIMEOUT_S)


def _die_by(signum: int) -> None:
    """The default action, from any thread: ``signal.signal`` works only in the main thread."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(signum, 0)  # SIG_DFL
    os.kill(os.getpid(), signum)


def _install_watcher() -> None:
    global _pipe, _previous_wakeup_fd
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        _previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(read_fd)
        os.close(write_fd)
        return
    _pipe = (read_fd, write_fd)
    threading.Thread(target=_watch, args=(read_fd,), name="fsdptrace-signals",
                     daemon=True).start()


def _watch(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if _previous_wakeup_fd >= 0:  # asyncio or a trainer listened there first
            with contextlib.suppress(OSError):
                os.write(_previous_wakeup_fd, data)
        for signum in data:
            if signum in HANDLED_SIGNALS:
                with contextlib.suppress(Exception):
                    record_terminated(signum)
                if _previous.get(signum, None) is signal.SIG_DFL:
                    _die_by(signum)
            else:
                with contextlib.suppress(Exception):
                    stack_dump.on_signal(signum)


# --------------------------------------------------------------------- exit and fork
def _close_all() -> None:
    for rec in list(_live):
        with contextlib.suppress(Exception):
            rec.close()


def _after_fork_in_child() -> None:
    """A forked child inherits recorders and their buffers: it must record and write nothing."""
    global _pipe
    fatal.forked_off()
    stack_dump.forked_off()
    for rec in list(_live):
        with contextlib.suppress(Exception):
            rec.forked_off()
    _live.clear()
    if _pipe is not None:
        # The pipe's reader is the parent's watcher: the child's signals are not its own.
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(_previous_wakeup_fd)
        for fd in _pipe:
            with contextlib.suppress(OSError):
                os.close(fd)
        _pipe = None


def stash_forward_exception(rec: Recorder) -> Any:
    """An ``always_call`` forward hook: it sees the exception unwinding through a part root."""
    ref = weakref.ref(rec)

    def part_forward_always(module: Any, args: Any, output: Any) -> None:
        if output is None:  # forward raised (or returned nothing): see which
            error = sys.exc_info()[1]
            recorder = ref()
            if error is not None and recorder is not None:
                recorder.stash_exception(error)

    return part_forward_always


atexit.register(_close_all)
os.register_at_fork(after_in_child=_after_fork_in_child)
