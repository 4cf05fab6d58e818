"""Findings as Markdown, for pasting into an issue or a PR."""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

from fsdptrace.checks import CHECKS
from fsdptrace.render.folding import fold
from fsdptrace.render.text import dropped_lines, location, run_dir_label, verdict
from fsdptrace.render.untrusted import printable

if TYPE_CHECKING:
    from fsdptrace.result import Analysis


def _cell(text: object) -> str:
    """Escape what would break a table cell or inject markup."""
    value = printable(text)
    for char in ("\\", "|", "`", "*", "_", "<", ">", "[", "]"):
        value = value.replace(char, "\\" + char)
    return value


def render(analysis: Analysis, out: TextIO) -> None:
    """The verdict, then one table per check with findings (every finding, folded)."""
    findings = analysis.findings
    line = verdict(findings, num_ranks=len(analysis.ranks), world_size=analysis.world_size)
    out.write(f"# fsdptrace: {line}\n\n")
    out.write(f"Run dir: {_cell(run_dir_label(analysis))}\n")
    for line in dropped_lines(analysis.incomplete):
        out.write(f"\n{_cell(line)}\n")
    folded = fold(findings)
    for name, info in CHECKS.items():
        rows = folded[folded["check"] == name]
        if not len(rows):
            continue
        out.write(f"\n## {name} ({info.severity})\n\n| where | what |\n|---|---|\n")
        for _, row in rows.iterrows():
            out.write(f"| {_cell(location(row))} | {_cell(row['message'])} |\n")
