"""One self-contained HTML file a person would rather look at than a terminal report.

The page needs no network: the template inlines its CSS and a small vanilla JS that draws SVG.
Findings are folded on the server side (as ``analyze`` prints them); the timeline (zoomable,
one lane per rank from its own step start, ``timeline_lanes``), the prefetch edges over the
observed order and the orders that findings compare (``order_compare``) are drawn in the
browser from JSON embedded per optimizer step. Big runs stay small: ranks that ran the same
order with the same prefetch configuration share one order signature, each signature's order is
embedded once, only a bounded number of ranks get their own lane and timings, and only a
bounded number of steps are embedded at all.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

import jinja2
import pandas as pd

from fsdptrace.checks import stalled_rank as stalled_rank_check
from fsdptrace.reading import incomplete, unsharded
from fsdptrace.reading.trace import Trace
from fsdptrace.reading.unit_names import Label, labeller, module_types
from fsdptrace.reading.untrusted import printable
from fsdptrace.render import timeline_lanes, told, wall_clock
from fsdptrace.render.memory_view import memory_view
from fsdptrace.render.order_compare import comparisons
from fsdptrace.render.silences import lane_silence, silences
from fsdptrace.render.stack_view import stack_blocks
from fsdptrace.render.text import verdict
from fsdptrace.render.unit_spans import unit_spans
from fsdptrace.store import schema
from fsdptrace.views.rank_ranges import rank_ranges

MAX_STEPS = 8
MAX_RANK_LANES = 32
MAX_MARKS_PER_STEP = 500
MAX_ROWS_PER_CHECK = 50
PHASE_CODES = {schema.FORWARD: 0, schema.BACKWARD: 1}


def _shown(value: Any) -> Any:
    """Text from a run dir with its control characters escaped, as the text outputs show it
    (HTML autoescape leaves ESC and bidi controls raw); markup we built is left as it is."""
    if isinstance(value, str) and not isinstance(value, jinja2.utils.markupsafe.Markup):
        return printable(value)
    return value


_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("fsdptrace.render", "templates"),
    autoescape=jinja2.select_autoescape(["html", "j2"], default=True),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    finalize=_shown,
)


def script_json(data: Any) -> str:
    """JSON that cannot end the ``<script>`` element it is embedded in.

    ``ensure_ascii`` turns U+2028/U+2029 into escapes (raw, they end a JS string line in old
    engines); ``<``, ``>`` and ``&`` become ``\\u003c``... so a unit named ``</script>`` stays
    data. The result is still plain JSON for ``JSON.parse``.
    """
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def embedded_steps(
    trace: Trace, findings: pd.DataFrame, *, max_steps: int = MAX_STEPS
) -> list[int]:
    """Steps worth embedding: those with findings first (earliest first), then the earliest."""
    recorded = trace.steps
    flagged = sorted({int(s) for s in findings["step"].dropna()} & set(recorded))
    rest = [s for s in recorded if s not in set(flagged)]
    return sorted((flagged + rest)[:max_steps])


def default_step(findings: pd.DataFrame, steps: list[int]) -> int | None:
    """The first embedded step with a finding, else the first step: where to start reading."""
    flagged = [s for s in steps if (findings["step"] == s).any()]
    candidates = flagged or steps
    return candidates[0] if candidates else None


def _rank_signatures(events: pd.DataFrame, edges: pd.DataFrame) -> pd.Series:
    """Per rank, one string naming its whole order in the step and its prefetch edges."""
    key = (
        events["micro_step"].astype(str)
        + ":"
        + events["phase"].astype(str)
        + ":"
        + events["unit"].astype(str)
    )
    orders = key.groupby(events["rank"]).agg("\x1f".join)
    edge_key = (
        edges["unit"].astype(str)
        + ">"
        + edges["phase"].astype(str)
        + ">"
        + edges["target"].astype(str)
    )
    configs = edge_key.groupby(edges["rank"]).agg(lambda s: "\x1f".join(sorted(s)))
    return orders.add("\x1e" + configs.reindex(orders.index).fillna(""))


def _groups(events: pd.DataFrame, edges: pd.DataFrame) -> list[list[int]]:
    """Ranks sharing one signature, biggest group first (ties: lowest rank)."""
    sigs = _rank_signatures(events, edges)
    ranks = sigs.groupby(sigs, sort=False).groups
    groups = [sorted(int(r) for r in members) for members in ranks.values()]
    return sorted(groups, key=lambda g: (-len(g), g[0]))


def _lane_ranks(groups: list[list[int]], flagged: list[int], max_lanes: int) -> list[int]:
    """Ranks drawn on their own lane: all when few, else flagged, representatives, lowest."""
    every = sorted(r for g in groups for r in g)
    if len(every) <= max_lanes:
        return every
    chosen = dict.fromkeys(flagged + [g[0] for g in groups] + every)
    return sorted(list(chosen)[:max_lanes])


def _group_payload(
    rows: pd.DataFrame, ranks: list[int], edges: pd.DataFrame, units: dict[str, int], start: int
) -> dict[str, Any]:
    """One order signature: its order (units, phases, micro-steps) and edges, embedded once,
    with its lowest rank's timings so the group draws as a lane of its own."""
    mine = edges[edges["rank"] == ranks[0]]
    return {
        "label": rank_ranges(ranks),
        "num_ranks": len(ranks),
        "rep": ranks[0],
        **timeline_lanes.timings(rows, start),
        "u": [units[str(u)] for u in rows["unit"]],
        "p": [PHASE_CODES.get(str(p), 0) for p in rows["phase"]],
        "m": [int(m) for m in rows["micro_step"]],
        "edges": [
            [units[str(u)], PHASE_CODES.get(str(p), 0), units[str(t)]]
            for u, p, t in zip(mine["unit"], mine["phase"], mine["target"], strict=True)
        ],
    }


