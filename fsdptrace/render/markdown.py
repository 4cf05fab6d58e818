"""Findings as Markdown, for pasting into an issue or a PR."""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

from fsdptrace.reading.unit_names import labeller
from fsdptrace.reading.untrusted import printable
from fsdptrace.render import told
from fsdptrace.render.text import dropped_lines, run_dir_label, unit_labels, verdict

if TYPE_CHECKING:
    from fsdptrace.analysis.result import Analysis


def _cell(text: object) -> str:
    """Escape what would break a table cell or inject markup."""
    value = printable(text)
    for char in ("\\", "|", "`", "*", "_", "<", ">", "[", "]"):
        value = value.replace(char, "\\" + char)
    return value


def render(analysis: Analysis, out: TextIO) -> None:
    """The verdict, then one table per cause several checks report, then one per check
    (every finding, folded)."""
    findings = analysis.findings
    line = verdict(findings, num_ranks=len(analysis.ranks), world_size=analysis.world_size,
                   incomplete=bool(len(analysis.incomplete)))
    out.write(f"# fsdptrace: {line}\n\n")
    out.write(f"Run dir: {_cell(run_dir_label(analysis))}\n")
    for line in dropped_lines(analysis.incomplete):
        out.write(f"\n{_cell(line)}\n")
    label = unit_labels(analysis) if len(findings) else labeller({})
    for block in told.blocks(findings, label=label):
        if block.title is not None:
            out.write(f"\n## Cause: {_cell(block.title)} ({block.severity}, "
                      f"{block.total} findings from {len(block.parts)} checks)\n\n")
            if block.fix:
                out.write(f"**Fix:** {_cell(block.fix)}\n\n")
            out.write("| check | where | what |\n|---|---|---|\n")
            for part in block.parts:
                name = part.check + (" (followed from it)" if part.follows else "")
                for row in part.rows:
                    out.write(f"| {_cell(name)} | {_cell(row.where)} | {_cell(row.message)} |\n")
            continue
        (part,) = block.parts
        out.write(f"\n## {part.check} ({part.severity})\n\n| where | what |\n|---|---|\n")
        for row in part.rows:
            out.write(f"| {_cell(row.where)} | {_cell(row.message)} |\n")
