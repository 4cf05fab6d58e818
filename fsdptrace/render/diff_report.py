"""A ``RunDiff`` as text, Markdown or versioned JSON, most consequential section first."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TextIO

from fsdptrace.reading.untrusted import printable
from fsdptrace.version import __version__
from fsdptrace.views.run_diff import (
    SECTIONS,
    BytesChange,
    EdgeChange,
    FindingChange,
    OrderChange,
    RunDiff,
    SettingChange,
    UnitChange,
)

# Bump when a key of the JSON document changes meaning or goes away.
SCHEMA_VERSION = 1

TITLES = {
    "units": "Units",
    "orders": "Orders (first difference per phase)",
    "prefetch": "Prefetch edges",
    "settings": "Settings",
    "findings": "Findings",
    "allgather_bytes": "Bytes all-gathered, and peak unsharded parameter bytes, per micro-step",
}


def _ranks(ranks: tuple[int, ...], run: RunDiff) -> str:
    if not run.paired_by_rank:
        return "most common rank"
    if ranks == run.ranks:
        return "all ranks"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _unit(change: UnitChange) -> str:
    if change.change == "likely renamed":
        return f"likely renamed: {change.unit} -> {change.new_name} ({change.detail})"
    return f"{change.change}: {change.unit} ({change.detail})"


def _order(change: OrderChange) -> str:
    a = change.unit_a if change.unit_a is not None else "(end)"
    b = change.unit_b if change.unit_b is not None else "(end)"
    return (f"{change.phase}: first differs at position {change.position}: {a} in A, {b} in B "
            f"({change.num_units_a} vs {change.num_units_b} units)")


def _edge(change: EdgeChange) -> str:
    sign = "+" if change.change == "added" else "-"
    return f"{sign} {change.unit} -> {change.target} ({change.phase}), {change.change}"


def _setting(change: SettingChange) -> str:
    return f"{change.unit} {change.setting}: {change.value_a} -> {change.value_b}"


def _finding(change: FindingChange) -> str:
    sign = "+" if change.change == "appeared" else "-"
    where = change.unit + (f" -> {change.target}" if change.target else "")
    return (f"{sign} {change.check} ({change.severity}) {where or '(run)'}: {change.change}, "
            f"{change.count_a} -> {change.count_b} findings")


def _bytes(change: BytesChange) -> str:
    return f"{change.phase}: {change.bytes_a} -> {change.bytes_b} bytes"


LINES: dict[str, Callable[[Any], str]] = {
    "units": _unit, "orders": _order, "prefetch": _edge, "settings": _setting,
    "findings": _finding, "allgather_bytes": _bytes,
}


def _items(run: RunDiff, name: str) -> list[tuple[str, str | None]]:
    """Each change of a section as (what, where); findings carry no ranks."""
    return [(printable(LINES[name](c)),
             _ranks(c.ranks, run) if hasattr(c, "ranks") else None)
            for c in getattr(run, name)]


def verdict(run: RunDiff) -> str:
    if run.same:
        return "SAME: no change in FSDP structure or findings"
    num = sum(len(getattr(run, name)) for name in SECTIONS)
    return f"DIFFERENT: {num} change{'s' if num != 1 else ''}"


def _header(run: RunDiff) -> list[str]:
    how = ("rank by rank" if run.paired_by_rank else
           f"each run's most common rank (world sizes {run.world_size_a} and "
           f"{run.world_size_b})")
    return [f"A: {run.run_a} (world size {run.world_size_a}, step {run.micro_step_a[0]} "
            f"micro-step {run.micro_step_a[1]})",
            f"B: {run.run_b} (world size {run.world_size_b}, step {run.micro_step_b[0]} "
            f"micro-step {run.micro_step_b[1]})",
            f"compared {how}"]


def render_text(run: RunDiff, out: TextIO) -> None:
    out.write(f"fsdptrace diff: {verdict(run)}\n")
    for line in _header(run):
        out.write(f"{printable(line)}\n")
    for name in SECTIONS:
        items = _items(run, name)
        if not items:
            continue
        out.write(f"\n{TITLES[name]} ({len(items)})\n")
        for what, where in items:
            out.write(f"  {what}" + (f"  [{where}]" if where else "") + "\n")


def _md(text: str) -> str:
    """Escape what would turn into Markdown markup."""
    for char in ("\\", "`", "*", "_", "<", ">", "[", "]", "|", "#"):
        text = text.replace(char, "\\" + char)
    return text


def render_markdown(run: RunDiff, out: TextIO) -> None:
    out.write(f"# fsdptrace diff: {verdict(run)}\n\n")
    for line in _header(run):
        out.write(f"- {_md(printable(line))}\n")
    for name in SECTIONS:
        items = _items(run, name)
        if not items:
            continue
        out.write(f"\n## {TITLES[name]} ({len(items)})\n\n")
        for what, where in items:
            # A leading + or - would nest a list: escaped, it stays the sign it is.
            line = _md(what)
            line = "\\" + line if line[:2] in ("+ ", "- ") else line
            out.write(f"- {line}" + (f" ({_md(where)})" if where else "") + "\n")


def document(run: RunDiff) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "fsdptrace_version": __version__,
        "same": run.same,
        "run_a": run.run_a,
        "run_b": run.run_b,
        "world_size_a": run.world_size_a,
        "world_size_b": run.world_size_b,
        "micro_step_a": list(run.micro_step_a),
        "micro_step_b": list(run.micro_step_b),
        "paired_by_rank": run.paired_by_rank,
        "ranks": list(run.ranks),
        **run.sections(),
    }


def render_json(run: RunDiff, out: TextIO) -> None:
    json.dump(document(run), out, indent=2)
    out.write("\n")


RENDERERS = {"text": render_text, "markdown": render_markdown, "json": render_json}
