"""``fsdptrace.views.suggest``: the prefetch wiring that matches the order units really ran in.

A person who gets a prefetch-order finding wants the fix, not only the complaint: this module
reads the most common observed order of each phase, proposes "each unit prefetches the unit
that runs after it", says what differs from the edges configured now (add / remove / keep),
and spells the proposal as the FSDP2 calls to paste into the training script.

FSDP2 already prefetches in backward by itself: a unit with no backward targets configured
gathers the unit before it in post-forward order (fsdp2_internals.md, section 7). A proposed
edge FSDP2 was seen doing that way (an ``implicit`` all-gather in the recording) is
``implicit``, not ``add``: pasting it would change nothing but the script's length.

Unit names come from the run dir, and a person pastes this output into Python: names appear
only as Python string literals (``repr``) or as attribute paths of ASCII identifiers, never
raw and never inside a comment, where a newline would end the comment.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import pandas as pd

from fsdptrace.checks.kernel.order import GROUP
from fsdptrace.checks.kernel.positions import COMPLETE_READS
from fsdptrace.checks.kernel.tables import RankTables
from fsdptrace.reading.trace import Trace, read_rank_by_rank
from fsdptrace.reading.unit_names import module_types
from fsdptrace.store import schema

ADD = "add"
REMOVE = "remove"
KEEP = "keep"
IMPLICIT = "implicit"  # FSDP2's default backward prefetch: nothing to add
EDGE_COLUMNS = ["unit", "phase", "target"]
DIFF_COLUMNS = ["unit", "phase", "target", "action"]
ROOT = "<root>"
SETTERS = {schema.FORWARD: "set_modules_to_forward_prefetch",
           schema.BACKWARD: "set_modules_to_backward_prefetch"}

_PART = re.compile(r"^part\[([0-9]+)\](?:\.(.*))?$", re.DOTALL)
_SEPARATOR = "\x1f"  # joins unit names into one order key; never part of an FQN


@dataclass(frozen=True)
class Suggestion:
    """Observed orders, the edges that match them, and the diff against the configured ones."""

    forward_order: tuple[str, ...]
    backward_order: tuple[str, ...]
    proposed: pd.DataFrame  # unit, phase, target
    configured: pd.DataFrame  # unit, phase, target
    diff: pd.DataFrame  # unit, phase, target, action (add / remove / keep)
    run_dir: Path | None = None  # where it was read from (None: a trace in memory)
    # Module types of positional unit names (``fsdptrace.reading.unit_names``), for display.
    module_types: dict[str, str] = field(default_factory=dict)


# Per phase, each order's key (unit names joined by ``_SEPARATOR``) and how often it ran, in
# the order first seen: the most common order is the first of the most frequent.
OrderCounts = dict[str, dict[str, int]]


def observed_order(trace: Trace, phase: str) -> tuple[str, ...]:
    """The most common order of ``phase`` over all ranks and micro-steps, by first positions.

    The cut-off tail of a stalled rank is left out (it was interrupted, not run that way);
    ties go to the order seen first (lowest rank, earliest step).
    """
    counts: OrderCounts = {phase: {}}
    count_orders(trace, counts)
    return most_common(counts[phase])


def count_orders(trace: Trace, counts: OrderCounts) -> None:
    """Add each order ``trace`` ran of the phases in ``counts`` (one per rank, step and
    micro-step) to their counts; ``trace``'s ranks are taken in order, so adding the ranks
    of a run one trace at a time, lowest first, keeps the order they were first seen in.
    ``trace`` holds at least the tables of ``COMPLETE_READS``."""
    calls = RankTables.from_trace(trace).complete
    firsts = calls.frame(calls.first)
    for phase, seen in counts.items():
        positioned = firsts[firsts["phase"] == phase]
        if not len(positioned):
            continue
        keyed = positioned.sort_values(GROUP + ["position"]).assign(
            unit=positioned["unit"].astype(str))
        for key in keyed.groupby(GROUP, observed=True, sort=True)["unit"].agg(_SEPARATOR.join):
            seen[key] = seen.get(key, 0) + 1


def most_common(seen: dict[str, int]) -> tuple[str, ...]:
    """The order counted most often (the first seen among equals); () where none ran."""
    if not seen:
        return ()
    return tuple(max(seen, key=seen.__getitem__).split(_SEPARATOR))


def proposed_edges(forward_order: tuple[str, ...], backward_order: tuple[str, ...]
                   ) -> pd.DataFrame:
    """Each unit prefetches the one after it in its phase's order.

    The root never becomes a forward target: it runs first, so nothing earlier could prefetch it.
    """
    rows = []
    for phase, order in ((schema.FORWARD, forward_order), (schema.BACKWARD, backward_order)):
        for source, target in zip(order[:-1], order[1:], strict=True):
            if phase == schema.FORWARD and target == ROOT:
                continue
            rows.append((source, phase, target))
    return pd.DataFrame(rows, columns=EDGE_COLUMNS, dtype="object")


def configured_edges(trace: Trace) -> pd.DataFrame:
    """Edges in effect at the last recorded step, on any rank (a fix applies to all ranks)."""
    if not len(trace.prefetch):
        return _no_edges()
    last_step = int(trace.prefetch["step"].max())
    edges = trace.prefetch_edges(step=last_step)
    edges = edges.sort_values(["unit", "phase", "target_index"], kind="stable")
    out = edges[EDGE_COLUMNS].astype(str).drop_duplicates()
    return out.reset_index(drop=True)


def _no_edges() -> pd.DataFrame:
    return pd.DataFrame(columns=EDGE_COLUMNS, dtype="object")


def diff_edges(configured: pd.DataFrame, proposed: pd.DataFrame,
               implicit: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per unit and phase: edges to add, to remove, to keep, and those FSDP2 already does by
    default (``implicit``: proposed, not configured, and seen prefetched implicitly)."""
    merged = configured[EDGE_COLUMNS].astype(str).merge(
        proposed[EDGE_COLUMNS].astype(str), on=EDGE_COLUMNS, how="outer", indicator=True)
    action = merged["_merge"].astype(str).map({"left_only": REMOVE, "right_only": ADD,
                                               "both": KEEP})
    if implicit is not None and len(implicit):
        done = merged[EDGE_COLUMNS].merge(implicit[EDGE_COLUMNS].astype(str), how="left",
                                          on=EDGE_COLUMNS, indicator="_done")["_done"]
        action = action.where(~((action == ADD) & (done.to_numpy() == "both")), IMPLICIT)
    out = merged[EDGE_COLUMNS].assign(action=action)
    phase_rank = out["phase"].map({schema.FORWARD: 0, schema.BACKWARD: 1})
    out = out.assign(_phase=phase_rank).sort_values(["_phase", "unit", "action", "target"])
    return out[DIFF_COLUMNS].reset_index(drop=True)


