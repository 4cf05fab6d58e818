"""Fatal signals are endings (CHECKS.md v3): a rank killed by SIGABRT says so, and where.

Real 2-rank FSDP2 jobs (gloo, CPU). Found by experiment on torch 2.13 / CPython 3.11:
``faulthandler`` writes every thread's stack from the C signal handler, then restores the
previous disposition and re-raises, so the rank still exits with -SIGABRT. A gloo size check
aborts from a C++ thread with no Python frame; the training stack is then the main thread's
(``innermost_frames`` picks it). The reader folds the dump in as the rank's ending.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import fsdptrace
from fsdptrace.reading import endings
from fsdptrace.store import fatal_signals
from tests.jobs import REPO, kill_all, run_ranks, start_ranks
from tests.jobs_scripts.tables import read_folded
from tests.test_endings_jobs import SCRIPT as ENDING_SCRIPT
from tests.test_endings_jobs import _wait_truth

pytestmark = pytest.mark.slow

FATAL_SCRIPT = REPO / "tests" / "jobs_scripts" / "records_fatal.py"


def _ending(run_dir: Path, rank: int) -> tuple[str, str]:
    found = endings.rank_endings(read_folded(run_dir, "markers", [0, 1]), [0, 1])
    row = found[found["rank"] == rank].iloc[0]
    return str(row["ending"]), str(row["detail"])


def test_sigabrt_inside_a_collective_is_an_ending_with_its_stack(tmp_path: Path) -> None:
    """Rank 1 sleeps inside ``layers.1``'s forward at step 2; rank 0 waits in the next FSDP
    collective and is sent SIGABRT there. Its ending names SIGABRT, its main thread's stack
    shows FSDP's all-gather that issued the collective, its exit status is -SIGABRT."""
    procs = start_ranks([ENDING_SCRIPT, "--out", str(tmp_path), "hang"])
    try:
        _wait_truth(tmp_path)
        procs[0].send_signal(signal.SIGABRT)
        procs[0].wait(timeout=60)
    finally:
        kill_all(procs)
    assert procs[0].returncode == -signal.SIGABRT
    run_dir = tmp_path / "run"
    ending, detail = _ending(run_dir, 0)
    assert ending == endings.FATAL_SIGNAL
    assert detail.startswith("SIGABRT; innermost frames: ")
    dump = fatal_signals.read_fatal_dump(run_dir, 0)
    assert dump is not None and dump.signal == "SIGABRT"
    assert "in foreach_all_gather" in dump.stack or "in wait_for_unshard" in dump.stack, dump.stack
    assert "in train" in dump.stack  # the training loop's frame, below FSDP's
    found = fsdptrace.analyze(run_dir).findings
    message = str(found.loc[(found["check"] == "stalled-rank") & (found["rank"] == 0),
                            "message"].iloc[0])
    assert "died by SIGABRT; innermost frames: " + ", ".join(dump.innermost) in message


def test_os_abort_in_training_code_names_the_frame(tmp_path: Path) -> None:
    """``os.abort()`` on rank 1's main thread: the innermost frame is ``planted_abort``, and the
    stalled-rank message quotes it; rank 1 exits -SIGABRT exactly as it would unrecorded."""
    results = run_ranks([str(FATAL_SCRIPT), "--out", str(tmp_path)], timeout_s=150)
    assert results[1].returncode == -signal.SIGABRT, results[1].output[-2000:]
    ending, detail = _ending(tmp_path, 1)
    assert ending == endings.FATAL_SIGNAL
    assert detail.startswith("SIGABRT; innermost frames: planted_abort (records_fatal.py:")
    found = fsdptrace.analyze(tmp_path).findings
    message = str(found.loc[(found["check"] == "stalled-rank") & (found["rank"] == 1),
                            "message"].iloc[0])
    assert "died by SIGABRT; innermost frames: planted_abort (records_fatal.py:" in message

