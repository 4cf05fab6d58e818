"""The report's orders side by side mark the unit the finding names, never another.

``render.order_compare`` re-reads the orders to draw them; the reference it draws them against
comes from the checks' own majority rule (``checks.majority``) and each flagged rank's first
difference from its finding's ``position``. Traces are built in memory (``trace_builder``):
the property is about the report agreeing with the analysis, whatever FSDP2 recorded.
"""

from __future__ import annotations

import pandas as pd

import fsdptrace
from fsdptrace.render import html_report
from tests.trace_builder import ROOT, clean_run

UNITS = [ROOT, "layers.0", "layers.1", "layers.2", "layers.3"]


def _comparisons(orders: dict[int, list[str]], world_size: int
                 ) -> tuple[pd.DataFrame, list[dict], list[str]]:
    trace = clean_run(UNITS, world_size=world_size, steps=1, micro_steps=1, prefetch=False,
                      orders=orders).build()
    findings = fsdptrace.analyze(trace).findings
    data = html_report.document(trace, findings)
    compared = [c for step in data["steps"] for c in step["comparisons"]
                if c["check"] == "rank-divergence"]
    return findings[findings["check"] == "rank-divergence"], compared, data["units"]


def _marked(columns: list[dict], units: list[str]) -> dict[int, int]:
    """first_diff per rank of every drawn column but the reference."""
    out = {}
    for column in columns:
        if column["reference"]:
            continue
        for part in column["label"].removeprefix("ranks ").split(","):
            low, _, high = part.partition("-")
            for rank in range(int(low), int(high or low) + 1):
                out[rank] = column["first_diff"]
    return out


def test_each_diverging_column_marks_its_findings_position() -> None:
    """Four ranks, three orders: ranks 0 and 2 agree (the majority); 1 and 3 each differ at
    another place. Each column's marked index is its rank's finding's ``position``."""
    swapped_early = [ROOT, "layers.1", "layers.0", "layers.2", "layers.3"]
    swapped_late = [ROOT, "layers.0", "layers.1", "layers.3", "layers.2"]
    found, compared, units = _comparisons({1: swapped_early, 3: swapped_late}, world_size=4)
    forward = [c for c in compared if c["title"].endswith("forward")]
    assert len(forward) == 1
    reference = forward[0]["columns"][0]
    assert reference["reference"] and reference["label"] == "ranks 0,2"
    told = found[found["phase"] == "forward"]
    assert {int(r): int(p) for r, p in zip(told["rank"], told["position"], strict=True)} == \
        _marked(forward[0]["columns"], units) == {1: 1, 3: 3}


def test_with_no_majority_the_reference_is_the_side_the_check_compared_with() -> None:
    """Two ranks, two orders: no majority; the check reports both ranks, each against the
    other, and the report draws rank 0's side as the reference (the majority rule's pick),
    rank 1's column marked where both findings say they differ."""
    changed = [ROOT, "layers.0", "layers.2", "layers.1", "layers.3"]
    found, compared, units = _comparisons({1: changed}, world_size=2)
    forward = next(c for c in compared if c["title"].endswith("forward"))
    reference, other = forward["columns"]
    assert (reference["label"], reference["reference"]) == ("ranks 0", True)
    positions = set(found.loc[found["phase"] == "forward", "position"].astype(int))
    assert positions == {2} and other["first_diff"] == 2
    assert units[reference["order"][2]] == "layers.1" and units[other["order"][2]] == "layers.2"
