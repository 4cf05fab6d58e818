"""The unsharded-memory ledger on a real 2-rank FSDP2 job (gloo, CPU).

What FSDP2 2.13 does here (recorded, then asserted): with the default ``reshard_after_forward``
each unit's parameters are all-gathered at its forward and resharded right after it, so the
forward holds one unit at a time; in backward the running unit is held while FSDP2's implicit
prefetch gathers the next, so two units. With ``reshard_after_forward=False`` the forward never
reshards: the four units pile up to 4 x 1,050,624 bytes and stay held into backward, where each is
resharded after its own backward.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import fsdptrace
from tests.recordings import Recordings

pytestmark = pytest.mark.slow

UNIT_BYTES = (512 * 512 + 512) * 4  # Linear(512, 512) in float32, gathered whole


@pytest.fixture(scope="module")
def runs(recordings: Recordings) -> Path:
    """``ledger_job.py``'s two modes (``default``, ``keep``), from the session's catalogue."""
    return recordings.catalogue("ledger_job")


def test_default_resharding_holds_one_unit_forward_and_two_backward(runs: Path) -> None:
    peaks = fsdptrace.load(runs / "default").unsharded(peaks=True)
    assert set(peaks["rank"]) == {0, 1} and len(peaks) == 2 * 2 * 2  # ranks x steps x phases
    forward = peaks[peaks["phase"] == "forward"]
    backward = peaks[peaks["phase"] == "backward"]
    assert set(forward["peak_bytes"]) == {UNIT_BYTES}
    assert set(backward["peak_bytes"]) == {2 * UNIT_BYTES}
    assert (peaks["excess_bytes"] == 0).all()  # the implicit prefetch is in the floor
    assert (peaks["held_from_earlier"] == "").all()


def test_keeping_forward_parameters_shows_the_excess_and_its_cause(runs: Path) -> None:
    trace = fsdptrace.load(runs / "keep")
    peaks = trace.unsharded(peaks=True)
    assert set(peaks["peak_bytes"]) == {4 * UNIT_BYTES}
    assert set(peaks["floor_bytes"]) == {UNIT_BYTES}
    assert set(peaks["excess_bytes"]) == {3 * UNIT_BYTES}
    backward = peaks[peaks["phase"] == "backward"].iloc[0]
    assert backward["held_from_earlier"].count("forward)") == 4  # held since the forward
    ledger = trace.unsharded()
    rank0 = ledger[(ledger["rank"] == 0) & (ledger["step"] == 0)]
    assert list(rank0["held_bytes"])[:4] == [UNIT_BYTES * k for k in (1, 2, 3, 4)]
    assert list(rank0["held_bytes"])[-1] == 0  # every gather ends in a reshard


def test_summary_names_each_ranks_peak_and_floor(runs: Path) -> None:
    from fsdptrace.views.summary import per_rank

    table = per_rank(fsdptrace.load(runs / "keep"))
    assert list(table["peak_unsharded_bytes"]) == [4 * UNIT_BYTES] * 2
    assert list(table["unsharded_floor_bytes"]) == [UNIT_BYTES] * 2


def test_chrome_trace_has_a_bytes_counter_per_rank(runs: Path) -> None:
    from fsdptrace.render.chrome_trace import chrome_trace

    trace = fsdptrace.load(runs / "keep")
    counters = [e for e in chrome_trace(trace, fsdptrace.analyze(trace).findings)["traceEvents"]
                if e["ph"] == "C"]
    assert {e["pid"] for e in counters} == {0, 1}
    assert max(e["args"]["bytes"] for e in counters) == 4 * UNIT_BYTES
    assert all(e["ts"] >= 0 for e in counters)


def test_unsharded_excess_warns_with_its_cause_and_not_on_the_default(runs: Path) -> None:
    """Check 13: the kept forward parameters are 3 units above the floor on every pass."""
    assert not len(fsdptrace.analyze(runs / "default", checks=["unsharded-excess"]).findings)
    found = fsdptrace.analyze(runs / "keep", checks=["unsharded-excess"]).findings
    assert set(found["severity"]) == {"warning"}
    assert sorted(zip(found["rank"], found["step"], strict=True)) == [
        (0, 0), (0, 1), (1, 0), (1, 1)]  # one per rank and step: its worst pass
    assert set(found["bytes"]) == {3 * UNIT_BYTES}
    message = found["message"].iloc[0]
    assert "reshard_after_forward=False" in message and "held from an earlier pass" in message


def test_report_has_the_memory_view(runs: Path, tmp_path: Path) -> None:
    from fsdptrace.render.html_report import render

    trace = fsdptrace.load(runs / "keep")
    out = tmp_path / "report.html"
    with out.open("w") as handle:
        render(trace, fsdptrace.analyze(trace).findings, handle, run_dir=str(runs / "keep"))
    page = out.read_text()
    assert 'id="memory"' in page and page.count('<svg class="memory"') == 2
    assert "4.01 MiB" in page and "1.00 MiB" in page  # peak and floor of each rank


def test_diff_reports_the_peak_of_each_phase(runs: Path) -> None:
    changes = {c.phase: (c.bytes_a, c.bytes_b)
               for c in fsdptrace.diff(runs / "default", runs / "keep").allgather_bytes}
    assert changes["forward peak unsharded"] == (UNIT_BYTES, 4 * UNIT_BYTES)
    assert changes["backward peak unsharded"] == (2 * UNIT_BYTES, 4 * UNIT_BYTES)


def test_a_run_recorded_before_reshards_has_no_ledger(runs: Path) -> None:
    """Without ``reshard`` rows a hold would never end: no ledger rather than a wrong one."""
    trace = fsdptrace.load(runs / "keep")
    older = trace.allgathers[trace.allgathers["event"] != "reshard"]
    from fsdptrace.reading import unsharded

    assert not len(unsharded.timeline(older)) and not len(unsharded.peaks(older))
