"""Rows the writer dropped are gaps, not facts: the analyzer skips the micro-steps they hit.

Synthetic traces lose a contiguous run of one rank's rows exactly as the writer does (its
oldest buffered rows) and carry the ``dropped_rows`` marker the recorder writes for it. Each
case is checked three ways: with the marker no false finding; without it the false finding
appears (so the test can fail); and a real problem outside the lost range is still found.
Every case runs on the in-memory ``Trace`` and on the same trace written as a run dir (the
Arrow map step), which must agree. A real 1-rank FSDP2 job with a tiny writer cap closes.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from fsdptrace import RunDirError, analyze, load
from fsdptrace.analysis.run import incomplete_ranges
from fsdptrace.render import text
from fsdptrace.store import schema
from fsdptrace.views.summary import overview
from tests.trace_builder import ROOT, TraceBuilder, clean_run, write_run_dir

REPO = Path(__file__).resolve().parent.parent
UNITS = [ROOT, "a", "b", "c"]
Where = tuple[str, int, int, int]  # check, rank, step, micro_step


# ------------------------------------------------------------------- building the gaps
def drop_rows(b: TraceBuilder, table: str, rank: int, lost: Callable[[dict], bool], *,
              mark: bool = True) -> int:
    """Remove ``rank``'s rows of ``table`` that ``lost`` picks and, if ``mark``, write the
    ``dropped_rows`` marker the recorder would (after the current rows, at close)."""
    kept: list[dict[str, Any]] = []
    gone: list[dict[str, Any]] = []
    for row in b.rows[table]:
        (gone if row["rank"] == rank and lost(row) else kept).append(row)
    assert gone, "nothing dropped: the case plants no gap"
    b.rows[table] = kept
    if mark:
        first, last = gone[0], gone[-1]
        detail = {"table": table, "first_seq": first.get("seq"), "last_seq": last.get("seq"),
                  "first_step": first["step"], "first_micro_step": first["micro_step"],
                  "last_step": last["step"], "last_micro_step": last["micro_step"]}
        b.marker(rank, last["step"] + 1, 0, schema.MARKER_DROPPED_ROWS, count=len(gone),
                 detail=json.dumps(detail))
    return len(gone)


def at(step: int, micro_step: int, phase: str | None = None) -> Callable[[dict], bool]:
    """Rows of one micro-step (and phase): what one drop of the oldest rows removes."""
    return lambda row: (row["step"], row["micro_step"]) == (step, micro_step) and (
        phase is None or row["phase"] == phase)


def allgather(b: TraceBuilder, rank: int, step: int, micro_step: int, unit: str, event: str,
              *, issuer_kind: str = "own", issuer_unit: str | None = None) -> None:
    """One all-gather provenance row (the builder has none), numbered like the recorder."""
    b.rows["allgathers"].append(dict(
        rank=rank, seq=b._next(rank), t_ns=0, step=step, micro_step=micro_step,
        phase=schema.FORWARD, unit=unit, group=0, event=event, issuer_kind=issuer_kind,
        issuer_unit=issuer_unit, num_bytes=64, detail=None))


def where(findings: pd.DataFrame) -> set[Where]:
    return {(str(c), int(r), int(s), int(m)) for c, r, s, m in
            findings[["check", "rank", "step", "micro_step"]].itertuples(index=False)}


@pytest.fixture(params=["trace", "run_dir"])
def analyzed(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[TraceBuilder],
                                                                           set[Where]]:
    """Where the findings are, for a built trace: in memory, or written and read back."""
    def run(b: TraceBuilder) -> set[Where]:
        trace = b.build()
        if request.param == "trace":
            return where(analyze(trace).findings)
        return where(analyze(write_run_dir(trace, tmp_path / "run"), jobs=1).findings)
    return run


# ------------------------------------------------------------------- events gaps
def _events_gap(*, mark: bool, world_size: int = 2, micro_steps: int = 1) -> TraceBuilder:
    """Rank 1 lost the end of its forward of step 1 micro-step 0 (b, c: contiguous rows)."""
    b = clean_run(UNITS, world_size=world_size, steps=3, micro_steps=micro_steps)
    forward = at(1, 0, schema.FORWARD)
    drop_rows(b, "events", 1, lambda r: forward(r) and r["unit"] in ("b", "c"), mark=mark)
    return b


def test_events_gap_without_marker_reads_as_findings(analyzed: Any) -> None:
    found = analyzed(_events_gap(mark=False))
    for check in ("rank-divergence", "order-instability", "prefetch-order", "bypassed-unit"):
        assert any(w[0] == check and w[1:3] == (1, 1) for w in found), (check, found)


def test_marked_events_gap_is_not_a_finding(analyzed: Any) -> None:
    assert analyzed(_events_gap(mark=True)) == set()


def test_other_ranks_of_the_slot_are_still_compared(analyzed: Any) -> None:
    b = _events_gap(mark=True, world_size=3)
    swapped = [ROOT, "b", "a", "c"]  # rank 2 really runs a different order in step 1
    b.rows["events"] = [r for r in b.rows["events"]
                        if not (r["rank"] == 2 and r["step"] == 1 and r["phase"] == "forward")]
    b.run(2, 1, 0, schema.FORWARD, swapped)
    found = analyzed(b)
    assert ("rank-divergence", 2, 1, 0) in found
    assert not any(w[1] == 1 for w in found), found


def test_real_problem_outside_the_gap_is_found(analyzed: Any) -> None:
    b = _events_gap(mark=True, micro_steps=2)
    # A real bypass on the same rank, two steps later: unit c never runs forward in step 2.
    drop_rows(b, "events", 1, lambda r: r["step"] == 2 and r["phase"] == "forward"
              and r["unit"] == "c", mark=False)
    found = analyzed(b)
    assert ("bypassed-unit", 1, 2, 1) in found
    assert not any(w[2] == 1 for w in found), found


# ------------------------------------------------------------------- boundary snapshots
def _bypass_at_step_1(b: TraceBuilder) -> None:
    """A real bypass: unit c holds gradients at step 1 but never ran forward."""
    drop_rows(b, "events", 0, lambda r: r["step"] == 1 and r["unit"] == "c", mark=False)


@pytest.mark.parametrize("mark", [False, True])
def test_gradients_gap_skips_check_2_for_that_step(analyzed: Any, mark: bool) -> None:
    b = clean_run(UNITS, world_size=1, steps=3, micro_steps=1, prefetch=False)
    _bypass_at_step_1(b)
    drop_rows(b, "gradients", 0, lambda r: r["step"] == 1 and r["unit"] == "a", mark=mark)
    found = analyzed(b)
    assert (("bypassed-unit", 0, 1, 0) in found) is not mark
    assert not {w for w in found if w[2] != 1}


@pytest.mark.parametrize("mark", [False, True])
def test_pending_gap_skips_check_3_for_that_step(analyzed: Any, mark: bool) -> None:
    b = clean_run(UNITS, world_size=1, steps=3, micro_steps=1, prefetch=False)
    for step in (1, 2):
        b.pending(0, step, 0, "b", bucket=f"bucket{step}")
    b.pending(0, 1, 0, "c", bucket="lost")
    drop_rows(b, "pending", 0, lambda r: r["bucket"] == "lost", mark=mark)
    found = analyzed(b)
    assert (("pending-all-gather", 0, 1, 0) in found) is not mark
    assert ("pending-all-gather", 0, 2, 0) in found


# ------------------------------------------------------------------- allgathers gaps
def _prefetch_and_consume(b: TraceBuilder, step: int, micro_step: int) -> None:
    allgather(b, 0, step, micro_step, "b", "issue", issuer_kind="prefetch", issuer_unit="a")
    allgather(b, 0, step, micro_step, "b", "consume")


@pytest.mark.parametrize("mark", [False, True])
def test_allgathers_gap_skips_checks_8_and_9(analyzed: Any, mark: bool) -> None:
    b = clean_run(UNITS, world_size=1, steps=3, micro_steps=2, prefetch=False)
    for step, micro in ((0, 0), (0, 1), (1, 0), (1, 1)):
        _prefetch_and_consume(b, step, micro)
    # Step 1 micro-step 0's consume and micro-step 1's issue are lost: the issue of 1/0
    # pairs with the consume of 1/1 and reads as held into the next micro-step.
    lost = [b.rows["allgathers"][5], b.rows["allgathers"][6]]
    drop_rows(b, "allgathers", 0, lambda r: any(r is x for x in lost), mark=mark)
    # A real waste in step 2: prefetched in micro-step 0, consumed only in micro-step 1.
    allgather(b, 0, 2, 0, "b", "issue", issuer_kind="prefetch", issuer_unit="a")
    allgather(b, 0, 2, 1, "b", "consume")
    found = {w for w in analyzed(b) if w[0] == "wasted-prefetch"}
    assert found == ({("wasted-prefetch", 0, 2, 0)} if mark
                     else {("wasted-prefetch", 0, 1, 0), ("wasted-prefetch", 0, 2, 0)})


# ------------------------------------------------------------------- what a person reads
def test_ranges_summary_and_report_say_what_was_not_checked(tmp_path: Path) -> None:
    b = _events_gap(mark=True, micro_steps=2)
    count = drop_rows(b, "events", 1, at(2, 1), mark=True)
    trace = b.build()
    run_dir = write_run_dir(trace, tmp_path / "run")
    ranges = incomplete_ranges(run_dir)
    pd.testing.assert_frame_equal(ranges, incomplete_ranges(trace))
    assert list(ranges[["rank", "table", "first_step", "last_step"]].itertuples(
        index=False, name=None)) == [(1, "events", 1, 1), (1, "events", 2, 2)]
    assert overview(load(run_dir))["incomplete_steps"] == {
        "1": f"steps 1-2 (events: {2 + count:,} rows)"}
    out = io.StringIO()
    analysis = analyze(run_dir, jobs=1)
    pd.testing.assert_frame_equal(analysis.incomplete, ranges)
    # Hang triage reads markers too: it says the same of what was not checked.
    pd.testing.assert_frame_equal(analyze(run_dir, ["stalled-rank"]).incomplete, ranges)
    text.render(analysis, out)
    assert out.getvalue() == (
        f"INCOMPLETE: no findings in what was recorded across 2 of 2 ranks\nrun dir: {run_dir}\n"
        f"rank 1 dropped {2 + count:,} rows in steps 1-2: those micro-steps were not checked\n")


def test_a_run_without_drops_has_no_ranges() -> None:
    trace = clean_run(UNITS, world_size=2, steps=2, micro_steps=1).build()
    assert incomplete_ranges(trace).empty
    assert overview(trace)["incomplete_steps"] == {}


@pytest.mark.parametrize("detail", ["{not json", "[1, 2]", "__import__('os')"])
def test_a_corrupt_marker_detail_is_a_run_dir_error(detail: str) -> None:
    b = clean_run(UNITS, world_size=1, steps=1, micro_steps=1)
    b.marker(0, 1, 0, schema.MARKER_DROPPED_ROWS, count=3, detail=detail)
    with pytest.raises(RunDirError, match="dropped_rows marker's detail is not a JSON object"):
        analyze(b.build())
