"""What the watcher costs per poll: CPU seconds of ``Probe.poll`` at 2, 64 and 1,024 ranks.

Each rank gets a journal folder of live segments written by the recorder's own journal code
(``record.journal.open_table``: every table a rank writes, a step's rows in each), in the
run dir (what a watcher on another host reads: the mirror). Two polls are timed: *quiet*
(nothing new anywhere: the cost of leaving the watcher on) and *busy* (every rank added a
micro-step's events and a marker since the last poll, the most a poll ever reads).

    python benchmarks/watch_poll.py [--ranks 2,64,1024] [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table  # noqa: E402

from fsdptrace.record.journal import FixedTable, FramedTable, Table, open_table  # noqa: E402
from fsdptrace.store import schema  # noqa: E402
from fsdptrace.store.journal_format import FIXED_TABLES, JOURNAL_DIR, dictionary_columns  # noqa: E402
from fsdptrace.watch.probe import Probe  # noqa: E402

UNITS = 48
WRITER = "j1_000000001"


def _fail(error: BaseException) -> None:
    raise error


def _row(table: str, seq: int) -> tuple:
    """A row of ``table`` (codes 0 for dictionary columns), its ``seq`` first where it has one."""
    fields = schema.TABLES[table]
    values: list[object] = []
    for field in fields:
        if field.name in ("seq", "t_ns"):
            values.append(seq if field.name == "seq" else time.monotonic_ns())
        elif table not in FIXED_TABLES and str(field.type).startswith("dictionary"):
            values.append("forward" if field.name == "phase" else schema.MARKER_MICRO_STEP
                          if field.name == "kind" else "layers.0")
        elif str(field.type) in ("string", "large_string"):
            values.append("")
        elif str(field.type) == "bool":
            values.append(False)
        elif str(field.type).startswith("list"):
            values.append([])
        else:
            values.append(0)
    return tuple(values)


class FakeRank:
    """One rank's open tables, appended to as a recorder would."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True)
        self.seq = 0
        self.tables: dict[str, Table] = {}
        for name in schema.TABLES:
            if name == "findings":
                continue
            vocab = {c: ["forward", "backward", schema.MARKER_MICRO_STEP, "layers.0"]
                     for c in dictionary_columns(name)}
            self.tables[name] = open_table(folder, name, WRITER, vocab, _fail)

    def micro_step(self) -> None:
        for name, sink in self.tables.items():
            count = 2 * UNITS if name == "events" else 1
            for _ in range(count):
                self.seq += 1
                row = _row(name, self.seq)
                if isinstance(sink, FixedTable):
                    sink.append(row)
                else:
                    assert isinstance(sink, FramedTable)
                    sink.extend([list(row)])


def measure(num_ranks: int, reps: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        ranks = [FakeRank(run_dir / JOURNAL_DIR / f"rank={r}") for r in range(num_ranks)]
        for rank in ranks:
            rank.micro_step()
        probe = Probe(run_dir)
        probe.poll()
        quiet, busy = [], []
        for _ in range(reps):
            start = time.process_time()
            probe.poll()
            quiet.append(time.process_time() - start)
            for rank in ranks:
                rank.micro_step()
            start = time.process_time()
            polled = probe.poll()
            busy.append(time.process_time() - start)
            assert len(polled.progressed) == num_ranks
    quiet_s, busy_s = sorted(quiet)[len(quiet) // 2], sorted(busy)[len(busy) // 2]
    return {"ranks": num_ranks, "quiet poll ms": f"{quiet_s * 1e3:.1f}",
            "quiet us/rank": f"{quiet_s * 1e6 / num_ranks:.0f}",
            "busy poll ms": f"{busy_s * 1e3:.1f}",
            "busy us/rank": f"{busy_s * 1e6 / num_ranks:.0f}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,64,1024")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rows = [measure(int(n), args.reps) for n in args.ranks.split(",")]
    print_table("watcher CPU per poll (median of --reps, process time)", list(rows[0]),
                [list(row.values()) for row in rows])


if __name__ == "__main__":
    main()
