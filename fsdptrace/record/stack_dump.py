"""Let a watcher take every thread's Python stack of a hung rank, and its Flight Recorder dump.

A hung rank's main thread usually waits inside C++ (a gloo or NCCL collective), where no
Python code runs until it returns, which it never does. A C-level signal handler still runs:
at attach the recorder registers ``faulthandler`` (``all_threads=True``) on a signal of its
own, writing to ``RUN_DIR/dumps/rank=<r>/signal-stacks-<pid>.txt``, opened now because a
signal handler can only write to a descriptor that is already open (names and format:
``fsdptrace.store.stack_dumps``). The watcher sends the signal; faulthandler writes the stacks at
once, from whichever thread the kernel picks, without Python's lock.

Then the Flight Recorder: its dump takes torch's locks and allocates, which a signal handler
must not. So faulthandler chains to CPython's own handler, which writes the signal's number
to the wakeup fd that ``guards``' signal thread already reads; that thread (never the
training thread) saves the dump (``flight_recorder.save``) and appends the end line the
watcher waits for. A handler that was there before keeps running: a Python one is called by
ours (in the main thread, when it next runs Python), a C one by faulthandler's chain.

The signal: ``SIGRTMIN+9`` by default, ``$FSDPTRACE_STACK_SIGNAL`` to choose another
(``SIGRTMIN+n``, ``SIGRTMAX-n``, a name or a number) or ``off``. Not SIGUSR1 or SIGUSR2:
Slurm's ``--signal=B:USR1@120`` warns a job before its time limit, Lightning's SLURM requeue
listens on SIGUSR1 (configurable to SIGUSR2), torchrun's ``--signals_to_handle`` names both as
Slurm's to forward to workers, and mpirun forwards them too. Not SIGQUIT: torchrun handles it
by default, and its default action dumps core. The real-time signals are unused by those;
glibc keeps the first two for itself (``SIGRTMIN`` already skips them), and profilers
that use real-time signals start at the low end (Scalene: ``SIGRTMIN+1`` to ``+5``;
async-profiler's alternates count up from ``SIGRTMIN``), so the default sits clear of them.
A real-time signal's default action is to terminate: ``chain`` is set only where a handler
exists to chain to, and at close our Python handler stays (calling nothing) where the
default was, so a signal racing the close cannot kill a rank that finished recording.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdptrace.errors import FsdptraceError
from fsdptrace.record import flight_recorder
from fsdptrace.store import fatal_signals, stack_dumps
from fsdptrace.store.full_writes import write_all

if TYPE_CHECKING:
    from fsdptrace.record.backends.base import RecorderView as Recorder

STACK_SIGNAL_ENV = "FSDPTRACE_STACK_SIGNAL"
DEFAULT_STACK_SIGNAL = "SIGRTMIN+9"

_fd: int | None = None
_owner: int | None = None  # id of the recorder whose rank the file belongs to
_signum = 0
_target: tuple[Path, int] | None = None  # (run dir, rank) for the Flight Recorder's dump
_previous: Any = None  # the Python-level disposition ours replaced (None: ours did not)


def configured_signal(setting: str | None = None) -> int | None:
    """The stack signal's number from ``setting`` (default ``$FSDPTRACE_STACK_SIGNAL``), or
    None when turned off or where the platform has no such signal."""
    text = (os.environ.get(STACK_SIGNAL_ENV, "") if setting is None else setting).strip()
    text = text or DEFAULT_STACK_SIGNAL
    if text.lower() in ("off", "0", "none"):
        return None
    name = text.upper().replace(" ", "")
    for base, sign in (("SIGRTMIN", 1), ("SIGRTMAX", -1)):
        if name.startswith(base):
            if not hasattr(signal, base):
                return None  # no real-time signals here (macOS): no stacks
            offset = name[len(base):] or "+0"
            if offset[0] in "+-" and offset[1:].isdigit() and (offset[0] == "+") == (sign > 0):
                number = getattr(signal, base) + int(offset)
                if signal.SIGRTMIN <= number <= signal.SIGRTMAX:
                    return number
            break
    else:
        if name.isdigit():
            return int(name)
        if hasattr(signal, name) and name.startswith("SIG") and "_" not in name:
            return int(getattr(signal, name))
    raise FsdptraceError(f"${STACK_SIGNAL_ENV}={text!r} is not a signal: use SIGRTMIN+<n>, "
                         "SIGRTMAX-<n>, a signal name or number, or off")


def install(rec: Recorder) -> None:
    """Register the stack signal for ``rec``'s rank (once per process: the first recorder)."""
    global _fd, _owner, _signum, _target
    if _fd is not None:
        return
    signum = configured_signal()
    if signum is None:
        return
    path = fatal_signals.dump_dir(rec.run_dir, rec.rank) / stack_dumps.LIVE_FILE.format(
        pid=os.getpid())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        write_all(fd, stack_dumps.LIVE_HEADER.format(
            rank=rec.rank, pid=os.getpid(), host=socket.gethostname(), signal=signum,
            start=process_start(os.getpid()), main=threading.main_thread().ident or 0).encode())
    except OSError:
        return  # an unwritable run dir: the writer reports it; the job runs on
    chain = _take_python_handler(signum)
    try:
        faulthandler.register(signum, file=fd, all_threads=True, chain=chain)
    except (ValueError, OSError, RuntimeError):
        _give_back_python_handler()
        os.close(fd)
        return
    _fd, _owner, _signum, _target = fd, id(rec), signum, (rec.run_dir, rec.rank)


