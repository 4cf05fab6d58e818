"""Findings are ordered by the definition (``checks.findings.combine``): errors first, then
warnings, then any other severity; within them by step, rank, check, micro-step, phase, unit,
target, a missing value first in each; rows that tie keep their given order. ``combine`` sorts
Python keys rather than the frame, so it is held here to pandas' own stable sort of the same
columns, on random findings split into random frames."""

from __future__ import annotations

import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptrace.checks import findings

SORTED_BY = ["step", "rank", "check", "micro_step", "phase", "unit", "target"]

_maybe_int = st.one_of(st.none(), st.integers(0, 3), st.just(2**31 - 1))
_maybe_text = st.one_of(st.none(), st.sampled_from(["a", "B", "layers.10", "layers.2", "é",
                                                    "\u202e", ""]))
_record = st.fixed_dictionaries({
    "check": st.sampled_from(["prefetch-order", "stalled-rank", "bypassed-unit"]),
    "severity": st.sampled_from([findings.ERROR, findings.WARNING, "info", None]),
    "rank": _maybe_int, "step": _maybe_int, "micro_step": _maybe_int,
    "phase": st.sampled_from(["forward", "backward", None]),
    "unit": _maybe_text, "target": _maybe_text,
    "message": st.text(max_size=3), "position": _maybe_int,
})


def _by_definition(frames: list[pd.DataFrame]) -> pd.DataFrame:
    merged = pd.concat([f for f in frames if len(f)], ignore_index=True)
    severity = merged["severity"].map(findings.SEVERITY_ORDER).fillna(9)
    ordered = merged.assign(_severity=severity).sort_values(
        ["_severity", *SORTED_BY], na_position="first", kind="stable")
    return findings.normalize(ordered.drop(columns="_severity").reset_index(drop=True))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(_record, max_size=12), min_size=1, max_size=4))
def test_combined_findings_are_in_the_defined_order(parts: list[list[dict]]) -> None:
    frames = [findings.from_records(records) for records in parts]
    combined = findings.combine(frames)
    if not any(parts):
        assert combined.empty and list(combined.columns) == findings.COLUMNS
        return
    pd.testing.assert_frame_equal(combined, _by_definition(frames))


def test_unnormalized_inputs_are_normalized_first() -> None:
    """A check may hand over categoricals or floats where the table holds strings and Int64."""
    raw = pd.DataFrame({c: [None, None] for c in findings.COLUMNS}).assign(
        check=pd.Categorical(["b", "a"]), severity=["warning", "error"], rank=[1.0, 0.0],
        message=["second", "first"])
    combined = findings.combine([raw])
    assert combined["message"].tolist() == ["first", "second"]
    assert list(combined.dtypes) == list(findings.empty().dtypes)
