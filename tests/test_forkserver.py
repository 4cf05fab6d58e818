"""A rank forked by the test fork server answers as a fresh ``python SCRIPT`` does.

Every real-job test starts its ranks through ``tests/forkserver.py``; what those tests observe
(output, exit status, a signal's ending, argv, environment, working folder, ``__main__``)
must not depend on it. Each case runs once forked and once as a fresh interpreter.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forkserver
from tests.jobs import sigint_as_in_a_terminal

SCRIPT = """\
import os, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("CASE_VALUE"),
      "main", __name__, "path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
case = sys.argv[1]
if case == "raise":
    raise ValueError("boom")
if case == "exit":
    sys.exit(3)
if case == "wait":
    print("ready", flush=True)
    time.sleep(60)
"""


def _start(script: Path, case: str, cwd: Path, *, forked: bool
           ) -> subprocess.Popen | forkserver.ForkedRank:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CASE_VALUE": case}
    if forked:
        rank = forkserver.launch([str(script), case], env=env, cwd=cwd)
        assert rank is not None, "the fork server refused a plain script"
        return rank
    # As tests/jobs.py starts a rank that is not forked: a worker whose SIGINT is ignored (a
    # suite started in the background) would pass that on, and the fresh rank would sleep on
    # through the SIGINT case (seen once in CI, 60 s and a timeout).
    return subprocess.Popen([sys.executable, str(script), case], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=sigint_as_in_a_terminal)


def _ending(proc: subprocess.Popen | forkserver.ForkedRank, case: str) -> tuple[int, str]:
    if case in ("sigint", "sigkill"):
        assert proc.stdout is not None and proc.stdout.readline().startswith("argv")
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT if case == "sigint" else signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    # The forked traceback has the server's frames above the script's; the last lines agree.
    return proc.returncode, out.strip().splitlines()[-1] if out.strip() else ""


@pytest.mark.parametrize("case", ["ok", "raise", "exit", "sigint", "sigkill"])
def test_a_forked_rank_ends_as_a_fresh_interpreter(case: str, tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    arg = "wait" if case in ("sigint", "sigkill") else case
    fresh = _ending(_start(script, arg, tmp_path, forked=False), case)
    forked = _ending(_start(script, arg, tmp_path, forked=True), case)
    assert forked == fresh
    assert fresh[0] == {"ok": 0, "raise": 1, "exit": 3, "sigint": -2, "sigkill": -9}[case]


def test_an_environment_read_at_import_gets_a_fresh_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    assert forkserver.launch([str(script), "ok"], env=env, cwd=tmp_path) is None
