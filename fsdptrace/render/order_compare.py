"""Orders side by side for the findings that say "this order differs from that one".

Three checks compare two orders: rank-divergence (a rank's order in a micro-step and phase
against the most common one across ranks), order-instability (a rank's forward order against
its own first recorded micro-step) and eval-divergence (a rank's eval forwards in an eval
interval against the most common ones). A message can only name the first difference; the
report shows both orders whole, the first difference marked, which is what a person needs to
see whether it is a swap, a skip or a different model.

Each comparison is ``{"check", "title", "columns": [{"label", "order", "first_diff",
"reference"}]}`` with orders as indexes into the report's unit names.

The report re-reads the orders to draw them, never to judge them: the reference is the one
the check's own majority rule picks (``checks.majority``, ties included), and a flagged
rank's first difference is its finding's ``position``, so the page cannot mark another unit
than the finding names. Only a column no finding covers gets its first difference computed,
with the checks' ``first_difference_of``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd

from fsdptrace.checks import eval_divergence, order_instability, rank_divergence
from fsdptrace.checks.kernel.majority import against_majority
from fsdptrace.checks.kernel.order import first_difference_of
from fsdptrace.store import schema
from fsdptrace.views.rank_ranges import rank_ranges

RANK_DIVERGENCE = rank_divergence.NAME
ORDER_INSTABILITY = order_instability.NAME
EVAL_DIVERGENCE = eval_divergence.NAME
ORDER_CHECKS = (RANK_DIVERGENCE, ORDER_INSTABILITY, EVAL_DIVERGENCE)
MAX_COMPARISONS = 24
MAX_COLUMNS = 8
_SEP = "\x1f"  # joins an order's unit names into one majority value


def comparisons(events: pd.DataFrame, eval_forwards: pd.DataFrame,
                step_findings: pd.DataFrame, units: dict[str, int], step: int, *,
                ranks: Iterable[int] = ()) -> list[dict[str, Any]]:
    """Every order comparison the findings of one optimizer ``step`` make, bounded.

    ``events``: the whole run's unit begins (order-instability reaches back to the rank's
    first micro-step); ``eval_forwards``: the run's eval forwards; ``ranks``: every rank of
    the run, so that a rank that ran nothing an order holds (no eval forward in the interval)
    gets its column, empty, instead of none.
    """
    everyone = sorted({int(r) for r in ranks})
    out: list[dict[str, Any]] = []
    diverged = step_findings[step_findings["check"] == RANK_DIVERGENCE]
    in_step = events[events["step"] == step]
    for (micro, phase), rows in diverged.groupby(["micro_step", "phase"], observed=True):
        mine = in_step[(in_step["micro_step"] == micro) & (in_step["phase"] == phase)]
        title = f"{RANK_DIVERGENCE}: step {step}, micro-step {int(micro)}, {phase}"
        out.append(_across_ranks(_orders(mine), rows, units, RANK_DIVERGENCE, title))
    unstable = step_findings[step_findings["check"] == ORDER_INSTABILITY]
    out += _unstable(events, unstable, step, units)
    evals = step_findings[step_findings["check"] == EVAL_DIVERGENCE]
    if len(evals) and len(eval_forwards):
        mine = eval_forwards[eval_forwards["step"] == step]
        title = f"{EVAL_DIVERGENCE}: eval forwards in eval interval {step}"
        out.append(_across_ranks(_orders(mine, everyone), evals, units, EVAL_DIVERGENCE, title))
    return out[:MAX_COMPARISONS]


def _orders(rows: pd.DataFrame, ranks: list[int] | None = None) -> pd.Series:
    """Per rank, its units in recorded order, as a tuple of names; each of ``ranks`` that
    recorded none gets the empty order."""
    if len(rows):
        ordered = rows.sort_values(["rank", "seq"], kind="stable")
        found = ordered["unit"].astype(str).groupby(ordered["rank"].astype("int64")).agg(tuple)
    else:
        found = pd.Series(dtype=object)
    missing = [r for r in ranks or [] if r not in found.index]
    if not missing:
        return found
    empty = pd.Series([()] * len(missing), index=missing, dtype=object)
    return pd.concat([found, empty]).sort_index()


def _across_ranks(orders: pd.Series, found: pd.DataFrame, units: dict[str, int], check: str,
                  title: str) -> dict[str, Any]:
    """The check's reference order beside every other order, ranks folded per order: every
    rank has a column, the flagged ones' first (a rank that ran nothing has an empty one)."""
    who: dict[tuple[str, ...], list[int]] = {}
    for rank, order in orders.items():
        who.setdefault(order, []).append(int(rank))  # type: ignore[call-overload]
    if not who:
        return {"check": check, "title": title, "columns": []}
    reference = _reference(orders)
    flagged = {int(r) for r in found["rank"].dropna()}
    positions = _positions(found)
    columns = [_column("ranks " + rank_ranges(who[reference]), reference, None, units)]
    others = sorted((o for o in who if o != reference),
                    key=lambda o: (not flagged & set(who[o]), min(who[o])))
    for order in others:
        told = next((positions[r] for r in who[order] if r in positions), None)
        first = told if told is not None else first_difference_of(order, reference)[0]
        columns.append(_column("ranks " + rank_ranges(who[order]), order, first, units))
    return {"check": check, "title": title, "columns": columns[:MAX_COLUMNS]}


