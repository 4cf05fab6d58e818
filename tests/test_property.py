"""Property tests of the analyzer on random, valid in-memory traces (no job, no disk).

Healthy traces give no findings and never raise; each planted problem is always found, with
the rank, step and unit it was planted at, whatever the unit names hold.
"""

from __future__ import annotations

import io
import json

import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdptrace import analyze
from fsdptrace.analysis.result import Analysis
from fsdptrace.render.formats import FORMATS
from fsdptrace.store import schema
from tests.trace_builder import ROOT, TraceBuilder, clean_run

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Names as odd as a user's module tree can make them: quotes, newlines, markup, unicode.
odd_name = st.text(
    alphabet=st.sampled_from(list("ab.0_'\"`|*<>&\n\r\t é→😀[]\\{}$")), min_size=1, max_size=12
)


@st.composite
def layouts(draw: st.DrawFn) -> dict:
    names = draw(st.lists(odd_name, min_size=1, max_size=5, unique=True))
    units = [ROOT, *[n for n in names if n != ROOT]]
    return {
        "units": units,
        "world_size": draw(st.integers(1, 4)),
        "steps": draw(st.integers(2, 3)),
        "micro_steps": draw(st.integers(1, 2)),
        "prefetch": draw(st.booleans()),
    }


def _build(layout: dict, **kwargs: object) -> TraceBuilder:
    return clean_run(
        layout["units"],
        world_size=layout["world_size"],
        steps=layout["steps"],
        micro_steps=layout["micro_steps"],
        prefetch=layout["prefetch"],
        **kwargs,
    )  # type: ignore[arg-type]


def _render_all(analysis: Analysis) -> dict:
    """Every report format renders; the JSON one parses back to the same findings."""
    # The drawings (html, chrome-trace) load the whole trace: tests/test_analysis_object.py
    # renders them on real runs, not on every generated example.
    for name in ("text", "markdown"):
        FORMATS[name].render(analysis, io.StringIO())
    out = io.StringIO()
    FORMATS["json"].render(analysis, out)
    return json.loads(out.getvalue())


def _found(findings: pd.DataFrame, check: str, **where: object) -> pd.DataFrame:
    rows = findings[findings["check"] == check]
    for column, value in where.items():
        rows = rows[rows[column] == value]
    return rows


@SETTINGS
@given(layouts())
def test_healthy_traces_have_no_findings(layout: dict) -> None:
    analysis = analyze(_build(layout).build())
    findings = analysis.findings
    assert findings.empty, findings.to_dict("records")
    _render_all(analysis)


@SETTINGS
@given(layouts(), st.data())
def test_wrong_prefetch_edge_is_found(layout: dict, data: st.DataObject) -> None:
    units = layout["units"]
    if len(units) < 2:
        units = [*units, "extra"]
        layout = {**layout, "units": units}
    rank = data.draw(st.integers(0, layout["world_size"] - 1))
    source_pos = data.draw(st.integers(1, len(units) - 1))
    # Strictly earlier: a unit prefetching itself is not out of order under rule 1 (version 2),
    # since its own call does not come before its first call.
    target_pos = data.draw(st.integers(0, source_pos - 1))
    source, target = units[source_pos], units[target_pos]
    b = _build(layout)
    # A later snapshot for this rank: the source prefetches a unit that already ran.
    b.edges(rank, 1, 0, {(source, schema.FORWARD): [target]}, units)
    analysis = analyze(b.build())
    findings = analysis.findings
    hit = _found(
        findings,
        "prefetch-order",
        rank=rank,
        step=1,
        micro_step=0,
        phase="forward",
        unit=source,
        target=target,
    )
    assert len(hit) == 1, findings.to_dict("records")
    document = _render_all(analysis)
    assert {"unit": source, "target": target} in [
        {"unit": f["unit"], "target": f["target"]} for f in document["findings"]
    ]


