"""The report a person reads at 3 a.m.: a verdict, then findings grouped by check."""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

import pandas as pd

from fsdptrace.checks import CHECKS
from fsdptrace.render.folding import fold, rank_ranges
from fsdptrace.render.untrusted import printable

if TYPE_CHECKING:
    from fsdptrace.result import Analysis

MAX_LINES_PER_CHECK = 20


def verdict(findings: pd.DataFrame, *, num_ranks: int, world_size: int) -> str:
    """One line: OK / FAIL with counts, so a glance is enough."""
    errors = int((findings["severity"] == "error").sum())
    warnings = int((findings["severity"] == "warning").sum())
    where = f"{num_ranks} of {world_size} ranks"
    if errors:
        return f"FAIL: {errors} error(s), {warnings} warning(s) across {where}"
    if warnings:
        return f"WARN: no errors, {warnings} warning(s) across {where}"
    return f"OK: no findings across {where}"


def location(row: pd.Series) -> str:
    """Where a finding applies: ranks, step, micro-step, phase, unit -> target."""
    parts = []
    for column, label in (("ranks", "rank"), ("steps", "step"), ("micro_steps", "micro-step")):
        values = row[column]
        if values:
            parts.append((label if len(values) == 1 else label + "s") + " "
                         + rank_ranges(values))
    if pd.notna(row["phase"]):
        parts.append(str(row["phase"]))
    if pd.notna(row["unit"]):
        unit = str(row["unit"])
        parts.append(unit + (f" -> {row['target']}" if pd.notna(row["target"]) else ""))
    return " | ".join(parts)


def dropped_lines(incomplete: pd.DataFrame) -> list[str]:
    """One line per rank whose writer dropped rows: an OK verdict does not cover those steps."""
    from fsdptrace.summary import incomplete_per_rank

    lost = {True: "dropped {n:,} rows", False: "could not read a chunk"}
    return [f"rank {row.rank} {lost[row.num_rows > 0].format(n=row.num_rows)} in {row.steps}: "
            "those micro-steps were not checked"
            for row in incomplete_per_rank(incomplete).itertuples()]


def render(analysis: Analysis, out: TextIO) -> None:
    """The verdict, the micro-steps no check looked at, then findings folded per check."""
    findings = analysis.findings
    out.write(verdict(findings, num_ranks=len(analysis.ranks), world_size=analysis.world_size)
              + "\n")
    out.write(f"run dir: {printable(run_dir_label(analysis))}\n")
    for line in dropped_lines(analysis.incomplete):
        out.write(line + "\n")
    if not len(findings):
        return
    folded = fold(findings)
    for name, info in CHECKS.items():
        rows = folded[folded["check"] == name]
        if not len(rows):
            continue
        total = int(rows["count"].sum())
        out.write(f"\n[{info.severity}] {name} ({info.summary}): {total} finding(s)\n")
        for _, row in rows.head(MAX_LINES_PER_CHECK).iterrows():
            out.write(f"  - {printable(location(row))}\n")
            example = f" (first of {row['count']}; their numbers vary)" if row["varies"] else ""
            out.write(f"      {printable(str(row['message']))}{example}\n")
        if len(rows) > MAX_LINES_PER_CHECK:
            out.write(f"  ... and {len(rows) - MAX_LINES_PER_CHECK} more "
                      "(all of them: --format json)\n")


def run_dir_label(analysis: Analysis) -> str:
    """Where the analysis read from, as its outputs name it."""
    return str(analysis.run_dir) if analysis.run_dir is not None else "(a trace in memory)"
