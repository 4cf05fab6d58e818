"""``make demo``'s first screen says what it shows: a planted bug, where, and the clean run."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.jobs import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def demo_lines(*args: str) -> list[str]:
    """What ``make demo`` prints before the job starts (its setup already done: -n, and the
    setup targets are not run)."""
    out = subprocess.run(["make", "-s", "-n", "-o", ".venv/bin/fsdptrace", "-o", "setup",
                          "demo", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_first_lines_say_the_bug_is_planted_where_and_how_to_see_it_fixed() -> None:
    lines = demo_lines()
    banner = " ".join(line for line in lines if line.startswith("echo "))
    assert "PLANTED prefetch bug" in banner
    assert "make demo DEMO_ARGS=--fixed" in banner
    # The line it names is the planted one.
    number, code = re.search(r"line (\d+): (\S+\(\[\S+\]\))", banner).groups()
    script = (REPO / "examples" / "train_tiny.py").read_text().splitlines()
    assert code in script[int(number) - 1]
    assert "planted" in script[int(number) - 1]
    assert lines[0].startswith("echo ")  # before anything else runs
    readme = (REPO / "README.md").read_text()
    assert f"line {number}:\n`{code}`" in readme  # the README's top says the same
    assert "make demo DEMO_ARGS=--fixed" in readme


def test_the_demo_lets_the_job_s_status_stand_and_fixed_says_ok() -> None:
    record = next(line for line in demo_lines() if "fsdptrace record" in line)
    assert "--fail-on" not in record  # record keeps the job's status on its own now
    fixed = demo_lines("DEMO_ARGS=--fixed")
    assert "expect OK" in fixed[0]
    assert any(line.rstrip().endswith("train_tiny.py --fixed") for line in fixed)
