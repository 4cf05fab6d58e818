"""Check 10, gradient-divergence: ranks disagree on which parameters of a unit hold gradients.

FSDP2 reduce-scatters the parameters that hold gradients (accumulated over the step's
micro-steps), so ranks that differ feed the collective different inputs: a size mismatch that
aborts (gloo), a hang or misaligned data (NCCL), often one micro-step after the divergence,
when the gradients are synced. Reads ``backward_grads`` (written before the reduce-scatter is
issued) and, for units told ``set_reduce_scatter_unused_params``, ``settings``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import ACROSS_RANKS, Check, Merged
from fsdptrace.checks.kernel.majority import against_majority, compared_with
from fsdptrace.checks.kernel.settings import value_at
from fsdptrace.checks.kernel.stops import cut_off_passes
from fsdptrace.reading import incomplete
from fsdptrace.store import schema

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables

NAME = "gradient-divergence"
SEVERITY = findings.ERROR
SLOT = ["rank", "step", "micro_step", "unit"]
# What a unit's next syncing post-backward reduce-scatters: gradients written in this backward,
# carried from a no-sync micro-step, or zeros FSDP2 was told to fill in.
_REDUCED = ("received", "carried", "zero_filled")
_SUMMARY = [*SLOT, "reduced", "received", "told_unused"]
# What the map step keeps, per rank, micro-step and unit, until the reduce: names and parameter
# lists as category codes (a unit's list is the same text on nearly every rank, so it is held
# once), int32 keys. As text, 2,048 ranks kept ~100 MiB here.
_DTYPES = {"rank": "int32", "step": "int32", "micro_step": "int32", "unit": "category",
           "reduced": "category", "received": "category", "told_unused": "bool"}


def summarize(tables: RankTables) -> pd.DataFrame:
    """Per (rank, step, micro_step, unit) post-backward: the parameters it will reduce and those
    written in this backward (sorted, comma-joined), and whether it was told to fill zeros."""
    if not tables.sizes["backward_grads"]:
        return _empty()
    raw = tables.frame("backward_grads").dropna(subset=["param"])
    rows = pd.DataFrame({"rank": raw["rank"].astype("int64"), "step": raw["step"].astype("int64"),
                         "micro_step": raw["micro_step"].astype("int64"),
                         "unit": raw["unit"].astype(str), "param": raw["param"].astype(str),
                         "state": raw["state"].astype(str)})
    # A pass a rank stopped in is cut off: its backward's gradients are not compared.
    cut = cut_off_passes(tables)
    rows = incomplete.outside(rows, cut[cut["phase"] == schema.BACKWARD], "backward_grads",
                              tables.incomplete)
    slots = rows[SLOT].drop_duplicates()
    # A unit with several parameter groups has one post-backward each: take the union.
    for name, states in (("reduced", _REDUCED), ("received", ("received",))):
        picked = rows[rows["state"].isin(states)]
        slots = slots.merge(_joined_params(picked, name), on=SLOT, how="left")
        slots[name] = slots[name].fillna("")
    slots["told_unused"] = _told_unused(tables, slots)
    return slots[_SUMMARY].astype(_DTYPES).reset_index(drop=True)


def _empty() -> pd.DataFrame:
    return pd.DataFrame(columns=_SUMMARY).astype(_DTYPES)


def _joined_params(rows: pd.DataFrame, name: str) -> pd.DataFrame:
    """Per slot of ``rows``, its distinct parameters sorted and comma-joined, as ``name``.

    Plain Python over sorted rows: a pandas aggregation with a function per group cost tens of
    microseconds per slot, and a run has a slot per rank, micro-step and unit.
    """
    rows = rows.drop_duplicates([*SLOT, "param"]).sort_values([*SLOT, "param"], kind="stable")
    joined: dict[tuple, list[str]] = {}
    for key, param in zip(rows[SLOT].itertuples(index=False, name=None), rows["param"],
                          strict=True):
        joined.setdefault(key, []).append(param)
    frame = pd.DataFrame(list(joined), columns=SLOT).astype(
        {"rank": "int64", "step": "int64", "micro_step": "int64", "unit": object})
    return frame.assign(**{name: [", ".join(v) for v in joined.values()]})


def _told_unused(tables: RankTables, slots: pd.DataFrame) -> pd.Series:
    """Per slot, whether ``reduce_scatter_unused_params`` was true then."""
    if not tables.sizes["settings"] or not len(slots):
        return pd.Series(False, index=slots.index)
    return value_at(tables.frame("settings"), slots, "reduce_scatter_unused_params") == "true"


def check(merged: Merged) -> pd.DataFrame:
    """Ranks outside the most common set of reduced parameters, per unit and micro-step."""
    return compare(merged.summaries.get(NAME, _empty()), merged.unit_sets)


def compare(slots: pd.DataFrame, unit_sets: pd.DataFrame) -> pd.DataFrame:
    """``slots``: every rank's ``summarize``; ``unit_sets``: ``order.unit_sets`` of every rank.

    Names stay category codes (one vocabulary: ``analysis.concat``) through the comparison;
    only the rows reported become text.
    """
    if not len(slots) or not len(unit_sets):
        return findings.empty()
    group = ["unit_set", "step", "micro_step", "unit"]
    slots = slots.merge(unit_sets.assign(rank=unit_sets["rank"].astype("int64")), on="rank")
    compared = slots.groupby(group)["rank"].transform("size") >= 2
    # Told to fill the missing gradients with zeros on every rank: correct arithmetic.
    compared &= ~slots.groupby(group)["told_unused"].transform("all").astype(bool)
    slots = slots[compared]
    if not len(slots):
        return findings.empty()
    slots = against_majority(slots, group, "reduced", every_row=True)
    reference = slots[["rank", "step", "micro_step", "unit", "received"]].rename(
        columns={"rank": "reference_rank", "received": "reference_received"})
    slots = slots.merge(reference, on=["reference_rank", "step", "micro_step", "unit"])
    differs = slots[slots["reduced"] != slots["reference"]]
    if not len(differs):
        return findings.empty()
    began = slots[slots["received"] != slots["reference_received"]].groupby(
        ["rank", "step", "unit"])["micro_step"].min().rename("began").reset_index()
    first = differs.sort_values("micro_step").drop_duplicates(["rank", "step", "unit"])
    first = first.merge(began, on=["rank", "step", "unit"], how="left")
    first["began"] = first["began"].fillna(first["micro_step"]).astype("int64")
    # As text: a categorical sorts by code, and codes follow the order batches were read in.
    first = first.astype({"unit": object, "reduced": object, "reference": object})
    return _report(first.sort_values(["step", "rank", "unit"]).reset_index(drop=True))


def _report(rows: pd.DataFrame) -> pd.DataFrame:
    def names(text: str) -> set[str]:
        return {p for p in text.split(", ") if p}

    extra = [sorted(names(a) - names(b)) for a, b in zip(rows["reduced"], rows["reference"],
                                                         strict=True)]
    missing = [sorted(names(b) - names(a)) for a, b in zip(rows["reduced"], rows["reference"],
                                                           strict=True)]
    sides = pd.Series([
        "; ".join(part for part in (
            f"holds gradients for {', '.join(e)} that rank {ref} lacks" if e else "",
            f"lacks gradients for {', '.join(m)} that rank {ref} holds" if m else "") if part)
        for e, m, ref in zip(extra, missing, rows["reference_rank"], strict=True)],
        index=rows.index)
    located = rows.assign(micro_step=rows["began"], phase="backward",
                          parameters=[", ".join(e + m) for e, m in zip(extra, missing,
                                                                       strict=True)])
    message = ("rank " + rows["rank"].astype(str) + "'s backward of " + rows["unit"]
               + " in step " + rows["step"].astype(str) + ", micro-step "
               + rows["micro_step"].astype(str) + ", differs from the set of "
               + compared_with(rows) + ": it " + sides
               + "; the gradients began to differ in micro-step " + rows["began"].astype(str)
               + ": FSDP2 reduce-scatters the parameters holding gradients, so the ranks' "
               + "reduce-scatters of " + rows["unit"] + " get different inputs (a size mismatch "
               + "that aborts on gloo, a hang or misaligned data on NCCL); use the same "
               + "parameters on every rank in every micro-step, or tell the unit "
               + "set_reduce_scatter_unused_params(True) so FSDP2 reduces zeros for the "
               + "missing gradients")
    return findings.make(NAME, SEVERITY, located, message)


CHECK = Check(10, NAME, SEVERITY, ACROSS_RANKS,
              "ranks hold gradients for different parameters of a unit", check,
              summarize=summarize)
