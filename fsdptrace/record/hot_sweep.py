"""Settle hot journal folders whose recording processes are all gone.

A job killed together with its writer processes (a cgroup kill, the OOM killer taking the
job, a node-level kill) leaves its segments in ``/dev/shm``; nothing else would ever remove
them. A folder is stale when the exclusive lock on its owner file can be taken: the rank and
every writer process it started held a shared one (``journal_hot.claim``). Then:

- its run dir still holds that recording (same launch in the mark): its rows are converted
  into the run dir (Parquet parts, by the writer id that wrote them; what cannot be converted
  is moved into the run dir's journal), then the folder goes;
- the run dir is gone, or now holds another recording (``rm -rf``, ``record --force``): its
  rows belong to nothing anyone can read; the folder goes.

Run by every writer process when it starts (the next recorder on that host) and by
``fsdptrace record`` before it launches. Never raises for one folder: others' leftovers must
not stop a recording.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from fsdptrace.store import journal_hot
from fsdptrace.store.journal_format import SEGMENT_NAME
from fsdptrace.store.run_mark import read_launch

log = logging.getLogger("fsdptrace")


def sweep() -> list[Path]:
    """Settle every stale hot folder of this user on this host; returns those removed."""
    root = journal_hot.hot_root()
    try:
        if root is None or not journal_hot.is_private(root):
            return []
        folders = sorted(root.iterdir())
    except OSError:
        return []  # no root yet, or not one to trust
    removed = []
    for folder in folders:
        try:
            if not journal_hot.is_private(folder):
                continue
        except OSError:
            continue
        held = journal_hot.lock_if_stale(folder)
        if held is None:
            continue
        fd, owner = held
        try:
            if settle(folder, owner):
                removed.append(folder)
        except Exception as error:  # noqa: BLE001 - one odd folder must not stop the rest
            log.debug("fsdptrace: could not settle %s: %s", folder, error)
        finally:
            os.close(fd)
    return removed


def settle(folder: Path, owner: dict[str, Any]) -> bool:
    """Move a stale folder's rows where they belong, then remove it; True if it is gone."""
    journal = Path(str(owner.get("journal", "")))
    run_dir = journal.parent.parent
    rank, version = owner.get("rank"), owner.get("version")
    ours = (journal.is_absolute() and run_dir.is_dir()
            and read_launch(run_dir) == owner.get("launch")
            and type(rank) is int and isinstance(version, str))
    if ours:
        from fsdptrace.record.part_writer import PartWriter  # pyarrow: only when there is work

        assert isinstance(rank, int) and isinstance(version, str)
        for writer_id in _writers(folder):
            writer = PartWriter(run_dir, rank=rank, version=version, writer_id=writer_id,
                                segment_dir=folder)
            try:
                writer.finish()
            except Exception:  # noqa: BLE001 - then as segments, which the reader folds in
                writer.salvage()
        if journal_hot.segment_files(folder):
            return False  # some could not be written: kept for the next sweep
    for path in journal_hot.segment_files(folder):
        path.unlink(missing_ok=True)
    journal_hot.remove_if_empty(folder)
    return not folder.exists()


def _writers(folder: Path) -> list[str]:
    found = set()
    for path in journal_hot.segment_files(folder):
        match = SEGMENT_NAME.match(path.name)
        if match:
            found.add(match["writer"])
    return sorted(found)