def _marks(step_findings: pd.DataFrame, units: dict[str, int]) -> list[dict[str, Any]]:
    """Findings placed where they happened: rank, micro-step, phase and unit."""
    rows = step_findings.head(MAX_MARKS_PER_STEP)
    return [
        {
            "rank": int(r),
            "m": None if pd.isna(m) else int(m),
            "p": PHASE_CODES.get(str(p), -1),
            "u": units.get(str(u), -1),
            "check": str(c),
            "message": str(msg),
        }
        for r, m, p, u, c, msg in zip(
            rows["rank"],
            rows["micro_step"],
            rows["phase"],
            rows["unit"],
            rows["check"],
            rows["message"],
            strict=True,
        )
        if pd.notna(r)
    ]


def step_payload(
    trace: Trace,
    findings: pd.DataFrame,
    step: int,
    units: dict[str, int],
    *,
    spans: pd.DataFrame,
    ledger: pd.DataFrame,
    quiet: dict[int, dict[str, Any]] | None = None,
    max_lanes: int = MAX_RANK_LANES,
) -> dict[str, Any]:
    """Everything the page draws for one optimizer step, aggregated by order signature.

    ``spans``: ``unit_spans`` of the whole trace; ``ledger``: ``unsharded.held_over_time``;
    ``quiet``: ``silences.silences``, the silence before each rank's unclean end.
    """
    quiet = quiet or {}
    events = spans[spans["step"] == step].sort_values(["rank", "seq"])
    edges = trace.prefetch_edges(step)
    step_findings = findings[findings["step"] == step]
    members = _groups(events, edges)
    by_rank = dict(tuple(events.groupby("rank")))
    starts = timeline_lanes.step_starts(events, trace.markers, step)
    skews = timeline_lanes.skews(starts, wall_clock.shifts(trace.meta))
    groups = [_group_payload(by_rank[g[0]], g, edges, units, starts[g[0]]) for g in members]
    group_of = {r: i for i, g in enumerate(members) for r in g}
    flagged = [int(r) for r in step_findings["rank"].dropna()]
    lanes = [
        {"group": group_of[r], **timeline_lanes.lane(
            r, by_rank[r], start=starts[r], skew=skews[r], ledger=ledger, step=step),
         "quiet": lane_silence(quiet.get(r), step, starts[r])}
        for r in _lane_ranks(members, flagged, max_lanes)
    ]
    return {
        "step": step,
        "groups": groups,
        "lanes": lanes,
        "group_of": group_of,
        "num_ranks": len(group_of),
        "marks": _marks(step_findings, units),
        "comparisons": comparisons(trace.events, trace.eval_forwards, step_findings, units,
                                   step, ranks=trace.ranks),
    }


