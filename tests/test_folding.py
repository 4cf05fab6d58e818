"""Folding: the same problem on many ranks and steps reads as one line at 3 a.m."""

from __future__ import annotations

import io

from fsdptrace.checks import findings
from fsdptrace.render import text
from fsdptrace.render.folding import fold
from fsdptrace.views.rank_ranges import rank_ranges
from tests.analyses import analysis_of


def _finding(rank: int, step: int, message: str, unit: str = "layers.3") -> dict:
    return {"check": "wasted-prefetch", "severity": "warning", "rank": rank, "step": step,
            "micro_step": 0, "phase": "forward", "unit": unit, "target": "layers.2",
            "message": message}


def test_rank_ranges_compress_runs() -> None:
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert rank_ranges([3]) == "3"
    assert rank_ranges([]) == ""


def test_findings_differing_in_where_and_numbers_fold_into_one() -> None:
    frame = findings.from_records([
        _finding(0, 0, "held it 11.018 ms (8,448 bytes) until step 0"),
        _finding(1, 0, "held it 10.871 ms (8,448 bytes) until step 0"),
        _finding(0, 1, "held it 8.557 ms (8,448 bytes) until step 1"),
    ])
    folded = fold(frame)
    assert len(folded) == 1
    row = folded.iloc[0]
    assert (row["ranks"], row["steps"], row["count"], row["varies"]) == ([0, 1], [0, 1], 3, True)
    assert row["message"] == "held it 11.018 ms (8,448 bytes) until step 0"


def test_different_words_or_units_do_not_fold() -> None:
    frame = findings.from_records([
        _finding(0, 0, "held it 1 ms"),
        _finding(0, 0, "dropped after 1 ms"),
        _finding(0, 0, "held it 1 ms", unit="layers.13"),
    ])
    assert len(fold(frame)) == 3


def test_text_report_says_numbers_vary_only_when_they_do() -> None:
    same = findings.from_records([_finding(0, 0, "held 2 ms"), _finding(1, 0, "held 2 ms")])
    varied = findings.from_records([_finding(0, 0, "held 2 ms"), _finding(1, 0, "held 3 ms")])
    for frame, expected in ((same, False), (varied, True)):
        out = io.StringIO()
        text.render(analysis_of(frame), out)
        report = out.getvalue()
        assert ("(first of 2; their numbers vary)" in report) is expected
        assert "ranks 0-1 | step 0 | micro-step 0 | forward | layers.3 -> layers.2" in report
