"""Check 10, gradient-divergence: ranks disagree on which parameters of a unit hold gradients.

FSDP2 reduce-scatters the parameters that hold gradients (accumulated over the step's
micro-steps), so ranks that differ feed the collective different inputs: a size mismatch that
aborts (gloo), a hang or misaligned data (NCCL), often one micro-step after the divergence,
when the gradients are synced. Reads ``backward_grads`` (written before the reduce-scatter is
issued) and, for units told ``set_reduce_scatter_unused_params``, ``settings``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import ACROSS_RANKS, Check, Merged
from fsdptrace.checks.kernel import rank_runs
from fsdptrace.checks.kernel.columns import empty_frame
from fsdptrace.checks.kernel.majority import against_majority, compared_with
from fsdptrace.checks.kernel.settings import value_at
from fsdptrace.checks.kernel.stops import cut_off_passes
from fsdptrace.reading import incomplete
from fsdptrace.reading.keys import first_rows, group_ids
from fsdptrace.store import schema

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables

NAME = "gradient-divergence"
SEVERITY = findings.ERROR
SLOT = ["rank", "step", "micro_step", "unit"]
_BITMAP_LIMIT = 1 << 24  # slots x parameters up to which distinct keys are marked, not sorted
_MIX = np.uint64(0x9E3779B97F4A7C15)  # keeps a signature from being a plain sum of hashes
# What a unit's next syncing post-backward reduce-scatters: gradients written in this backward,
# carried from a no-sync micro-step, or zeros FSDP2 was told to fill in.
_REDUCED = ("received", "carried", "zero_filled")
_VALUES = ["reduced", "received", "told_unused"]
_SUMMARY = [*SLOT, *_VALUES]
# Each rank's slots, per micro-step and unit: names and parameter lists as category codes (a
# unit's list is the same text on nearly every rank, so it is held once), int32 keys. The map
# step keeps them as runs of ranks (``rank_runs``): a row per rank and slot was 188 MiB at
# 10,240 ranks x 48 units x 24 micro-steps, and grew with the steps.
_DTYPES = {"rank": "int32", "step": "int32", "micro_step": "int32", "unit": "category",
           "reduced": "category", "received": "category", "told_unused": "bool"}


def summarize(tables: RankTables) -> pd.DataFrame:
    """``rank_slots`` as runs of ranks (``rank_runs.code``): what the reduce compares."""
    return rank_runs.code(rank_slots(tables), tables.unit_sets, SLOT[1:],
                          _VALUES)


def rank_slots(tables: RankTables) -> pd.DataFrame:
    """Per (rank, step, micro_step, unit) post-backward: the parameters it will reduce and those
    written in this backward (sorted, comma-joined), and whether it was told to fill zeros."""
    if not tables.sizes["backward_grads"]:
        return empty_frame(_DTYPES)
    raw = tables.frame("backward_grads").dropna(subset=["param"])
    rows = pd.DataFrame({"rank": raw["rank"].astype("int32"), "step": raw["step"].astype("int32"),
                         "micro_step": raw["micro_step"].astype("int32"),
                         "unit": raw["unit"].astype("category"),
                         "param": raw["param"].astype("category"),
                         "state": raw["state"]})
    # A pass a rank stopped in is cut off: its backward's gradients are not compared.
    cut = cut_off_passes(tables)
    rows = incomplete.outside(rows, cut[cut["phase"] == schema.BACKWARD], "backward_grads",
                              tables.incomplete)
    slot = group_ids(rows, SLOT)
    slots = rows.iloc[first_rows(slot)][SLOT].reset_index(drop=True)
    # A unit with several parameter groups has one post-backward each: take the union.
    state, param = rows["state"], rows["param"]
    for name, states in (("reduced", _REDUCED), ("received", ("received",))):
        picked = state.isin(states).to_numpy()
        slots[name] = _joined_params(param[picked], slot[picked], len(slots))
    slots["told_unused"] = _told_unused(tables, slots)
    units = slots["unit"].cat.remove_unused_categories()  # the names present, sorted
    slots["unit"] = units.cat.reorder_categories(sorted(units.cat.categories.astype(str)))
    return slots[_SUMMARY].astype(_DTYPES).reset_index(drop=True)


def _empty() -> pd.DataFrame:
    return rank_runs.no_runs(_DTYPES, SLOT[1:], _VALUES)


def _joined_params(params: pd.Series, slot: np.ndarray, num_slots: int) -> pd.Categorical:
    """Per slot (``slot``: each row's, of ``num_slots``), the distinct ``params`` of its rows
    sorted and comma-joined; "" for a slot without rows. A categorical of the distinct texts.

    On codes: a run has a slot per rank, micro-step and unit, and nearly all of a unit's slots
    hold the same parameters. Slots are told apart by an order-free signature of their
    parameter codes (``_same_lists`` makes sure equal signatures are equal lists), and each
    distinct list is joined once and never copied per slot. (Plain Python per slot took 12 of
    40 s at 16 deep ranks; a text per slot, made a pandas string, a sixth of what was left.)
    """
    lists = np.full(num_slots, -1, dtype=np.int64)  # each slot's list in ``texts``; -1: none
    texts = np.empty(0, dtype=object)
    if len(params):
        names = params.cat.categories.astype(str).to_numpy(dtype=object)
        ranked = np.argsort(np.argsort(names, kind="stable"), kind="stable")  # sorted code order
        key = _distinct(slot * len(names) + ranked[params.cat.codes.to_numpy()],
                        num_slots * len(names))  # distinct, sorted
        group, code = key // max(len(names), 1), key % max(len(names), 1)
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
        counts = np.diff(np.r_[starts, len(group)])
        mixed = pd.util.hash_array(code.astype(np.uint64)).astype(np.uint64)
        signature = np.add.reduceat(mixed, starts) ^ (counts.astype(np.uint64) * _MIX)
        _, first, which = np.unique(signature, return_index=True, return_inverse=True)
        by_rank = np.sort(names)
        if _same_lists(code, starts, counts, first[which]):
            texts = np.array([", ".join(by_rank[code[starts[g]:starts[g] + counts[g]]])
                              for g in first], dtype=object)
            lists[group[starts]] = which
        else:  # two lists share a signature: join every slot's own
            texts = np.array([", ".join(by_rank[code[a:a + n]])
                              for a, n in zip(starts, counts, strict=True)], dtype=object)
            lists[group[starts]] = np.arange(len(starts))
    if (lists < 0).any():
        lists[lists < 0] = len(texts)
        texts = np.append(texts, "")
    categories, codes = np.unique(texts, return_inverse=True)  # sorted, as astype("category")
    return pd.Categorical.from_codes(codes[lists], categories=categories)


def _distinct(keys: np.ndarray, size: int) -> np.ndarray:
    """``np.unique(keys)`` for keys in ``[0, size)``: marked in a bitmap where it is small
    (no sort of every row: this was most of check 10's summary, which triage pays too)."""
    if size > _BITMAP_LIMIT:
        return np.unique(keys)
    seen = np.zeros(size, dtype=bool)
    seen[keys] = True
    return np.flatnonzero(seen)


def _same_lists(code: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                like: np.ndarray) -> bool:
    """Whether each slot's codes (``code[starts[g]:][:counts[g]]``) equal those of slot
    ``like[g]``, which has the same signature."""
    if (counts != counts[like]).any():
        return False
    offset = np.arange(len(code)) - np.repeat(starts, counts)
    return bool((code == code[np.repeat(starts[like], counts) + offset]).all())


def _told_unused(tables: RankTables, slots: pd.DataFrame) -> pd.Series:
    """Per slot, whether ``reduce_scatter_unused_params`` was true then."""
    if not tables.sizes["settings"] or not len(slots):
        return pd.Series(False, index=slots.index)
    return value_at(tables.frame("settings"), slots, "reduce_scatter_unused_params") == "true"


def check(merged: Merged) -> pd.DataFrame:
    """Ranks outside the most common set of reduced parameters, per unit and micro-step."""
    summary = merged.summaries.get(NAME)
    return compare(_empty() if summary is None else summary, merged.unit_sets)


def compare(runs: pd.DataFrame, unit_sets: pd.DataFrame) -> pd.DataFrame:
    """``runs``: every rank's ``summarize`` (slots as runs of ranks); ``unit_sets``:
    ``order.unit_sets`` of every rank.

    Names stay category codes (one vocabulary: ``analysis.concat``) through the comparison;
    only the groups where ranks disagree get a row per rank, and only the rows reported become
    text.
    """
    if not len(runs) or not len(unit_sets):
        return findings.empty()
    group = ["unit_set", "step", "micro_step", "unit"]
    # Only a rank whose ``reduced`` differs from its group's majority is reported, and it
    # began where ``received`` differs from the reference rank's.
    runs = rank_runs.disagreeing(runs, SLOT[1:], ["reduced", "received"])
    if not len(runs):
        return findings.empty()
    slots = rank_runs.expand(runs, unit_sets)
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