def _reference(orders: pd.Series) -> tuple[str, ...]:
    """The order the check compared the flagged ranks with: the majority's, and with no
    majority the side holding the lowest rank (the side every other side was set against)."""
    if len(orders) < 2:
        return orders.iloc[0]
    rows = pd.DataFrame({"rank": [int(r) for r in orders.index], "slot": 0,
                         "order": [_SEP.join(o) for o in orders]})
    compared = against_majority(rows, ["slot"], "order", every_row=True)
    return orders[int(compared["reference_rank"].min())]


def _positions(found: pd.DataFrame) -> dict[int, int]:
    """Each flagged rank's first difference, as its finding gives it (``position``)."""
    if "position" not in found:
        return {}
    told = found.dropna(subset=["rank", "position"])
    return {int(r): int(p) for r, p in zip(told["rank"], told["position"], strict=True)}


def _unstable(events: pd.DataFrame, unstable: pd.DataFrame, step: int,
              units: dict[str, int]) -> list[dict[str, Any]]:
    """Each changed forward order beside the rank's first recorded micro-step's; ranks whose
    two orders are the same are folded into one comparison."""
    forward = events[events["phase"] == schema.FORWARD]
    folded: dict[tuple, list[int]] = {}
    positions = _positions(unstable)
    for row in unstable.drop_duplicates(["rank", "micro_step"]).itertuples(index=False):
        mine = forward[forward["rank"] == row.rank]
        first = mine.sort_values("seq", kind="stable").head(1)
        if not len(first):
            continue
        ref = (int(first["step"].iloc[0]), int(first["micro_step"].iloc[0]))
        reference = _forward_order(mine, *ref)
        changed = _forward_order(mine, step, int(row.micro_step))
        first = positions.get(int(row.rank), first_difference_of(changed, reference)[0])
        key = (int(row.micro_step), ref, reference, changed, first)
        folded.setdefault(key, []).append(int(row.rank))
    out = []
    for (micro, ref, reference, changed, first), ranks in folded.items():
        who = "ranks " + rank_ranges(ranks)
        out.append({
            "check": ORDER_INSTABILITY,
            "title": f"{ORDER_INSTABILITY}: {who}, forward of step {step} micro-step {micro} "
                     f"against their first recorded micro-step",
            "columns": [
                _column(f"{who}, step {ref[0]}.{ref[1]} (first)", reference, None, units),
                _column(f"{who}, step {step}.{micro}", changed, first, units),
            ],
        })
    return out


def _forward_order(forward: pd.DataFrame, step: int, micro: int) -> tuple[str, ...]:
    rows = forward[(forward["step"] == step) & (forward["micro_step"] == micro)]
    return tuple(rows.sort_values("seq", kind="stable")["unit"].astype(str))


def _column(label: str, order: tuple[str, ...], first_diff: int | None,
            units: dict[str, int]) -> dict[str, Any]:
    """One drawn order; ``first_diff`` None marks the reference."""
    return {"label": label, "order": [units.get(u, -1) for u in order],
            "first_diff": first_diff, "reference": first_diff is None}
