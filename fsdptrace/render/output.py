"""Where a report goes: a path checked before any work, so a typo costs no analysis."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

from fsdptrace.errors import UsageError

STDOUT = "-"


def check_writable(path: str | os.PathLike[str]) -> None:
    """Refuse, with one line naming the fix, an output file that cannot be written.

    Checked before the run dir is read: an analysis of a large run must not end in "cannot
    write". The folder must exist (it is not created: a typo there is the usual cause).
    """
    if os.fspath(path) == STDOUT:
        return
    target = Path(path)
    if not os.fspath(path) or target.name in ("", ".", ".."):
        raise UsageError(f"cannot write {os.fspath(path)!r}: give a file name")
    if target.is_dir():
        raise UsageError(f"cannot write {target}: it is a directory; give a file name")
    folder = target.parent
    if not folder.exists():
        raise UsageError(f"cannot write {target}: folder {folder} does not exist (create it)")
    if not folder.is_dir():
        raise UsageError(f"cannot write {target}: {folder} is not a folder")
    writable = (os.access(target, os.W_OK) if target.exists()
                else os.access(folder, os.W_OK | os.X_OK))
    if not writable:
        raise UsageError(f"cannot write {target}: permission denied")


def write_page(path: str | os.PathLike[str], render: Callable[[TextIO], None]) -> None:
    """Render a page whole, then write it into ``path``, never holding it in memory.

    The page is rendered into a nameless scratch file in ``path``'s folder (the system's
    temporary folder if that one takes none); only once it is whole is ``path`` opened and the
    page copied in. So a render that fails leaves ``path`` as it was, ``path`` stays the file it
    was (its inode, owner, mode, ACLs, a symlink or a bind mount: it is written as before,
    not replaced), and a process killed while rendering leaves nothing behind (the scratch file
    has no name). A deep run's Chrome trace is gigabytes: it takes disk beside the target, not
    memory, twice its size while it is copied in. A copy cut short (a full disk, Ctrl-C) removes
    a file this call created; an existing file is then cut short, as any write cuts it. A
    device or a pipe (``/dev/null``, ``/dev/stdout``, a FIFO) is written as it is rendered.
    """
    if _is_stream(path):
        page = _Page(_open_bytes(path), encoding="utf-8")
        with _closing_quietly(page):
            _render_into(page, render, path)
        return
    scratch, folder = _scratch_file(Path(path).parent)
    if scratch is None:  # nowhere on disk: in memory, as small pages always could be
        memory = io.StringIO()
        render(memory)
        write_text(path, memory.getvalue())
        return
    page = _Page(scratch, encoding="utf-8")
    with _closing_quietly(page):
        _render_into(page, render, path, f" (while rendering it into a scratch file in {folder})")
        scratch.seek(0)
        created = not os.path.lexists(path)
        out = _open_bytes(path)
        try:
            with out:
                _copy(scratch, out)
        except BaseException as error:
            if created:
                _remove(path)
            if isinstance(error, OSError):
                raise _cannot_write(path, error) from None
            raise


def _remove(path: str | os.PathLike[str]) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


@contextlib.contextmanager
def _closing_quietly(page: _Page) -> Iterator[None]:
    """Close ``page`` at the end: its bytes are flushed already, or the write failed and
    closing would only fail again (and hide the one line saying why)."""
    try:
        yield
    finally:
        try:
            page.close()
        except OSError:
            pass


def _render_into(page: _Page, render: Callable[[TextIO], None],
                 path: str | os.PathLike[str], where: str = "") -> None:
    """``render`` into ``page``; failing to write it is bad input, any other error is not."""
    try:
        render(page)
        page.flush()
    except _PageWriteError as error:
        raise UsageError(f"cannot write {os.fspath(path)}: {error.strerror}{where}") from None


def _open_bytes(path: str | os.PathLike[str]) -> BinaryIO:
    try:
        return open(path, "wb")  # noqa: SIM115
    except OSError as error:
        raise _cannot_write(path, error) from None


def _cannot_write(path: str | os.PathLike[str], error: OSError) -> UsageError:
    return UsageError(f"cannot write {os.fspath(path)}: {error.strerror}")


def _is_stream(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is something other than a regular file: a device, a pipe, or a name
    under /dev or /proc (``/dev/stdout`` leads to whatever stdout is, a file too)."""
    if os.path.abspath(path).startswith(("/dev/", "/proc/")):
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


_COPY_BYTES = 1 << 20


def _copy(source: BinaryIO, target: BinaryIO) -> None:
    """``source`` from where it stands into ``target``, in the kernel where it can."""
    offset = source.tell()
    try:
        size = os.fstat(source.fileno()).st_size
        while offset < size:
            sent = os.sendfile(target.fileno(), source.fileno(), offset, size - offset)
            if not sent:
                break
            offset += sent
        if offset >= size:
            return
    except (AttributeError, io.UnsupportedOperation):
        pass
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSOCK):
            raise
    source.seek(offset)
    shutil.copyfileobj(source, target, _COPY_BYTES)


class _PageWriteError(OSError):
    """Writing the scratch file failed (a full disk): not an error of the render itself."""


class _Page(io.TextIOWrapper):
    """The scratch file as the text stream a renderer writes; its write errors are told apart
    from the render's own (an ``OSError`` reading the run dir is not "cannot write")."""

    def write(self, text: str) -> int:
        try:
            return super().write(text)
        except OSError as error:
            raise _PageWriteError(error.errno, error.strerror) from error

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as error:
            raise _PageWriteError(error.errno, error.strerror) from error


def _scratch_file(folder: Path) -> tuple[BinaryIO | None, str]:
    """A file with no name (``O_TMPFILE`` where the filesystem has it) in ``folder``, else in
    the system's temporary folder, and where it is; None where neither takes one."""
    for where in (os.fspath(folder), tempfile.gettempdir()):
        try:
            return tempfile.TemporaryFile(dir=where), where
        except OSError:
            continue
    return None, ""


def open_for_writing(path: str | os.PathLike[str]) -> TextIO:
    """Open ``path`` to write text; an ``OSError`` becomes one line of bad input."""
    try:
        return open(path, "w", encoding="utf-8")  # noqa: SIM115
    except OSError as error:
        raise _cannot_write(path, error) from None


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write a whole rendered page to ``path`` (an ``OSError`` is bad input)."""
    with open_for_writing(path) as out:
        try:
            out.write(text)
        except OSError as error:
            raise _cannot_write(path, error) from None
