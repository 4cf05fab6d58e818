"""Rows the writer drops are marked with where they were lost, so gaps are not read as facts.

Two levels: the writer alone (rows with known seq/step, flushed by hand), and a real FSDP2 job
(1 rank, gloo) whose writer is capped at a few rows per table and flushed by hand after every
micro-step, so what is dropped is deterministic. Every row has a ``seq`` from one counter
(events, markers, allgathers), so the run dir itself is the ground truth: each missing seq
must lie in a ``dropped_rows`` run of its table, and the counts must add up.

Run as a script, this file is the job (``python tests/test_recorder_dropped.py --out DIR``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SEQ_TABLES = ("events", "markers", "allgathers")
CAP = 6
NUM_STEPS, NUM_MICRO_STEPS = 3, 2


# --------------------------------------------------------------------- the writer alone
def test_writer_records_each_contiguous_drop(tmp_path: Path) -> None:
    from fsdptrace.record.dropped import DroppedRows
    from fsdptrace.record.writer import ChunkWriter

    writer = ChunkWriter(tmp_path, rank=0, version="test", writer_id="w", max_buffered_rows=3)
    events = writer.buffer("events", lambda rows: {})
    rows = [(seq, 0, seq // 4, seq % 4 // 2, 0, 0) for seq in range(1, 11)]
    events.extend(rows[:8])
    writer._drop_excess_of(writer.buffers["events"])  # seqs 1..5 go, 6..8 stay
    events.extend(rows[8:])
    writer._drop_excess_of(writer.buffers["events"])  # seqs 6, 7 go
    assert writer.buffers["events"].drops == [
        DroppedRows("events", 5, 1, 5, 0, 0, 1, 0),
        DroppedRows("events", 2, 6, 7, 1, 1, 1, 1),
    ]
    assert [r[0] for r in events] == [8, 9, 10] and writer.num_drop_runs == 2
    detail = json.loads(writer.buffers["events"].drops[0].detail())
    assert detail == {"table": "events", "first_seq": 1, "last_seq": 5, "first_step": 0,
                      "first_micro_step": 0, "last_step": 1, "last_micro_step": 0}


def test_tables_without_seq_report_steps_only(tmp_path: Path) -> None:
    from fsdptrace.record.writer import ChunkWriter

    writer = ChunkWriter(tmp_path, rank=0, version="test", writer_id="w", max_buffered_rows=1)
    gradients = writer.buffer("gradients")
    gradients.extend([(2, 1, "a", "w", True, "sharded"), (3, 0, "a", "w", True, "sharded")])
    writer._drop_excess_of(writer.buffers["gradients"])
    (run,) = writer.buffers["gradients"].drops
    assert (run.first_seq, run.last_seq, run.first_step, run.last_step) == (None, None, 2, 2)


# --------------------------------------------------------------------- a real FSDP2 job
def job(out: Path) -> None:
    """Train a few units on one rank with a writer capped at ``CAP`` rows per table."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    import fsdptrace

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    for a, b in zip(model[:-1], model[1:], strict=False):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with fsdptrace.attach(model, run_dir=out / "run", optimizer=optimizer) as rec:
        # Flush by hand, from this thread: what is dropped then does not depend on timing.
        rec.writer.stop()
        rec.writer.max_buffered_rows = CAP
        for _ in range(NUM_STEPS):
            for _ in range(NUM_MICRO_STEPS):
                model(torch.randn(4, 8)).sum().backward()
                rec.writer.flush()
            optimizer.step()
            optimizer.zero_grad()
        dropped = {n: b.num_dropped for n, b in rec.writer.buffers.items() if b.num_dropped}
    (out / "dropped.json").write_text(json.dumps(dropped))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    from tests.jobs import assert_ok, run_ranks

    out = tmp_path_factory.mktemp("dropped")
    assert_ok(run_ranks([str(Path(__file__).relative_to(REPO)), "--out", str(out)], nproc=1,
                        timeout_s=180))
    return out / "run", json.loads((out / "dropped.json").read_text())


