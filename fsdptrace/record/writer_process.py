"""The writer process: ``python -m fsdptrace.record.writer_process`` (``record.writer``).

It builds the ``PartWriter`` (``record.part_writer`` says what is written where and why),
settles the hot folders that dead recordings left on this host (``record.hot_sweep``), then
serves its recorder's flushes until ``close`` (``serve``). Its own module because the sweep
converts with a ``PartWriter`` too: started from ``part_writer``, the two modules imported
each other.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fsdptrace.record import fatal, hot_sweep, stack_dump
from fsdptrace.record.part_writer import PartWriter
from fsdptrace.store import journal_hot
from fsdptrace.store.full_writes import write_all


def _sweep_stale() -> None:
    try:
        hot_sweep.sweep()
    except Exception:  # noqa: BLE001 - others' leftovers must never stop this recording
        pass


def _say(line: str) -> None:
    try:
        write_all(1, (line.replace("\n", " ") + "\n").encode())
    except OSError:
        pass  # the recorder is gone: nobody to tell


def _watch_parent(parent: int) -> int | None:
    """A descriptor readable once ``parent`` has ended (Linux pidfd), or None: poll instead."""
    try:
        return os.pidfd_open(parent)
    except (AttributeError, OSError):
        return None


def serve(writer: PartWriter, parent: int, interval_s: float, *, failed: str | None = None
          ) -> None:
    """Write until told ``close`` or until the recording process ends; then finish.

    ``failed``: what went wrong already (then nothing more is converted). At the end, after a
    failure, the segments go to the run dir's journal if they can, and the rows that cannot
    are said there (``PartWriter.salvage``).
    """
    pidfd = _watch_parent(parent)
    watched = [0] + ([pidfd] if pidfd is not None else [])
    pending = b""
    closing = parent_gone = False
    next_pass = time.monotonic() + interval_s
    while not (closing or parent_gone):
        ready, _, _ = select.select(watched, [], [], max(0.0, next_pass - time.monotonic()))
        flush = time.monotonic() >= next_pass
        if 0 in ready:
            chunk = os.read(0, 4096)
            pending += chunk
            if not chunk:  # the recorder's end of the pipe closed: it is going
                watched.remove(0)
                parent_gone = pidfd is None or not watched
            *lines, pending = pending.split(b"\n")
            closing = b"close" in lines
            if b"flush" in lines and not failed:  # an optimizer boundary: parts, not mirrors
                failed = _attempt(writer.convert_filled)
        if pidfd is not None and pidfd in ready:
            parent_gone = True
        if pidfd is None and os.getppid() != parent:
            parent_gone = True
        if flush:
            if not failed:
                failed = _attempt(writer.flush)
            # Also after a failure: a pass time left in the past would spin this loop.
            next_pass = time.monotonic() + interval_s
            _say("alive")  # the recorder's supervision: silence means stopped or stuck
    failed = failed or _attempt(writer.finish)
    if failed:
        writer.salvage(failed)
    stack_dump.drop_unused(writer.run_dir, writer.rank, parent)
    fatal.drop_unused(writer.run_dir, writer.rank, parent)  # last: it removes an empty folder
    _say("done")


def _attempt(work: Callable[[], None]) -> str | None:
    """Run one pass; a failure is said once (the recorder disables itself) and not raised.
    Returns what failed (``"Type: message"``), or None."""
    try:
        work()
        return None
    except Exception as error:  # noqa: BLE001 - said to the recorder, which warns once
        said = f"{type(error).__name__}: {error}"
        _say(f"error {said}")
        return said


def main(argv: list[str] | None = None) -> int:
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    parser = argparse.ArgumentParser(description="fsdptrace's writer process (internal)")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--writer-id", required=True)
    parser.add_argument("--segment-dir", type=Path, required=True)
    parser.add_argument("--interval", type=float, required=True)
    args = parser.parse_args(argv)
    writer = PartWriter(args.run_dir, rank=args.rank, version=args.version,
                        writer_id=args.writer_id, segment_dir=args.segment_dir)
    writer.on_part = lambda size: _say(f"wrote {size}")
    journal_hot.reserve_room(writer.journal_dir, writer.writer_id)  # first: the disk may fill
    failed = _attempt(writer.write_empty_tables)
    _sweep_stale()
    serve(writer, args.parent, args.interval, failed=failed)
    return 0


class _WithoutPandas:
    """An import finder that answers "not installed" for pandas.

    pyarrow, installed beside pandas, imports it at the first ``pa.array`` or ``pa.table`` to
    ask whether its input is a pandas object: 0.2 CPU-s and tens of MB in every writer process,
    which makes none. Refused, the import raises ``ModuleNotFoundError`` and pyarrow carries on
    as it does where pandas is not installed. (``None`` in ``sys.modules`` is not enough:
    pyarrow's compiled import takes the ``None`` for the module.)
    """

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] == "pandas":
            raise ModuleNotFoundError("the writer process does without pandas", name=name)


if __name__ == "__main__":
    sys.meta_path.insert(0, _WithoutPandas())
    sys.exit(main())
