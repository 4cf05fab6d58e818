"""Rank processes forked from one Python that imported torch already.

Every rank a test starts used to pay ``import torch`` and FSDP2 (about 2 CPU-seconds each, over
a hundred ranks a suite run) before doing anything. A fork server, started once per test
process, imports them and forks each rank from there; the rank then runs its script as
``python SCRIPT ARGS...`` would (``__main__``, ``sys.argv``, ``sys.path[0]``, its environment,
its working folder, stdout and stderr into the test's pipe, an uncaught exception or
KeyboardInterrupt ending it as the interpreter ends a script), so what a test observes of a
rank (output, exit status, signals, its writer process) is what a fresh interpreter gives.

A rank is started through ``ForkedRank``, which answers what tests ask of a
``subprocess.Popen`` (``pid``, ``returncode``, ``poll``, ``wait``, ``communicate``,
``send_signal``, ``kill``, ``terminate``, ``stdout``). The rank is the server's child, not the
test's: the server reaps it and sends its wait status over a socket kept for that rank.

An environment that differs from the server's in what torch or Python read while importing
(``TORCH*``, ``PYTORCH*``, ``OMP_*``, ``PYTHON*``, ...) cannot be honoured by a fork, and
``launch`` says so by returning ``None``: the caller then starts a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# Set to 0 to start every rank as a fresh interpreter (to compare, or to rule the server out).
ENABLED = "FSDPTRACE_TEST_FORKSERVER"
# Read by torch, numpy or Python while importing: a rank asking for other values than the
# server's needs a fresh interpreter.
IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "OMP_", "MKL_", "OPENBLAS", "PYTHON", "LD_",
                        "CUDA", "KMP_", "GLOO", "NCCL", "MALLOC", "TRITON")
_STATUS = struct.Struct("!i")
_ANNOUNCE = struct.Struct("!i")


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


# ------------------------------------------------------------------------------ the test side
class ForkedRank:
    """A rank forked by the server, answering as much of ``subprocess.Popen`` as tests use."""

    def __init__(self, pid: int, stdout_fd: int, status: socket.socket, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.stdout = os.fdopen(stdout_fd, "r", encoding="utf-8", errors="replace")
        self._status = status
        self._output: list[str] = []

    def poll(self) -> int | None:
        if self.returncode is None:
            self._status.settimeout(0)
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._status.settimeout(timeout)
            self._read_status(timeout)
        assert self.returncode is not None
        return self.returncode

    def _read_status(self, timeout: float | None = 0) -> None:
        try:
            data = self._status.recv(_STATUS.size, socket.MSG_WAITALL)
        except (BlockingIOError, TimeoutError):
            if timeout:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            return
        if len(data) != _STATUS.size:  # the server died without reporting: say so loudly
            raise RuntimeError(f"fork server lost rank {self.pid}")
        status = _STATUS.unpack(data)[0]
        self.returncode = os.waitstatus_to_exitcode(status)
        self._status.close()

    def communicate(self, input: Any = None, timeout: float | None = None
                    ) -> tuple[str, None]:
        """Read stdout to its end and wait, as ``Popen.communicate`` does (text mode, stderr
        merged into stdout); output read before a timeout is kept for the next call."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.stdout.closed:
            fd = self.stdout.fileno()
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                while True:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise subprocess.TimeoutExpired(self.args, timeout)
                    if not sel.select(left):
                        continue
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        break
                    self._output.append(chunk.decode("utf-8", errors="replace"))
            self.stdout.close()
        left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
        self.wait(left)
        return "".join(self._output), None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _Server:
    """The fork server of this test process, started on first use."""

    def __init__(self) -> None:
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.control = ours
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", str(theirs.fileno())],
            env=self.env, cwd=REPO, stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()])
        theirs.close()

    def launch(self, args: list[str], env: dict[str, str], cwd: Path) -> ForkedRank | None:
        if self.process.poll() is not None or not _runnable(args):
            return None
        if _import_time_env(env) != _import_time_env(self.env):
            return None
        read_end, write_end = os.pipe()
        mine, sent = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = json.dumps({"args": args, "env": env, "cwd": str(cwd)}).encode()
        try:
            socket.send_fds(self.control, [_ANNOUNCE.pack(len(request)), request],
                            [write_end, sent.fileno()])
            pid = _ANNOUNCE.unpack(mine.recv(_ANNOUNCE.size, socket.MSG_WAITALL))[0]
        finally:
            os.close(write_end)
            sent.close()
        return ForkedRank(pid, read_end, mine, args)


