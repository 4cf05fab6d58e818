"""Where a report goes: a path checked before any work, so a typo costs no analysis."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

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


def open_for_writing(path: str | os.PathLike[str]) -> TextIO:
    """Open ``path`` to write text; an ``OSError`` becomes one line of bad input."""
    try:
        return open(path, "w", encoding="utf-8")  # noqa: SIM115
    except OSError as error:
        raise UsageError(f"cannot write {os.fspath(path)}: {error.strerror}") from None


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write a whole rendered page to ``path`` (an ``OSError`` is bad input)."""
    with open_for_writing(path) as out:
        try:
            out.write(text)
        except OSError as error:
            raise UsageError(f"cannot write {os.fspath(path)}: {error.strerror}") from None