def _runs(run_dir: Path) -> list[dict[str, Any]]:
    from fsdptrace.record.dropped import MARKER_DROPPED_ROWS
    from tests.jobs_scripts.tables import read_table

    markers = read_table(run_dir, "markers")
    mine = markers[markers["kind"] == MARKER_DROPPED_ROWS]
    return [{**json.loads(m.detail), "count": int(m.count), "marker_seq": int(m.seq)}
            for m in mine.itertuples()]


@pytest.mark.slow
def test_counts_match_the_totals(recorded: tuple[Path, dict[str, int]]) -> None:
    from tests.jobs_scripts.tables import read_table

    run_dir, dropped = recorded
    assert {"events", "allgathers"} <= set(dropped), dropped
    runs = _runs(run_dir)
    keys = [(r["table"], r["first_seq"], r["last_seq"], r["first_step"]) for r in runs]
    assert len(keys) == len(set(keys)), "a run is marked twice"
    per_table: dict[str, int] = {}
    for r in runs:
        per_table[r["table"]] = per_table.get(r["table"], 0) + r["count"]
        assert (r["first_step"], r["first_micro_step"]) <= (r["last_step"], r["last_micro_step"])
    assert per_table == dropped
    markers = read_table(run_dir, "markers")
    totals = markers[markers["kind"] == "dropped"]
    assert dict(zip(totals["detail"], totals["count"].astype(int), strict=True)) == dropped


@pytest.mark.slow
def test_every_missing_row_lies_in_a_marked_run(recorded: tuple[Path, dict[str, int]]) -> None:
    from tests.jobs_scripts.tables import read_table

    run_dir, _ = recorded
    runs = [r for r in _runs(run_dir) if r["table"] in SEQ_TABLES]
    tables = {t: read_table(run_dir, t) for t in SEQ_TABLES}
    on_disk = {t: set(frame["seq"].astype(int)) for t, frame in tables.items()}
    everything = set().union(*on_disk.values())
    missing = set(range(1, max(everything) + 1)) - everything
    assert missing and sum(r["count"] for r in runs) == len(missing)
    for seq in missing:
        assert any(r["first_seq"] <= seq <= r["last_seq"] for r in runs), seq
    for r in runs:
        kept = tables[r["table"]]
        seqs = kept["seq"].astype(int)
        # A run is contiguous within its table: nothing of that table survived inside it.
        assert not ((seqs >= r["first_seq"]) & (seqs <= r["last_seq"])).any(), r
        _assert_steps_bracket(kept, r)


@pytest.mark.slow
def test_runs_are_marked_at_boundaries_and_lost_marks_again_at_close(
        recorded: tuple[Path, dict[str, int]]) -> None:
    """A job killed later keeps the marks of earlier steps; marks the cap ate come back."""
    from tests.jobs_scripts.tables import read_table

    run_dir, _ = recorded
    markers = read_table(run_dir, "markers")
    closing = int(markers.loc[markers["kind"] == "dropped", "seq"].min())
    runs = _runs(run_dir)
    assert any(r["marker_seq"] < closing for r in runs)
    lost_marks = [r for r in runs if r["table"] == "markers"]
    assert lost_marks, "the cap never dropped a marker: the re-marking is not exercised"
    kept = set(markers["seq"].astype(int))
    for lost in lost_marks:
        for seq in range(lost["first_seq"], lost["last_seq"] + 1):
            assert seq not in kept


def _assert_steps_bracket(kept: Any, run: dict[str, Any]) -> None:
    """The kept rows around a run bound its step range (rows are recorded in step order)."""
    seqs = kept["seq"].astype(int)
    before, after = kept[seqs < run["first_seq"]], kept[seqs > run["last_seq"]]
    position = list(zip(kept["step"].astype(int), kept["micro_step"].astype(int), strict=True))
    index = dict(zip(seqs, position, strict=True))
    if len(before):
        assert index[int(before["seq"].max())] <= (run["first_step"], run["first_micro_step"])
    if len(after):
        assert index[int(after["seq"].min())] >= (run["last_step"], run["last_micro_step"])


if __name__ == "__main__":
    job(Path(sys.argv[sys.argv.index("--out") + 1]))