@SETTINGS
@given(layouts(), st.data())
def test_bypassed_unit_with_gradients_is_found(layout: dict, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, layout["world_size"] - 1))
    step = data.draw(st.integers(0, layout["steps"] - 1))
    ghost = "never-ran\n<b>'\"" + data.draw(odd_name)
    b = _build(layout)
    b.unit(rank, ghost)
    b.gradient(rank, step, layout["micro_steps"] - 1, ghost, ghost + ".weight")
    analysis = analyze(b.build())
    findings = analysis.findings
    hit = _found(findings, "bypassed-unit", rank=rank, step=step, unit=ghost)
    assert len(hit) == 1, findings.to_dict("records")
    assert ghost + ".weight" in hit["message"].iloc[0]
    _render_all(analysis)


@SETTINGS
@given(layouts(), st.data())
def test_pending_all_gather_is_found(layout: dict, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, layout["world_size"] - 1))
    step = data.draw(st.integers(0, layout["steps"] - 1))
    unit = data.draw(st.sampled_from(layout["units"]))
    b = _build(layout)
    b.pending(rank, step, layout["micro_steps"] - 1, unit)
    analysis = analyze(b.build())
    findings = analysis.findings
    assert len(_found(findings, "pending-all-gather", rank=rank, step=step, unit=unit)) == 1


@SETTINGS
@given(layouts(), st.data())
def test_rank_with_swapped_order_is_found(layout: dict, data: st.DataObject) -> None:
    units = layout["units"] if len(layout["units"]) >= 2 else [*layout["units"], "extra"]
    world_size = max(layout["world_size"], 2)
    layout = {**layout, "units": units, "world_size": world_size}
    rank = data.draw(st.integers(0, world_size - 1))
    step = data.draw(st.integers(0, layout["steps"] - 1))
    micro = data.draw(st.integers(0, layout["micro_steps"] - 1))
    i, j = data.draw(st.lists(st.integers(0, len(units) - 1), min_size=2, max_size=2, unique=True))
    b = _build(layout)
    group = [
        row
        for row in b.rows["events"]
        if (row["rank"], row["step"], row["micro_step"], row["phase"])
        == (rank, step, micro, schema.FORWARD)
    ]
    group[i]["unit"], group[j]["unit"] = group[j]["unit"], group[i]["unit"]
    analysis = analyze(b.build())
    findings = analysis.findings
    hit = _found(findings, "rank-divergence", step=step, micro_step=micro, phase="forward")
    assert len(hit) >= 1, findings.to_dict("records")
    # With two ranks there is no majority: both sides are reported (CHECKS.md v3); with more,
    # the swapped rank is alone.
    expected = {rank} if world_size > 2 else {0, 1}
    assert set(hit["rank"].astype(int)) == expected
    assert set(hit["unit"]) | set(hit["target"]) <= {units[i], units[j]}


@SETTINGS
@given(layouts(), st.data())
def test_rank_without_close_is_stalled(layout: dict, data: st.DataObject) -> None:
    world_size = layout["world_size"]
    stalled = data.draw(st.sets(st.integers(0, world_size - 1), min_size=1))
    b = _build(layout, closed=set(range(world_size)) - stalled)
    analysis = analyze(b.build())
    findings = analysis.findings
    hit = _found(findings, "stalled-rank")
    assert set(hit["rank"].astype(int)) == stalled
    # Its last record is its last boundary: the stop point is exact (CHECKS.md v3).
    for message in hit["message"]:
        assert f"stopped at the boundary after optimizer step {layout['steps'] - 1};" in message
    # Nothing else: the cut-off last micro-step is not a prefetch or order finding.
    assert set(findings["check"]) == {"stalled-rank"}
    _render_all(analysis)


@SETTINGS
@given(layouts())
def test_missing_rank_is_reported(layout: dict) -> None:
    b = _build(layout)
    b.world_size += 1
    for row in b.rows["meta"]:
        row["world_size"] = b.world_size
    analysis = analyze(b.build())
    findings = analysis.findings
    hit = _found(findings, "stalled-rank")
    assert list(hit["rank"].astype(int)) == [layout["world_size"]]
    assert "has no data on disk" in hit["message"].iloc[0]
