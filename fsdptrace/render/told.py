"""What the text, Markdown and HTML outputs tell, in order: causes first, then each check.

A cause several checks report (``fsdptrace.views.causes``) is one block: what it is, its one fix,
then each check's findings under it, the first check's in its own words and the others as
what followed from it, from their figures. Every other finding is told by its check, folded
as before. The three outputs differ only in markup, so this is computed once here.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from fsdptrace.checks import CHECKS
from fsdptrace.reading.sizes import human_bytes
from fsdptrace.reading.unit_names import Label, labeller
from fsdptrace.render.folding import fold
from fsdptrace.views.causes import DIVERGENCE, EDGE, STALLED, Cause, group
from fsdptrace.views.rank_ranges import rank_ranges


@dataclass(frozen=True)
class Row:
    """One folded line: where, what, and the first step it applies to (the report links it)."""

    where: str
    message: str
    step: int | None


@dataclass(frozen=True)
class Part:
    """One check's findings, folded. ``follows``: told as a consequence of the block's cause."""

    check: str
    severity: str
    summary: str
    total: int
    rows: tuple[Row, ...]
    hidden: int
    follows: bool = False


@dataclass(frozen=True)
class Block:
    """One cause (``title`` and ``fix`` set) or one check's findings (``title`` None)."""

    severity: str
    parts: tuple[Part, ...]
    title: str | None = None
    fix: str | None = None
    group: int | None = None

    @property
    def total(self) -> int:
        return sum(p.total for p in self.parts)


def blocks(findings: pd.DataFrame, *, label: Label | None = None,
           max_rows: int | None = None) -> list[Block]:
    """Shared causes first (errors first), then every check's other findings in contract
    order; at most ``max_rows`` folded lines per check."""
    label = label or labeller({})
    if not len(findings):
        return []
    groups, causes = group(findings)
    shared = {c.group for c in causes if c.is_shared}
    out = []
    for cause in causes:
        if cause.is_shared:
            rows = findings[groups == cause.group]
            parts = tuple(_part(rows[rows["check"] == name], name, label, max_rows,
                                follows=i > 0) for i, name in enumerate(cause.checks))
            out.append(Block(cause.severity, parts, title=_title(cause, rows, label),
                             fix=_fix(cause, rows, label), group=cause.group))
    rest = findings[~groups.isin(shared)]
    present = set(rest["check"])  # not a mask per check of the contract: most have no rows
    for name, info in CHECKS.items():
        if name in present:
            rows = rest[rest["check"] == name]
            out.append(Block(info.severity, (_part(rows, name, label, max_rows),)))
    return out


def location(row: pd.Series, label: Label) -> str:
    """Where a folded finding applies: ranks, steps, micro-steps, phase, unit -> target."""
    parts = []
    for column, name in (("ranks", "rank"), ("steps", "step"), ("micro_steps", "micro-step")):
        values = row[column]
        if values:
            parts.append((name if len(values) == 1 else name + "s") + " " + rank_ranges(values))
    if pd.notna(row["phase"]):
        parts.append(str(row["phase"]))
    if pd.notna(row["unit"]):
        target = f" -> {label(row['target'])}" if pd.notna(row["target"]) else ""
        parts.append(label(row["unit"]) + target)
    return " | ".join(parts)


def _part(rows: pd.DataFrame, check: str, label: Label, max_rows: int | None, *,
          follows: bool = False) -> Part:
    folded = fold(rows)
    shown = folded if max_rows is None else folded.head(max_rows)
    lines = []
    for _, row in shown.iterrows():
        message = _consequence(row, label) if follows else str(row["message"])
        if row["varies"]:
            message += f" (first of {row['count']}; their numbers vary)"
        lines.append(Row(location(row, label), message,
                         row["steps"][0] if row["steps"] else None))
    info = CHECKS[check]
    return Part(check, info.severity, info.summary, int(folded["count"].sum()), tuple(lines),
                len(folded) - len(shown), follows)


def _title(cause: Cause, rows: pd.DataFrame, label: Label) -> str:
    if cause.kind == EDGE:
        phases = _phases(rows[rows["check"] == cause.checks[0]])
        return (f"the {' and '.join(phases)} prefetch edge {label(cause.unit)} -> "
                f"{label(cause.target)}")
    assert cause.kind == DIVERGENCE
    first = rows[rows["check"] == cause.checks[0]]
    ranks = rank_ranges([int(r) for r in first["rank"].dropna()])
    stalled = " and the stop it caused" if STALLED in cause.checks else ""
    return f"{cause.checks[0]} on rank(s) {ranks}{stalled}"


def _fix(cause: Cause, rows: pd.DataFrame, label: Label) -> str | None:
    """The one thing to change, from the findings' fields. A divergence's fix is in its own
    message (it depends on what diverged), told first in the block."""
    if cause.kind != EDGE:
        return None
    unit, target = label(cause.unit), label(cause.target)
    order = rows[rows["check"] == "prefetch-order"]
    fixes = []
    for phase in _phases(order):
        in_phase = order[order["phase"] == phase]
        if in_phase["target_position"].isna().all():
            fixes.append(f"remove {target} from {unit}'s {phase} prefetch targets "
                         f"({target} does not run in {phase})")
        else:
            fixes.append(f"remove {target} from {unit}'s {phase} prefetch targets ({target} "
                         f"runs before {unit}); to overlap a gather, prefetch the unit that "
                         f"runs right after {unit} instead (fsdptrace suggest prints the calls)")
    if fixes:
        return "; ".join(fixes)
    if "wasted-prefetch" in cause.checks:
        wasted = rows[rows["check"] == "wasted-prefetch"]
        if (wasted["call_index"].fillna(1) > 1).any():
            return f"prefetch {target} only from the call of {unit} that runs right before it"
        return f"prefetch {target} from the unit that runs right before it, not from {unit}"
    return f"remove {target} from {unit}'s prefetch targets (FSDP2 had already gathered it)"


def _consequence(row: pd.Series, label: Label) -> str:
    """A finding that follows from its block's cause, from its fields alone. A stalled rank
    keeps its own message: how it ended (the exception, the signal) is not in the cause."""
    unit, target, phase = label(row["unit"]), label(row["target"]), row["phase"]
    if row["check"] == "wasted-prefetch":
        held = f", held {row['held_ms']:.1f} ms" if pd.notna(row["held_ms"]) else ""
        size = f" ({human_bytes(row['bytes'])})" if pd.notna(row["bytes"]) else ""
        return (f"so {target}'s all-gather{size}, prefetched by {unit} in {phase}, went unused "
                f"in that pass{held}")
    if row["check"] == "redundant-prefetch":
        return (f"so {unit}'s {phase} prefetch of {target} did nothing: {target} was still "
                "gathered")
    return str(row["message"])


def _phases(rows: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(str(p) for p in rows["phase"].dropna()))
