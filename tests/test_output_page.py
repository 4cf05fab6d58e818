"""Where an output goes: rendered whole into a nameless scratch file, then copied into the
target, so a page is never held in memory, a failure never leaves half of one, and the target
stays the file it was.

Each test writes through ``output.write_page`` as every command writes a file, with a small
render that can be made to fail halfway.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path
from typing import BinaryIO, TextIO

import pytest

from fsdptrace.errors import UsageError
from fsdptrace.render import output

PAGE = "line one\nline two\n"


def render_page(out: TextIO) -> None:
    out.write(PAGE)


def render_half_then_fail(out: TextIO) -> None:
    out.write("half a page")
    out.flush()
    raise RuntimeError("a bug halfway through the page")


def test_a_new_file_gets_the_page_and_the_mode_open_gives(tmp_path: Path) -> None:
    target = tmp_path / "report.html"
    output.write_page(target, render_page)
    assert target.read_text() == PAGE and sorted(os.listdir(tmp_path)) == ["report.html"]
    plain = tmp_path / "opened"
    plain.write_text("")  # what open(path, "w") creates under this umask
    assert stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)


def test_an_existing_file_stays_the_same_file(tmp_path: Path) -> None:
    """Written in place, not replaced: its inode, mode and any hard link keep the page."""
    target = tmp_path / "trace.json"
    target.write_text("old, and longer than the page that replaces it")
    target.chmod(0o640)
    other = tmp_path / "hard-link.json"
    os.link(target, other)
    inode = target.stat().st_ino
    output.write_page(target, render_page)
    assert target.read_text() == PAGE == other.read_text()
    assert target.stat().st_ino == inode and stat.S_IMODE(target.stat().st_mode) == 0o640


def test_a_failed_render_leaves_the_old_file_and_no_half_page(tmp_path: Path) -> None:
    target = tmp_path / "trace.json"
    target.write_text("the previous export")
    with pytest.raises(RuntimeError):
        output.write_page(target, render_half_then_fail)
    assert target.read_text() == "the previous export"
    with pytest.raises(RuntimeError):
        output.write_page(tmp_path / "new.json", render_half_then_fail)
    assert sorted(os.listdir(tmp_path)) == ["trace.json"]


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path: Path) -> None:
    real = tmp_path / "real.html"
    real.write_text("old")
    link = tmp_path / "latest.html"
    link.symlink_to(real)
    output.write_page(link, render_page)
    assert link.is_symlink() and real.read_text() == PAGE


def test_a_fifo_gets_the_page_as_it_is_rendered(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        output.write_page(fifo, render_page)
        assert os.read(reader, 1024).decode() == PAGE
    finally:
        os.close(reader)
    assert sorted(os.listdir(tmp_path)) == ["pipe"]


def test_a_killed_writer_leaves_nothing_beside_the_target(tmp_path: Path) -> None:
    """The scratch file has no name: SIGKILL mid-render leaves no hidden gigabytes."""
    started = tmp_path / "started"
    folder = tmp_path / "out"
    folder.mkdir()

    def render_forever(out: TextIO) -> None:
        out.write("x" * (1 << 20))
        out.flush()
        started.write_text("")
        time.sleep(60)

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            output.write_page(folder / "trace.json", render_forever)
        finally:
            os._exit(1)
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert started.exists() and os.listdir(folder) == []


def test_a_write_error_is_one_line_of_bad_input_and_a_render_error_is_not(
        tmp_path: Path) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    with pytest.raises(UsageError, match="cannot write /dev/full: No space left on device"):
        output.write_page("/dev/full", render_page)

    def render_reading_a_missing_file(out: TextIO) -> None:
        (tmp_path / "absent").read_text()

    with pytest.raises(FileNotFoundError):  # a bug or bad input of its own, not the output's
        output.write_page(tmp_path / "out.json", render_reading_a_missing_file)


@pytest.mark.parametrize("cut", [OSError(28, "No space left on device"), KeyboardInterrupt()],
                         ids=["full-disk", "ctrl-c"])
def test_a_copy_cut_short_leaves_no_new_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             cut: BaseException) -> None:
    def half_then_cut(source: object, target: BinaryIO) -> None:
        target.write(b"half a page")
        raise cut

    monkeypatch.setattr(output, "_copy", half_then_cut)
    expected = UsageError if isinstance(cut, OSError) else KeyboardInterrupt
    with pytest.raises(expected, match="cannot write .*out.json: No space left on device"
                       if expected is UsageError else None):
        output.write_page(tmp_path / "out.json", render_page)
    assert os.listdir(tmp_path) == []


def test_a_name_under_dev_is_written_as_rendered(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/stdout may lead to a regular file: no scratch file in /dev (RAM, as root)."""
    monkeypatch.setattr(output, "_scratch_file", lambda folder: pytest.fail("a scratch file"))
    output.write_page(os.devnull, render_page)


def test_no_scratch_anywhere_falls_back_to_memory(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output, "_scratch_file", lambda folder: (None, ""))
    output.write_page(tmp_path / "out.txt", render_page)
    assert (tmp_path / "out.txt").read_text() == PAGE
