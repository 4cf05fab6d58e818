"""Analysis, summary and suggestion as JSON documents, for scripts and CI.

Every document opens with ``schema_version`` (of the document's shape, raised when a field
changes meaning or goes away; new fields may appear within a version), ``fsdptrace_version``
and ``kind``. The shapes are declared as JSON Schemas in ``fsdptrace/schemas/`` (``schema_path``)
and described in the README.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import pandas as pd

from fsdptrace.checks.findings import COLUMNS, ERROR, WARNING
from fsdptrace.version import __version__

if TYPE_CHECKING:
    from fsdptrace.analysis.result import Analysis
    from fsdptrace.views.causes import Cause
    from fsdptrace.views.suggest import Suggestion
    from fsdptrace.views.summary import RunSummary

JSON_SCHEMA_VERSION = 1
SCHEMA_FILE = "{kind}.schema.json"
SCHEMAS_DIR = Path(__file__).resolve().parent.parent / "schemas"


def schema_path(kind: str) -> Path:
    """The JSON Schema of one kind of document (``analysis``, ``summary``, ``suggest``)."""
    return SCHEMAS_DIR / SCHEMA_FILE.format(kind=kind)


def _value(value: Any) -> Any:
    if value is None or value is pd.NA or (isinstance(value, float) and pd.isna(value)):
        return None
    if hasattr(value, "item"):
        return value.item()
    return value


def _header(kind: str) -> dict[str, Any]:
    return {"schema_version": JSON_SCHEMA_VERSION, "fsdptrace_version": __version__,
            "kind": kind}


def records(frame: pd.DataFrame, columns: list[str]) -> list[dict[str, Any]]:
    """Rows as JSON objects: missing values become ``null``, numpy scalars plain numbers."""
    return [{c: _value(v) for c, v in zip(columns, values, strict=True)}
            for values in frame[columns].itertuples(index=False, name=None)]


def counts(findings: pd.DataFrame, checks: list[str]) -> dict[str, Any]:
    """Findings per severity, and per check and severity (every check run, zeros too)."""
    per = findings.groupby(["check", "severity"], observed=True).size()
    by_check = {name: {s: int(per.get((name, s), 0)) for s in (ERROR, WARNING)}
                for name in [*checks, *sorted(set(findings["check"].astype(str)) - set(checks))]}
    by_severity = {s: int((findings["severity"] == s).sum()) for s in (ERROR, WARNING)}
    return {"total": len(findings), "by_severity": by_severity, "by_check": by_check}


def document(analysis: Analysis) -> dict[str, Any]:
    """``fsdptrace analyze --format json``: verdict, counts, every finding with its figures
    and the group of its cause (``causes``), how each rank ended and which micro-steps were
    not checked."""
    from fsdptrace.analysis.result import SUMMARY_MAX_RANKS
    from fsdptrace.reading.endings import COLUMNS as ENDING_COLUMNS
    from fsdptrace.reading.incomplete import COLUMNS as INCOMPLETE_COLUMNS
    from fsdptrace.render.text import run_dir_label
    from fsdptrace.views.causes import group
    from fsdptrace.views.summary import overview, overview_of_run_dir

    findings, checks = analysis.findings, list(analysis.checks)
    groups, causes = group(findings)
    # The run in numbers reads the events again, a rank at a time: for small runs only.
    summary = {}
    if len(analysis.ranks) <= SUMMARY_MAX_RANKS:
        summary = (overview_of_run_dir(analysis.run_dir) if analysis.source is None
                   and analysis.run_dir is not None else overview(analysis.trace))
    summary["num_findings"] = len(findings)
    return {**_header("analysis"), "run_dir": run_dir_label(analysis),
            "ranks": list(analysis.ranks), "world_size": analysis.world_size,
            "verdict": analysis.verdict, "checks": checks, "counts": counts(findings, checks),
            "findings": records(findings.assign(group=groups), [*COLUMNS, "group"]),
            "causes": [_cause(c) for c in causes],
            "endings": records(analysis.endings, ENDING_COLUMNS),
            "incomplete": records(analysis.incomplete, INCOMPLETE_COLUMNS),
            "summary": summary}


def _cause(cause: Cause) -> dict[str, Any]:
    """One group of findings: ``shared`` when several checks report one cause (the text
    outputs then tell it once, under the cause)."""
    return {"group": cause.group, "kind": cause.kind, "severity": cause.severity,
            "checks": list(cause.checks), "num_findings": cause.num_findings,
            "shared": cause.is_shared, "unit": cause.unit, "target": cause.target}


def summary_document(run: RunSummary) -> dict[str, Any]:
    """``fsdptrace summary --format json``: the run in numbers, then one object per rank."""
    from fsdptrace.reading.allgathers import overview_line
    from fsdptrace.render.text import run_dir_label

    table = run.per_rank
    return {**_header("summary"), "run_dir": run_dir_label(run), **run.summary,
            "all_gathers": overview_line(run.all_gathers),
            "per_rank": records(table, list(table.columns))}


def suggest_document(suggestion: Suggestion, *, run_dir: str, model: str = "model"
                     ) -> dict[str, Any]:
    """``fsdptrace suggest --format json``: observed orders, the calls, the edge diff."""
    from fsdptrace.views.suggest import prefetch_calls

    diff = suggestion.diff
    return {**_header("suggest"), "run_dir": run_dir,
            "forward_order": list(suggestion.forward_order),
            "backward_order": list(suggestion.backward_order),
            "calls": prefetch_calls(suggestion, model=model) if len(diff) else [],
            "edges": records(diff, ["phase", "unit", "target", "action"])}


def render(analysis: Analysis, out: TextIO) -> None:
    """``--format json`` of ``analyze``."""
    dump(document(analysis), out)


def render_summary(run: RunSummary, out: TextIO) -> None:
    """``--format json`` of ``summary``."""
    dump(summary_document(run), out)


def render_suggest(suggestion: Suggestion, out: TextIO, *, model: str = "model") -> None:
    """``--format json`` of ``suggest``."""
    from fsdptrace.render.text import run_dir_label

    dump(suggest_document(suggestion, run_dir=run_dir_label(suggestion), model=model), out)


def dump(doc: dict[str, Any], out: TextIO) -> None:
    json.dump(doc, out, indent=2)
    out.write("\n")