def _runnable(args: list[str]) -> bool:
    """``SCRIPT ARGS...`` or ``-m MODULE ARGS...``: what the server knows how to run."""
    if args and args[0] == "-m":
        return len(args) > 1
    return bool(args) and not args[0].startswith("-") and Path(args[0]).is_file()


_server: _Server | None = None


def launch(args: list[str], *, env: dict[str, str], cwd: Path) -> ForkedRank | None:
    """Fork ``python ARGS...`` from this test process's server, or ``None`` where a fresh
    interpreter is needed (the server is off or gone, or the environment asks for it)."""
    global _server
    if os.environ.get(ENABLED, "1") == "0":
        return None
    if _server is None:
        _server = _Server()
    return _server.launch(args, env=env, cwd=cwd)


# ----------------------------------------------------------------------------- the server side
class _BecomeRank(Exception):
    """Raised in a forked child to leave the server's loop and run the rank's script."""

    def __init__(self, request: dict[str, Any]):
        super().__init__()
        self.request = request


def _serve(control: socket.socket) -> None:
    """Fork one rank per request; report each rank's wait status on its own socket."""
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    status_of: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ, "control")
    sel.register(wakeup_r, selectors.EVENT_READ, "child")
    while True:
        for key, _ in sel.select():
            if key.data == "child":
                os.read(wakeup_r, 4096)
                _reap(status_of)
                continue
            request, fds = _receive(control)
            if request is None:
                return  # the test process is gone
            stdout_fd, status_fd = fds
            status = socket.socket(fileno=status_fd)
            pid = os.fork()
            if pid == 0:
                for sock in (control, *status_of.values()):
                    sock.close()
                sel.close()
                os.close(wakeup_r)
                os.close(wakeup_w)
                signal.set_wakeup_fd(-1)
                status.close()
                request["stdout_fd"] = stdout_fd
                raise _BecomeRank(request)
            os.close(stdout_fd)
            status.sendall(_ANNOUNCE.pack(pid))
            status_of[pid] = status
        _reap(status_of)


def _receive(control: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    header, fds, _, _ = socket.recv_fds(control, _ANNOUNCE.size, 2)
    if len(header) < _ANNOUNCE.size:
        return None, []
    size = _ANNOUNCE.unpack(header)[0]
    body = b""
    while len(body) < size:
        chunk = control.recv(size - len(body))
        if not chunk:
            return None, []
        body += chunk
    return json.loads(body), list(fds)


def _reap(status_of: dict[int, socket.socket]) -> None:
    while status_of:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = status_of.pop(pid, None)
        if sock is not None:
            try:
                sock.sendall(_STATUS.pack(status))
            except OSError:
                pass  # the test gave up on this rank
            sock.close()


def _become(request: dict[str, Any]) -> None:
    """Turn this forked child into ``python ARGS...`` run in the request's folder."""
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                      else signal.SIG_DFL)
    fd = request["stdout_fd"]
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    args = request["args"]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = str(Path(args[0]).resolve().parent)
        runpy.run_path(args[0], run_name="__main__")


def _main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    import numpy  # noqa: F401  what every rank imports, imported once here
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  fully_shard's first call imports it: 0.9 CPU-s a rank
    import torch.distributed  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.nn  # noqa: F401
    try:
        _serve(control)
    except _BecomeRank as become:
        request = become.request
    else:
        sys.exit(0)
    _become(request)  # outside the handler: the script's exceptions get no context from it


if __name__ == "__main__":
    _main()