def _take_python_handler(signum: int) -> bool:
    """Put our Python handler on ``signum`` (so CPython's C handler wakes the signal thread)
    and say whether faulthandler has a handler to chain to."""
    global _previous
    try:
        current = signal.getsignal(signum)
    except ValueError:
        return False
    if current is None or current is _on_python_signal:
        return True  # a handler installed outside Python (kept, chained to), or ours still
    if threading.current_thread() is not threading.main_thread():
        return current is not signal.SIG_DFL and current is not signal.SIG_IGN
    signal.signal(signum, _on_python_signal)
    _previous = current
    return True


def _on_python_signal(signum: int, frame: Any) -> None:
    """In the main thread, once it runs Python again: the handler that was there before."""
    if callable(_previous):
        _previous(signum, frame)


def _give_back_python_handler() -> None:
    """Restore the disposition ours replaced, except the default (see the module's note)."""
    global _previous
    if _previous is None or _previous is signal.SIG_DFL:
        return
    with contextlib.suppress(ValueError, OSError):
        signal.signal(_signum, _previous)
    _previous = None


def on_signal(signum: int) -> None:
    """On ``guards``' signal thread, after faulthandler wrote the stacks: save the Flight
    Recorder's dump (where it is on) and end the dump with the line the watcher waits for."""
    if _fd is None or signum != _signum or _target is None:
        return
    saved = flight_recorder.save(*_target)
    line = stack_dumps.END_LINE.format(
        flight_recorder=saved.name if saved is not None else stack_dumps.NO_FLIGHT_RECORDER)
    with contextlib.suppress(OSError):
        write_all(_fd, line.encode())


def remove(rec: Recorder) -> None:
    """At ``rec``'s close: unregister. The live file is left for the rank's writer process to
    remove if nothing was dumped into it (``drop_unused``): a close must not wait on the disk."""
    global _fd, _owner
    if _fd is None or _owner != id(rec):
        return
    with contextlib.suppress(ValueError, OSError, RuntimeError):
        faulthandler.unregister(_signum)
    _give_back_python_handler()
    with contextlib.suppress(OSError):
        os.close(_fd)
    _fd, _owner = None, None


def forked_off() -> None:
    """In a forked child: the parent's stack file is not its own."""
    global _fd, _owner
    if _fd is not None:
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            faulthandler.unregister(_signum)
        with contextlib.suppress(OSError):
            os.close(_fd)
        _fd, _owner = None, None


def process_start(pid: int) -> int:
    """``pid``'s start time in clock ticks since boot (0 where /proc cannot say)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def drop_unused(run_dir: os.PathLike[str] | str, rank: int, pid: int) -> None:
    """In the writer process, once the recording process ``pid`` is done with it: remove its
    live stack file if no dump was written into it (the watcher's captures are copies)."""
    path = fatal_signals.dump_dir(Path(run_dir), rank) / stack_dumps.LIVE_FILE.format(pid=pid)
    with contextlib.suppress(OSError):
        with open(path, "rb") as file:
            file.readline()
            if file.read(1):
                return
        path.unlink()