def implicit_edges(trace: Trace) -> pd.DataFrame:
    """The backward edges FSDP2 prefetched by default in this run (all-gathers recorded as
    ``implicit``, issued or found already pending); none without all-gather provenance."""
    gathers = trace.allgathers
    if not len(gathers):
        return _no_edges()
    implicit = gathers[gathers["issuer_kind"].astype(str) == IMPLICIT]
    edges = pd.DataFrame({"unit": implicit["issuer_unit"].astype(str),
                          "phase": implicit["phase"].astype(str),
                          "target": implicit["unit"].astype(str)})
    return edges.drop_duplicates().reset_index(drop=True)


def suggest(trace: Trace) -> Suggestion:
    """The prefetch configuration matching the observed order, and how it differs from now."""
    counts: OrderCounts = {schema.FORWARD: {}, schema.BACKWARD: {}}
    count_orders(trace, counts)
    return _suggestion(counts, trace, implicit_edges(trace))


def suggest_run_dir(run_dir: Path) -> Suggestion:
    """``suggest(load(run_dir))``, holding one rank's events and all-gathers at a time (and
    every rank's meta, units, markers and prefetch snapshots, which are few)."""
    run = read_rank_by_rank(run_dir, ("meta", "units", "markers", "prefetch"))
    counts: OrderCounts = {schema.FORWARD: {}, schema.BACKWARD: {}}
    implicit = []
    for rank in run.traces((*COMPLETE_READS, "allgathers")):
        count_orders(rank, counts)
        implicit.append(implicit_edges(rank))
    found = pd.concat(implicit, ignore_index=True) if implicit else _no_edges()
    return _suggestion(counts, run.whole_trace(),
                       found.drop_duplicates().reset_index(drop=True))


def _suggestion(counts: OrderCounts, trace: Trace, implicit: pd.DataFrame) -> Suggestion:
    """The suggestion from the counted orders, ``trace``'s prefetch snapshots and units, and
    the edges FSDP2 prefetched by default."""
    forward = most_common(counts[schema.FORWARD])
    backward = most_common(counts[schema.BACKWARD])
    proposed = proposed_edges(forward, backward)
    configured = configured_edges(trace)
    return Suggestion(forward_order=forward, backward_order=backward, proposed=proposed,
                      configured=configured, diff=diff_edges(configured, proposed, implicit),
                      run_dir=trace.run_dir, module_types=module_types(trace.units))


