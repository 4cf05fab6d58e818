"""How ``pytest -n N --dist loadfile`` hands out the suite: whole files, except the files of
many independent cases, whose tests are handed out one by one after every file.

Why: ``loadfile`` keeps a file's tests on one worker so its module fixtures (real recordings)
are made once. The hostile corpus is one file of 124 cases with no module fixture; whole, it
was one unit of about 5 minutes on one worker, and the run waited on it. One by one, and last,
its cases fill whichever worker the files leave idle, so the workers end together.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

# Files whose tests share no module-scoped setup: each test is a work unit of its own.
CASE_BY_CASE = ("tests/test_hostile_corpus.py",)


class FilesThenCases(LoadFileScheduling):
    """``loadfile``, with each test of ``CASE_BY_CASE`` a unit of its own. xdist queues units
    by how many tests they hold, most first, so these single tests go out after every file."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return nodeid if path.endswith(CASE_BY_CASE) else path
