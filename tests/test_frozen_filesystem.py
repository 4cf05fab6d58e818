"""A frozen run-dir filesystem does not stop training, ``close()`` or the exit, and loses nothing.

A filesystem freeze (``fsfreeze``; what a stalled NFS or Lustre server does to writers) blocks
every write to it until the thaw. The recorder's hooks write into segments mapped from a private
tmpfs folder (``fsdptrace.store.journal_hot``), so they never touch the frozen filesystem; the
writer thread blocks there without Python's lock, ``close()`` gives up after ``close_timeout_s`` and
the process exits; after the thaw, the watchdog moves what was not written into the run dir.

Real: a loop-mounted ext4 frozen with ``fsfreeze -f``, which needs root and loop devices;
skipped where the machine has neither (the skip says which).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdptrace.store import journal_hot
from tests.jobs import start_ranks, wait_ranks
from tests.jobs_scripts.tables import read_folded

pytestmark = pytest.mark.slow


def _sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


@pytest.fixture
def loop_ext4(tmp_path: Path) -> Iterator[Path]:
    """A 64 MB ext4 mounted from a file; unfrozen and unmounted whatever the test does."""
    tools = [t for t in ("mkfs.ext4", "mount", "umount", "fsfreeze") if not shutil.which(t)]
    if tools:
        pytest.skip(f"needs {', '.join(tools)}")
    image, mount = tmp_path / "fs.img", tmp_path / "mnt"
    mount.mkdir()
    _sh("dd", "if=/dev/zero", f"of={image}", "bs=1M", "count=64")
    made = _sh("mkfs.ext4", "-q", str(image))
    mounted = _sh("mount", "-o", "loop", str(image), str(mount)) if made.returncode == 0 else made
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a loop ext4 here (root and loop devices needed): "
                    f"{mounted.stderr.strip()[:200]}")
    try:
        yield mount
    finally:
        _sh("fsfreeze", "-u", str(mount))
        for _ in range(50):
            if _sh("umount", str(mount)).returncode == 0:
                break
            time.sleep(0.2)


def test_close_and_exit_return_within_the_bound_and_nothing_is_lost(tmp_path: Path,
                                                                    loop_ext4: Path) -> None:
    out, run_dir = tmp_path / "out", loop_ext4 / "run"
    out.mkdir()
    procs = start_ranks(["tests/jobs_scripts/ending_job.py", "--out", str(out), "--run-dir",
                         str(run_dir), "--flush", "0.2", "frozen"], nproc=1)
    try:
        deadline = time.monotonic() + 120
        while not (out / "ready").exists() and time.monotonic() < deadline:
            assert procs[0].poll() is None, procs[0].communicate()
            time.sleep(0.05)
        time.sleep(0.5)  # the writer process has mirrored the open segments by now
        assert _sh("fsfreeze", "-f", str(loop_ext4)).returncode == 0
        frozen_at = time.monotonic()
        (out / "go").write_text("")  # two more steps, close, exit: all while frozen
        (result,) = wait_ranks(procs, timeout_s=60)
        exit_s = time.monotonic() - frozen_at
        assert _sh("fsfreeze", "-u", str(loop_ext4)).returncode == 0
    finally:
        _sh("fsfreeze", "-u", str(loop_ext4))
        for proc in procs:
            proc.kill()
    close_s = float((out / "close_s").read_text())
    print(f"frozen filesystem: close() {close_s:.2f} s, 2 steps + close + exit {exit_s:.2f} s")
    assert result.returncode == 0, result.output
    assert close_s < 2.0 + 1.0  # close_timeout_s=2, plus the seal
    assert exit_s < 15.0
    # The thaw lets the watchdog move the tail into the run dir; read the run dir alone.
    assert journal_hot.wait_salvaged(run_dir / "journal" / "rank=0", 30.0)
    with pytest.MonkeyPatch.context() as remote:
        remote.setenv(journal_hot.HOT_DIR_ENV, "off")
        events = read_folded(run_dir, "events", [0])
        markers = read_folded(run_dir, "markers", [0])
    assert sorted(set(events["step"])) == [0, 1, 2, 3]
    assert list(markers["kind"])[-1] == "close"
