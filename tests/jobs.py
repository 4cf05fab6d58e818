"""Launch real multi-process FSDP2 jobs (gloo, CPU) from tests, bounded in time.

Like ``torchrun --nproc-per-node N`` but without the elastic agent, so a test can SIGKILL
one rank, read each rank's output and always clean up what it started.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests import forkserver
from tests.forkserver import ForkedRank

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
# Set to a file to have every launch appended to it as a JSON line (which test, what script):
# how the suite's job count is measured (``FSDPTRACE_TEST_JOB_LOG=$PWD/jobs.jsonl make test``).
# Launches that do not go through here (tests running ``torchrun`` or ``fsdptrace record``
# themselves) are not logged.
JOB_LOG = "FSDPTRACE_TEST_JOB_LOG"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


def start_ranks(args: list[str], *, nproc: int = 2, env: dict[str, str] | None = None
                ) -> list[subprocess.Popen | ForkedRank]:
    """Start ``python ARGS...`` once per rank with torchrun's environment variables, each
    forked from the test process's fork server (``tests/forkserver.py``: torch imported once)
    where the environment allows it, else as a fresh interpreter."""
    log_launch(args, nproc)
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        rank_env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        forked = forkserver.launch([str(a) for a in args], env=rank_env, cwd=REPO)
        procs.append(forked or subprocess.Popen(
            [sys.executable, *args], env=rank_env, cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, preexec_fn=sigint_as_in_a_terminal))
    return procs


def sigint_as_in_a_terminal() -> None:
    """A rank takes SIGINT as one started from a terminal does: a shell without job control
    starts background commands with SIGINT ignored (``cmd &``, ``nohup``), and a Python that
    starts with it ignored never raises KeyboardInterrupt, so the SIGINT tests failed when
    the suite itself ran in the background."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def log_launch(args: list[str], nproc: int) -> None:
    """Append this launch to ``$FSDPTRACE_TEST_JOB_LOG`` when it is set (one line each)."""
    path = os.environ.get(JOB_LOG)
    if path:
        line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
                "args": [str(a) for a in args], "nproc": nproc}
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps(line) + "\n")


def wait_ranks(procs: list[subprocess.Popen], *, timeout_s: float = 120.0) -> list[RankResult]:
    """Wait for every rank; kill all of them if the deadline passes."""
    deadline = time.monotonic() + timeout_s
    results = []
    try:
        for rank, proc in enumerate(procs):
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                out, _ = proc.communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                kill_all(procs)
                out, _ = proc.communicate()
            results.append(RankResult(rank, proc.returncode, out))
    finally:
        kill_all(procs)
    return results


def kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_ranks(args: list[str], *, nproc: int = 2, env: dict[str, str] | None = None,
              timeout_s: float = 120.0) -> list[RankResult]:
    return wait_ranks(start_ranks(args, nproc=nproc, env=env), timeout_s=timeout_s)


def run_scenarios(out: Path, names: list[str], *, timeout_s: float = 180.0,
                  env: dict[str, str] | None = None) -> list[RankResult]:
    """Record ``examples/scenarios.py`` scenarios into ``out/<name>`` on 2 ranks."""
    return run_ranks([str(EXAMPLES / "scenarios.py"), "--out", str(out), *names],
                     env=env, timeout_s=timeout_s)


def case_result(run_dir: Path, rank: int) -> dict:
    """What a batched job script wrote for one case and rank (``result.rank<r>.json``)."""
    return json.loads((run_dir / f"result.rank{rank}.json").read_text())


def assert_ok(results: list[RankResult]) -> None:
    bad = [r for r in results if r.returncode != 0]
    assert not bad, "\n".join(f"rank {r.rank} exited {r.returncode}:\n{r.output}" for r in bad)


def how_terminated(stalled: dict[int, str]) -> dict[int, str]:
    """Per rank, how its stalled-rank message says a SIGTERM sent to every rank ended it:
    ``terminated``, ``peer gone`` or the message itself.

    A rank whose gloo wait sees its peer's connection close before its own signal is handled
    ends on that error instead (``peer gone``): a race real jobs have too, whichever way it
    goes here (on a loaded machine CI saw rank 1 crash so). At least one rank is terminated.
    """
    return {rank: "terminated" if "was terminated by SIGTERM" in m else
            "peer gone" if "crashed" in m and "Connection closed by peer" in m else m
            for rank, m in stalled.items()}
