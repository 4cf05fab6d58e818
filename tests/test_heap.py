"""Freed memory kept for the next batch while an analysis runs (``analysis.heap``).

A batch's worth of blocks (10 x 16 MiB) freed and built again, in a fresh interpreter (glibc
adjusts its thresholds as a process frees, so the test process's own history would decide):
glibc's defaults give the freed memory back and the second batch faults thousands of fresh
pages in; inside ``freed_memory_kept`` it reuses them. Elsewhere than glibc nothing changes.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from fsdptrace.analysis import heap

_PROBE = """
import resource, sys
import numpy as np
from fsdptrace.analysis import heap

def second_batch_faults():
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [np.ones(2 << 20) for _ in range(10)]
        del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

if sys.argv[1] == "kept":
    with heap.freed_memory_kept():
        print(second_batch_faults())
else:
    print(second_batch_faults())
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True,
                          text=True, timeout=60, check=True)
    return int(done.stdout)


@pytest.mark.skipif(heap._glibc() is None, reason="glibc's malloc only")
def test_a_freed_batch_is_reused_without_page_faults() -> None:
    kept, default = _faults("kept"), _faults("default")
    assert kept < 500 and default > 10 * max(kept, 100), (kept, default)


def test_without_glibc_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_glibc", lambda: None)
    with heap.freed_memory_kept():
        heap.keep_freed_memory()
