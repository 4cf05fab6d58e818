"""The mark a recorder leaves in a run dir it writes: which format, which launch.

A run dir used to be recognized by bare entry names (``meta``, ``events``, ``settings``...),
so a project folder with a ``settings/`` directory "held a recording", and ``record --force``
deleted the user's files. The mark says what is the recorder's own: ``--force`` and
``--append`` act on a marked run dir's recorder-named entries only. Its launch id also tells
one recording from the next written to the same path: hot journal folders (``journal_hot``)
are keyed by it, so a new recording never reads an old one's segments.

Light on purpose (json and os only): the recorder and ``fsdptrace record`` import it.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from fsdptrace.store.env import LAUNCH_ENV

RUN_MARK = "fsdptrace-run.json"
MARK_FORMAT = "fsdptrace-run-dir"
# A mark is a few dozen bytes; anything bigger is not ours and is not parsed.
_MAX_MARK_BYTES = 4096


def new_launch_id() -> str:
    """A launch id nobody else has: time first, so ids sort by when they began."""
    return f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(6)}"


def read_launch(run_dir: Path) -> str | None:
    """The launch id ``run_dir``'s mark names, or None (no mark, or not one fsdptrace wrote).

    Never follows a symlink: a mark that is a link is not the recorder's.
    """
    try:
        fd = os.open(run_dir / RUN_MARK, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        data = os.read(fd, _MAX_MARK_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > _MAX_MARK_BYTES:
        return None
    try:
        mark = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: brackets nested a thousand deep
        return None
    if not isinstance(mark, dict) or mark.get("format") != MARK_FORMAT:
        return None
    launch = mark.get("launch")
    return launch if isinstance(launch, str) and launch.isprintable() and launch else None


def is_marked(run_dir: Path) -> bool:
    return read_launch(run_dir) is not None


def write_mark(run_dir: Path, launch: str, *, replace: bool) -> str:
    """Mark ``run_dir`` as recorded by ``launch``; returns the launch the mark names.

    ``replace=False``: an existing mark wins (another rank of this launch wrote it first, or
    the run dir is being reused and the reader will say so), and its launch is returned. The
    file appears whole or not at all (written aside, then linked or renamed into place).
    """
    text = json.dumps({"format": MARK_FORMAT, "launch": launch, "pid": os.getpid(),
                       "created_ns": time.time_ns()})
    temp = run_dir / f".{RUN_MARK}.{os.getpid()}.{secrets.token_hex(3)}"
    try:
        temp.write_text(text + "\n")
        if replace:
            os.replace(temp, run_dir / RUN_MARK)
            return launch
        try:
            os.link(temp, run_dir / RUN_MARK)
            return launch
        except FileExistsError:
            return read_launch(run_dir) or launch
    finally:
        temp.unlink(missing_ok=True)


def mark_run_dir(run_dir: Path) -> str | None:
    """Mark ``run_dir`` as this launch's (``FSDPTRACE_LAUNCH``, set by ``fsdptrace record``,
    else a new id); returns the launch id its mark names (None: no mark).

    Another rank of this launch may have marked it first: its id wins. A mark that cannot be
    written (a full disk) does not stop recording: hot folders then go by the path alone, as
    readers will look for them.
    """
    launch = os.environ.get(LAUNCH_ENV) or new_launch_id()
    try:
        return write_mark(run_dir, launch, replace=False)
    except OSError:
        return read_launch(run_dir)