def finding_sections(findings: pd.DataFrame, label: Label | None = None
                     ) -> list[dict[str, Any]]:
    """Findings folded across ranks and steps: each cause several checks report (with its
    fix, its checks under it), then each check's other findings in CHECKS order."""
    sections = []
    for block in told.blocks(findings, label=label, max_rows=MAX_ROWS_PER_CHECK):
        parts = [{"name": part.check, "severity": part.severity, "summary": part.summary,
                  "total": part.total, "hidden": part.hidden, "follows": part.follows,
                  "rows": [{"where": row.where, "message": row.message, "step": row.step}
                           for row in part.rows]}
                 for part in block.parts]
        sections.append({"title": block.title, "fix": block.fix, "severity": block.severity,
                         "total": block.total, "parts": parts})
    return sections


def stops(findings: pd.DataFrame, label: Label | None = None) -> list[dict[str, Any]]:
    """Where each stalled rank stopped, one row per rank with its own finding's text (ranks
    that stopped at the same place still ended differently: crashed, killed, waiting)."""
    label = label or labeller({})
    stalled = findings[findings["check"] == stalled_rank_check.NAME]
    where = ["step", "micro_step", "phase", "unit"]
    out = []
    for row in stalled.sort_values(["rank", *where], kind="stable").itertuples(index=False):
        place = {k: getattr(row, k) for k in where}
        place["unit"] = label(place["unit"]) or None
        out.append({"ranks": "" if pd.isna(row.rank) else str(int(row.rank)),
                    "where": _place(place), "message": str(row.message)})
    return out


def _place(place: dict[str, Any]) -> str:
    """``step 2 · micro-step 0 · backward · layers.3``: what a stop table cell says."""
    labels = {"step": "step ", "micro_step": "micro-step ", "phase": "", "unit": ""}
    parts = [f"{labels[k]}{v}" for k, v in place.items() if pd.notna(v)]
    return " · ".join(parts) or "nothing recorded"


def document(
    trace: Trace,
    findings: pd.DataFrame,
    *,
    max_steps: int = MAX_STEPS,
    max_lanes: int = MAX_RANK_LANES,
) -> dict[str, Any]:
    """The JSON the page's script reads: unit names once, then one payload per step."""
    # Edges name units that never ran in a step (a run killed in step 0): all get an index.
    evals = trace.eval_forwards
    names = sorted(
        {str(u) for u in trace.events["unit"].unique()}
        | {str(u) for u in trace.prefetch["unit"].dropna().unique()}
        | {str(u) for u in trace.prefetch["target"].dropna().unique()}
        | ({str(u) for u in evals["unit"].dropna().unique()} if len(evals) else set())
    )
    units = {name: i for i, name in enumerate(names)}
    steps = embedded_steps(trace, findings, max_steps=max_steps)
    spans = unit_spans(trace.events, trace.allgathers, trace.backward_grads)
    ledger = unsharded.held_over_time(trace.allgathers)
    quiet = silences(trace, spans)
    label = labeller(module_types(trace.units))
    return {
        "units": names,
        "labels": [label(n) for n in names],
        "default_step": default_step(findings, steps),
        "num_steps": len(trace.steps),
        "num_ranks": len(trace.ranks),
        "steps": [
            step_payload(trace, findings, s, units, spans=spans, ledger=ledger, quiet=quiet,
                         max_lanes=max_lanes)
            for s in steps
        ],
    }


def render(
    trace: Trace,
    findings: pd.DataFrame,
    out: TextIO,
    *,
    run_dir: str,
    max_steps: int = MAX_STEPS,
    max_lanes: int = MAX_RANK_LANES,
) -> None:
    """Write the report for ``trace`` and its ``findings`` (from ``fsdptrace.analyze``)."""
    data = document(trace, findings, max_steps=max_steps, max_lanes=max_lanes)
    types = module_types(trace.units)
    label = labeller(types)
    page = _ENV.get_template("report.html.j2").render(
        verdict=verdict(findings, num_ranks=len(trace.ranks), world_size=trace.world_size,
                        incomplete=bool(len(incomplete.parse(trace.markers)))),
        failed=bool((findings["severity"] == "error").any()),
        run_dir=run_dir,
        sections=finding_sections(findings, label),
        stops=stops(findings, label),
        data_json=jinja2.utils.markupsafe.Markup(script_json(data)),
        num_embedded=len(data["steps"]),
        num_steps=data["num_steps"],
        memory=memory_view(trace.allgathers, types=types),
        stacks=stack_blocks(trace.stacks),
    )
    out.write(page)