def module_expression(unit: str, *, model: str = "model") -> str | None:
    """The Python expression for a unit's module, or None where none exists.

    ``layers.1`` -> ``model.layers[1]``, ``<root>`` -> ``model``, ``part[1].x`` ->
    ``model_parts[1].x``. A grouped unit (``a,b``) is several modules: no one expression names
    it, and an untracked target (``<untracked:T>``) has no known path.
    """
    if "," in unit or unit.startswith("<untracked"):
        return None
    if unit == ROOT:
        return model
    match = _PART.match(unit)
    if match:
        return _attribute_path(f"{model}_parts[{match.group(1)}]", match.group(2) or "")
    return _attribute_path(model, unit)


def _attribute_path(base: str, fqn: str) -> str:
    if not fqn:
        return base
    if not all(_plain(p) or (p.isascii() and p.isdigit()) for p in fqn.split(".")):
        return f"{base}.get_submodule({fqn!r})"
    path = base
    for part in fqn.split("."):
        path += f"[{part}]" if part.isdigit() else f".{part}"
    return path


def _plain(part: str) -> bool:
    """An attribute name that reads as itself: ASCII (Python folds other identifiers with
    NFKC, so ``ﬁ`` would name ``fi``) and no keyword."""
    return part.isascii() and part.isidentifier() and not keyword.iskeyword(part)


def prefetch_calls(suggestion: Suggestion, *, model: str = "model") -> list[str]:
    """The proposal as FSDP2 calls, one per unit and phase whose wiring should exist or change.

    Units whose configured edges are all to be removed get an empty list, so pasting the
    calls undoes the wrong wiring too.
    """
    lines = []
    diff = suggestion.diff
    # A unit whose wiring is only FSDP2's default needs no call: an explicit one would
    # replace the default with the same edge.
    diff = diff[diff.groupby(["phase", "unit"])["action"].transform(
        lambda a: (a != IMPLICIT).any())]
    wanted = diff[diff["action"] != REMOVE]
    for phase, unit in diff[["phase", "unit"]].drop_duplicates().itertuples(index=False):
        targets = wanted[(wanted["phase"] == phase) & (wanted["unit"] == unit)]["target"]
        lines.append(_call(str(unit), str(phase), [str(t) for t in targets], model=model))
    return lines


def _call(unit: str, phase: str, targets: list[str], *, model: str) -> str:
    source = module_expression(unit, model=model)
    exprs = [module_expression(t, model=model) for t in targets]
    if source is None or any(e is None for e in exprs):
        # Data, not a call: names stay string literals, outside the comment.
        return (f"unwired_{phase}_prefetch = ({unit!r}, {targets!r})  # a grouped or "
                "untracked unit has no single module expression: call the setter on the "
                "module fully_shard was given")
    return f"{source}.{SETTERS[phase]}([{', '.join(e for e in exprs if e)}])"


def write_suggestion(suggestion: Suggestion, out: TextIO, *, model: str = "model",
                     types: dict[str, str] | None = None) -> None:
    """The proposal as a person reads it: orders, the calls to paste, the diff, and apart,
    what FSDP2 already does by default. ``types``: module types of positional unit names
    (``fsdptrace.reading.unit_names``), shown beside them."""
    types = types or {}

    def name(unit: str) -> str:
        return repr(unit) + (f" ({types[unit]})" if unit in types else "")

    for phase, order in ((schema.FORWARD, suggestion.forward_order),
                         (schema.BACKWARD, suggestion.backward_order)):
        out.write(f"observed {phase} order: " + " -> ".join(map(name, order)) + "\n")
    diff = suggestion.diff
    if not len(diff):
        out.write("\nno units ran: nothing to suggest\n")
        return
    calls = prefetch_calls(suggestion, model=model)
    changes = diff[diff["action"].isin([ADD, REMOVE])]
    if len(changes):
        out.write("\n# prefetch matching the observed order (FSDP2):\n")
        for line in calls:
            out.write(line + "\n")
    else:
        out.write("\nnothing to add or remove: the configured prefetch matches the observed "
                  "order\n")
    explicit = diff[diff["action"] != IMPLICIT]
    if len(explicit):
        out.write("\n# against what is configured now:\n")
        for row in explicit.itertuples(index=False):
            sign = {ADD: "+", REMOVE: "-", KEEP: " "}[row.action]
            out.write(f"{sign} {row.phase:<8} {name(row.unit)} -> {name(row.target)}  "
                      f"({row.action})\n")
    implicit = diff[diff["action"] == IMPLICIT]
    if len(implicit):
        out.write("\n# FSDP2 already does these by default (implicit backward prefetch): "
                  "nothing to add\n")
        for row in implicit.itertuples(index=False):
            out.write(f"  {row.phase:<8} {name(row.unit)} -> {name(row.target)}  (implicit)\n")
