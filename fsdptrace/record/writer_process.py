"""The writer process's start: ``python -m fsdptrace.record.writer_process`` (``record.writer``).

It builds the ``PartWriter`` (``record.part_writer`` says what is written where and why),
settles the hot folders that dead recordings left on this host (``record.hot_sweep``), then
serves its recorder's flushes until ``close``. Its own module because the sweep converts with a
``PartWriter`` too: started from ``part_writer``, the two modules imported each other.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from fsdptrace.record import hot_sweep
from fsdptrace.record.part_writer import PartWriter, _attempt, _say, serve  # one process
from fsdptrace.store import journal_hot


def _sweep_stale() -> None:
    try:
        hot_sweep.sweep()
    except Exception:  # noqa: BLE001 - others' leftovers must never stop this recording
        pass


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
    failed = not _attempt(writer.write_empty_tables)
    _sweep_stale()
    serve(writer, args.parent, args.interval, failed=failed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
