"""Orders side by side for the findings that say "this order differs from that one".

Three checks compare two orders: rank-divergence (a rank's order in a micro-step and phase
against the most common one across ranks), order-instability (a rank's forward order against
its own first recorded micro-step) and eval-divergence (a rank's eval forwards in an eval
interval against the most common ones). A message can only name the first difference; the
report shows both orders whole, the first difference marked, which is what a person needs to
see whether it is a swap, a skip or a different model.

Each comparison is ``{"check", "title", "columns": [{"label", "order", "first_diff",
"reference"}]}`` with orders as indexes into the report's unit names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd

from fsdptrace import schema
from fsdptrace.render.folding import rank_ranges

RANK_DIVERGENCE = "rank-divergence"
ORDER_INSTABILITY = "order-instability"
EVAL_DIVERGENCE = "eval-divergence"
ORDER_CHECKS = (RANK_DIVERGENCE, ORDER_INSTABILITY, EVAL_DIVERGENCE)
MAX_COMPARISONS = 24
MAX_COLUMNS = 8


def comparisons(events: pd.DataFrame, eval_forwards: pd.DataFrame,
                step_findings: pd.DataFrame, units: dict[str, int], step: int
                ) -> list[dict[str, Any]]:
    """Every order comparison the findings of one optimizer ``step`` make, bounded.

    ``events``: the whole run's unit begins (order-instability reaches back to the rank's
    first micro-step); ``eval_forwards``: the run's eval forwards.
    """
    out: list[dict[str, Any]] = []
    diverged = step_findings[step_findings["check"] == RANK_DIVERGENCE]
    in_step = events[events["step"] == step]
    for (micro, phase), rows in diverged.groupby(["micro_step", "phase"], observed=True):
        mine = in_step[(in_step["micro_step"] == micro) & (in_step["phase"] == phase)]
        title = f"{RANK_DIVERGENCE}: step {step}, micro-step {int(micro)}, {phase}"
        out.append(_across_ranks(_orders(mine), _ranks(rows), units, RANK_DIVERGENCE, title))
    unstable = step_findings[step_findings["check"] == ORDER_INSTABILITY]
    out += _unstable(events, unstable, step, units)
    evals = step_findings[step_findings["check"] == EVAL_DIVERGENCE]
    if len(evals) and len(eval_forwards):
        mine = eval_forwards[eval_forwards["step"] == step]
        title = f"{EVAL_DIVERGENCE}: eval forwards in eval interval {step}"
        out.append(_across_ranks(_orders(mine), _ranks(evals), units, EVAL_DIVERGENCE, title))
    return out[:MAX_COMPARISONS]


def _ranks(rows: pd.DataFrame) -> set[int]:
    return {int(r) for r in rows["rank"].dropna()}


def _orders(rows: pd.DataFrame) -> pd.Series:
    """Per rank, its units in recorded order, as a tuple of names."""
    if not len(rows):
        return pd.Series(dtype=object)
    ordered = rows.sort_values(["rank", "seq"], kind="stable")
    return ordered["unit"].astype(str).groupby(ordered["rank"].astype("int64")).agg(tuple)


def _across_ranks(orders: pd.Series, flagged: set[int], units: dict[str, int], check: str,
                  title: str) -> dict[str, Any]:
    """The most common order (ties: the one with the lowest rank) beside each order that a
    flagged rank ran, ranks folded per order."""
    who: dict[tuple[str, ...], list[int]] = {}
    for rank, order in orders.items():
        who.setdefault(order, []).append(int(rank))  # type: ignore[call-overload]
    if not who:
        return {"check": check, "title": title, "columns": []}
    reference = max(who, key=lambda o: (len(who[o]), -min(who[o])))
    columns = [_column("ranks " + rank_ranges(who[reference]), reference, reference, units,
                       is_reference=True)]
    for order, ranks in who.items():
        if order != reference and flagged & set(ranks):
            columns.append(_column("ranks " + rank_ranges(ranks), order, reference, units))
    return {"check": check, "title": title, "columns": columns[:MAX_COLUMNS]}


def _unstable(events: pd.DataFrame, unstable: pd.DataFrame, step: int,
              units: dict[str, int]) -> list[dict[str, Any]]:
    """Each changed forward order beside the rank's first recorded micro-step's; ranks whose
    two orders are the same are folded into one comparison."""
    forward = events[events["phase"] == schema.FORWARD]
    folded: dict[tuple, list[int]] = {}
    for row in unstable.drop_duplicates(["rank", "micro_step"]).itertuples(index=False):
        mine = forward[forward["rank"] == row.rank]
        first = mine.sort_values("seq", kind="stable").head(1)
        if not len(first):
            continue
        ref = (int(first["step"].iloc[0]), int(first["micro_step"].iloc[0]))
        key = (int(row.micro_step), ref, _forward_order(mine, *ref),
               _forward_order(mine, step, int(row.micro_step)))
        folded.setdefault(key, []).append(int(row.rank))
    out = []
    for (micro, ref, reference, changed), ranks in folded.items():
        who = "ranks " + rank_ranges(ranks)
        out.append({
            "check": ORDER_INSTABILITY,
            "title": f"{ORDER_INSTABILITY}: {who}, forward of step {step} micro-step {micro} "
                     f"against their first recorded micro-step",
            "columns": [
                _column(f"{who}, step {ref[0]}.{ref[1]} (first)", reference, reference, units,
                        is_reference=True),
                _column(f"{who}, step {step}.{micro}", changed, reference, units),
            ],
        })
    return out


def _forward_order(forward: pd.DataFrame, step: int, micro: int) -> tuple[str, ...]:
    rows = forward[(forward["step"] == step) & (forward["micro_step"] == micro)]
    return tuple(rows.sort_values("seq", kind="stable")["unit"].astype(str))


def _column(label: str, order: tuple[str, ...], reference: tuple[str, ...],
            units: dict[str, int], *, is_reference: bool = False) -> dict[str, Any]:
    return {"label": label, "order": [units.get(u, -1) for u in order],
            "first_diff": None if is_reference else first_difference(order, reference),
            "reference": is_reference}


def first_difference(order: Iterable[str], reference: Iterable[str]) -> int:
    """The first position where two orders differ (a shorter order differs where it ends)."""
    mine, theirs = list(order), list(reference)
    return next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                min(len(mine), len(theirs)))
