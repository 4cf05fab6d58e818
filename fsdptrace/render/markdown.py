"""Findings as Markdown, for pasting into an issue or a PR."""

from __future__ import annotations

from typing import TextIO

import pandas as pd

from fsdptrace.checks import CHECKS
from fsdptrace.render.folding import fold
from fsdptrace.render.text import location, verdict
from fsdptrace.render.untrusted import printable


def _cell(text: object) -> str:
    """Escape what would break a table cell or inject markup."""
    value = printable(text)
    for char in ("\\", "|", "`", "*", "_", "<", ">", "[", "]"):
        value = value.replace(char, "\\" + char)
    return value


def render(findings: pd.DataFrame, out: TextIO, *, run_dir: str, num_ranks: int,
           world_size: int) -> None:
    out.write(f"# fsdptrace: {verdict(findings, num_ranks=num_ranks, world_size=world_size)}\n\n")
    out.write(f"Run dir: {_cell(run_dir)}\n")
    folded = fold(findings)
    for name, info in CHECKS.items():
        rows = folded[folded["check"] == name]
        if not len(rows):
            continue
        out.write(f"\n## {name} ({info.severity})\n\n| where | what |\n|---|---|\n")
        for _, row in rows.iterrows():
            out.write(f"| {_cell(location(row))} | {_cell(row['message'])} |\n")
