"""A clean install says nothing but what it did: no setuptools warnings, and a complete wheel.

Found by building: setuptools 84 warned once per build step (about 150 lines through
``make demo``'s pip) that ``fsdptrace.record.bootstrap``, ``fsdptrace.render.templates`` and
``fsdptrace.schemas`` are importable (namespace) packages absent from ``packages``, and that
a TOML-table ``license`` is deprecated. The wheel was complete all the same; these declare them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.jobs import REPO

# The data files the package reads at run time, beside its modules.
DATA_FILES = [
    "fsdptrace/py.typed",
    "fsdptrace/record/bootstrap/sitecustomize.py",
    "fsdptrace/render/templates/report.html.j2",
    "fsdptrace/render/templates/report.css",
    "fsdptrace/render/templates/report.js",
    "fsdptrace/schemas/analysis.schema.json",
    "fsdptrace/schemas/summary.schema.json",
    "fsdptrace/schemas/suggest.schema.json",
    "fsdptrace_cli/py.typed",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """Build log and file list of a wheel built from a copy of the sources (no build dirs)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(REPO / "fsdptrace", source / "fsdptrace", ignore=ignore)
    shutil.copytree(REPO / "cli", source / "cli", ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-v",
         "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    [wheel] = out.glob("fsdptrace-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return build.stdout + build.stderr, archive.namelist()


def test_building_the_wheel_warns_nothing(built: tuple[str, list[str]]) -> None:
    log, _ = built
    warnings = [line for line in log.splitlines()
                if "Warning" in line or "would be ignored" in line]
    assert warnings == []


def test_the_wheel_holds_every_data_file(built: tuple[str, list[str]]) -> None:
    _, names = built
    assert [name for name in DATA_FILES if name not in names] == []
    assert "fsdptrace_cli/commands/record.py" in names


def test_the_wheel_holds_every_module(built: tuple[str, list[str]]) -> None:
    """Each package is listed by hand in pyproject.toml: a folder left out installs fine in
    editable mode and is missing from the wheel (``fsdptrace.watch`` was, until this test)."""
    _, names = built
    modules = [str(p.relative_to(REPO)) for p in sorted((REPO / "fsdptrace").rglob("*.py"))]
    modules += [str(p.relative_to(REPO / "cli")) for p in sorted((REPO / "cli").rglob("*.py"))]
    assert [m for m in modules if m not in names] == []
