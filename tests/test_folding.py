"""Folding: the same problem on many ranks and steps reads as one line at 3 a.m."""

from __future__ import annotations

import io

import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptrace.checks import findings
from fsdptrace.render import text
from fsdptrace.render.folding import _NUMBER as NUMBER
from fsdptrace.render.folding import KEY, fold
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


def _pandas_fold(frame: pd.DataFrame) -> pd.DataFrame:
    """The definition ``fold`` had as a pandas groupby (on hashes of the key texts)."""
    keyed = frame.reset_index(drop=True).assign(_order=range(len(frame)))
    key = keyed[KEY].astype(object).where(keyed[KEY].notna(), "\x00").astype(str)
    key["message"] = key["message"].str.replace(NUMBER, "#", regex=True)
    keyed["_key"] = pd.util.hash_pandas_object(key, index=False).to_numpy()
    grouped = keyed.groupby("_key", sort=False)
    first = grouped.head(1).set_index("_key")

    def ints(values: pd.Series) -> list[int]:
        return sorted({int(x) for x in values.dropna()})

    first["ranks"] = grouped["rank"].agg(ints)
    first["steps"] = grouped["step"].agg(ints)
    first["micro_steps"] = grouped["micro_step"].agg(ints)
    first["count"] = grouped.size()
    first["varies"] = grouped["message"].nunique() > 1
    return first.sort_values("_order").drop(columns="_order").reset_index(drop=True)


_MAYBE_INT = st.one_of(st.none(), st.integers(0, 3))
_ROW = st.fixed_dictionaries({
    "check": st.sampled_from(["wasted-prefetch", "rank-divergence"]),
    "severity": st.sampled_from(["warning", "error"]),
    "rank": _MAYBE_INT, "step": _MAYBE_INT, "micro_step": _MAYBE_INT,
    "phase": st.sampled_from([None, "forward", "backward"]),
    "unit": st.sampled_from(["layers.3", "layers.13", None]),
    "target": st.sampled_from(["layers.2", None]),
    "message": st.sampled_from(["held it 1 ms", "held it 2.5 ms (8,448 bytes)", "held it",
                                "dropped after 1 ms", "\x00", "x"]),
})


@settings(max_examples=150, deadline=None)
@given(st.lists(_ROW, max_size=12))
def test_fold_is_the_groupby_it_replaced(rows: list[dict]) -> None:
    frame = findings.from_records(rows)
    pd.testing.assert_frame_equal(fold(frame), _pandas_fold(frame) if rows else fold(frame))
    if rows:
        assert fold(frame)["count"].sum() == len(rows)
