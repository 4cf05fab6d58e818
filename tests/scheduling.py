"""How ``pytest -n N --dist loadfile`` hands out the suite: whole files, except the files of
many independent cases, whose tests are handed out one by one after every file; with three
workers or more, one of them is a lane for the files that mostly wait.

Why: ``loadfile`` keeps a file's tests on one worker so its module fixtures (real recordings)
are made once. The hostile corpus is one file of 124 cases with no module fixture; whole, it
was one unit of about 5 minutes on one worker, and the run waited on it. One by one, and last,
its cases fill whichever worker the files leave idle, so the workers end together.

The waiting lane: on 2 cores, two workers left the CPUs idle about an eighth of the run, while
one of them waited on a job that hangs or sleeps on purpose; a plain third worker kept them
busy, but then three CPU-bound workers shared two cores and the timing tests flaked. So the
last worker takes the files that mostly wait first (``WAITING``), then the corpus's cases
(CPU-bound, but timed only against minutes), and other files only when nothing else is left;
the other workers take the long files of few tests first (``LONG``), then the other files, then
the cases, then the waiting files.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadFileScheduling

# Files whose tests share no module-scoped setup: each test is a work unit of its own.
CASE_BY_CASE = ("tests/test_hostile_corpus.py",)
# Files whose jobs mostly wait (a watched hang, a rank asleep, a pause), measured alone on an
# otherwise idle 2-core machine (CPU-seconds of the whole machine per second of the file):
# watch_jobs 0.40, verdict_jobs 0.59, full_disk 0.69. The job files that keep the CPUs busy use
# 1.1-1.7 (endings_jobs, kill_loop, recorder_failures, reliability_jobs).
WAITING = ("tests/test_watch_jobs.py", "tests/test_verdict_jobs.py", "tests/test_full_disk.py")
# Files of few tests that take long (seconds of one worker, measured in a full run on the 2-core
# box): xdist queues files by how many tests they hold, so these came out last and one ran
# alone at the end (kill_loop 28 s, 1 test). The CPU workers take them first.
LONG = ("tests/test_trainers_lightning.py",  # 66 s, 4 tests
        "tests/test_property.py",  # 54 s, 7
        "tests/test_trainers_accelerate.py",  # 45 s, 4
        "tests/test_spec.py",  # 41 s, 9
        "tests/test_hsdp_endings.py",  # 38 s, 7
        "tests/test_trainers_hf.py",  # 31 s, 3
        "tests/test_recorder_failures.py",  # 31 s, 5
        "tests/test_kill_loop.py")  # 28 s, 1
# The fewest workers with a waiting lane: with two, each is needed for CPU-bound work.
LANE_FROM_WORKERS = 3


class FilesThenCases(LoadFileScheduling):
    """``loadfile``, with each test of ``CASE_BY_CASE`` a unit of its own, handed out after
    every file (xdist queues units by how many tests they hold, most first, which would mix a
    file of one test in with the cases). With ``LANE_FROM_WORKERS`` workers or more, the last
    one is the waiting lane."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return nodeid if path.endswith(CASE_BY_CASE) else path

    def _assign_work_unit(self, node: Any) -> None:
        nodes = sorted(self.assigned_work, key=_worker_number)
        if len(nodes) < LANE_FROM_WORKERS:
            order = _files_then_cases
        else:
            order = _lane_order if node is nodes[-1] else _cpu_order
        preferred = min(self.workqueue, key=order)  # the first of the lowest: min is stable
        self.workqueue.move_to_end(preferred, last=False)  # the base pops the first unit
        return super()._assign_work_unit(node)


def _lane_order(scope: str) -> int:
    path = scope.split("::", 1)[0]
    return 0 if path.endswith(WAITING) else 1 if path.endswith(CASE_BY_CASE) else 2


def _files_then_cases(scope: str) -> int:
    return int(scope.split("::", 1)[0].endswith(CASE_BY_CASE))


def _cpu_order(scope: str) -> int:
    """The long files of few tests, the other files, the corpus's cases, the waiting files."""
    path = scope.split("::", 1)[0]
    return (3 if path.endswith(WAITING) else 2 if path.endswith(CASE_BY_CASE)
            else 0 if path.endswith(LONG) else 1)


def _worker_number(node: Any) -> int:
    """``gw2`` -> 2: workers are numbered in the order xdist started them."""
    return int(node.gateway.id.removeprefix("gw"))
