"""The report a person reads at 3 a.m.: a verdict, then findings grouped by check."""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

import pandas as pd

from fsdptrace.reading.trace import read_frame
from fsdptrace.reading.unit_names import Label, is_positional, labeller, module_types
from fsdptrace.reading.untrusted import printable
from fsdptrace.render import told
from fsdptrace.render.watcher_text import watcher_lines

if TYPE_CHECKING:
    from fsdptrace.analysis.result import Analysis
    from fsdptrace.views.suggest import Suggestion
    from fsdptrace.views.summary import RunSummary

MAX_LINES_PER_CHECK = 20


def verdict(findings: pd.DataFrame, *, num_ranks: int, world_size: int,
            incomplete: bool = False) -> str:
    """One line: OK / FAIL with counts, so a glance is enough; never OK when rows were lost
    (``incomplete``: what was not recorded was not checked)."""
    errors = int((findings["severity"] == "error").sum())
    warnings = int((findings["severity"] == "warning").sum())
    where = f"{num_ranks} of {world_size} ranks"
    if errors:
        return f"FAIL: {errors} error(s), {warnings} warning(s) across {where}"
    if warnings:
        return f"WARN: no errors, {warnings} warning(s) across {where}"
    if incomplete:
        return f"INCOMPLETE: no findings in what was recorded across {where}"
    return f"OK: no findings across {where}"


def location(row: pd.Series) -> str:
    """Where a folded finding applies, unit names as recorded (``told.location`` labels them)."""
    return told.location(row, labeller({}))


def dropped_lines(incomplete: pd.DataFrame) -> list[str]:
    """One line per rank whose writer dropped rows: an OK verdict does not cover those steps."""
    from fsdptrace.views.summary import incomplete_per_rank

    return [f"rank {row.rank} {row.what} in {row.steps}: those micro-steps were not checked"
            for row in incomplete_per_rank(incomplete).itertuples()]


def render(analysis: Analysis, out: TextIO) -> None:
    """The verdict, what a watcher saw live, the micro-steps no check looked at, then findings
    folded per check."""
    findings = analysis.findings
    out.write(verdict(findings, num_ranks=len(analysis.ranks), world_size=analysis.world_size,
                      incomplete=bool(len(analysis.incomplete))) + "\n")
    out.write(f"run dir: {printable(run_dir_label(analysis))}\n")
    if analysis.run_dir is not None:
        for line in watcher_lines(analysis.run_dir):
            out.write(line + "\n")
    for line in dropped_lines(analysis.incomplete):
        out.write(line + "\n")
    for line in writer_lines(analysis):
        out.write(line + "\n")
    label = unit_labels(analysis) if len(findings) else labeller({})
    write_blocks(told.blocks(findings, label=label, max_rows=MAX_LINES_PER_CHECK), out)


def unit_labels(analysis: Analysis) -> Label:
    """The labels of an analysis's units, reading only the small ``units`` tables (never the
    events) when the run dir has not been loaded, and nothing at all when no finding names a
    positional unit."""
    findings = analysis.findings
    named = pd.concat([findings["unit"], findings["target"]]).dropna().astype(str)
    if not named.map(is_positional).any():
        return labeller({})
    if analysis.source is not None or analysis.run_dir is None or "trace" in vars(analysis):
        return labeller(module_types(analysis.trace.units))
    return labeller(module_types(read_frame(analysis.run_dir, "units", analysis.ranks)))


def write_blocks(blocks: list[told.Block], out: TextIO) -> None:
    """Each cause (its fix, then its checks' findings indented under it), then each check."""
    for block in blocks:
        indent = ""
        if block.title is not None:
            checks = len(block.parts)
            out.write(f"\n[{block.severity}] cause: {printable(block.title)}: {block.total} "
                      f"finding(s) from {checks} checks, one cause\n")
            if block.fix:
                out.write(f"  fix: {printable(block.fix)}\n")
            indent = "  "
        for part in block.parts:
            head = f"[{part.severity}] " if block.title is None else ""
            lead = "\n" if block.title is None else ""
            follows = ", which followed from it" if part.follows else ""
            out.write(f"{lead}{indent}{head}{part.check} ({part.summary}){follows}: "
                      f"{part.total} finding(s)\n")
            for row in part.rows:
                out.write(f"{indent}  - {printable(row.where)}\n")
                out.write(f"{indent}      {printable(row.message)}\n")
            if part.hidden:
                out.write(f"{indent}  ... and {part.hidden} more (all of them: --format json)\n")


def writer_lines(analysis: Analysis) -> list[str]:
    """A line per kind of writer-process trouble (lost, stalled) the ranks recorded, as
    ``summary`` says it: whether the findings hold. Reads only the small ``markers`` table."""
    from fsdptrace.views.summary import writer_trouble

    if analysis.source is not None or analysis.run_dir is None or "trace" in vars(analysis):
        markers = analysis.trace.markers
    else:
        markers = read_frame(analysis.run_dir, "markers", analysis.ranks)
    said = writer_trouble(markers)
    return [f"{name.replace('_', ' ')}: {printable(text)}" for name, text in said.items()
            if text != "none"]


def run_dir_label(analysis: Analysis | RunSummary | Suggestion) -> str:
    """Where the analysis read from, as its outputs name it."""
    return str(analysis.run_dir) if analysis.run_dir is not None else "(a trace in memory)"
