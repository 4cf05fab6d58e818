"""Check 4, rank-divergence: ranks holding the same units ran them in different orders.

Collectives issued in different orders hang or, with equal shapes, silently exchange the wrong
tensors. Works from per-rank order signatures (the map step's output), so it scales to
thousands of ranks; only the few diverging orders are compared unit by unit.
"""

from __future__ import annotations

import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import ACROSS_RANKS, Check, Merged
from fsdptrace.checks.kernel import rank_runs
from fsdptrace.checks.kernel.majority import against_majority, compared_with
from fsdptrace.checks.kernel.order import GROUP, first_difference
from fsdptrace.reading import keys

NAME = "rank-divergence"
SEVERITY = findings.ERROR
_SLOT = ["unit_set", "step", "micro_step", "phase"]
_REFERENCE = ["reference_rank", "num_agree", "num_ranks", "tied", "reference_ranks", "sides"]


def divergent(signatures: pd.DataFrame, unit_sets: pd.DataFrame) -> pd.DataFrame:
    """Minority (rank, step, micro_step, phase) orders with their group's reference rank.

    ``signatures``: every rank's order signatures as runs of ranks (the map step's
    ``rank_runs.code``); only the groups whose ranks do not all agree are spelled out.
    """
    if not len(signatures):
        return pd.DataFrame(columns=GROUP + _REFERENCE)
    sigs = rank_runs.expand(rank_runs.disagreeing(signatures, GROUP[1:], ["signature"]),
                            unit_sets)
    sigs = sigs.assign(phase=sigs["phase"].astype(str))
    return against_majority(sigs, _SLOT, "signature")


def check(merged: Merged) -> pd.DataFrame:
    """Orders compared by signature; only the minority orders and their references are
    re-read and compared call by call."""
    minority = divergent(merged.signatures, merged.unit_sets)
    needed = sorted(set(minority["rank"]) | set(minority["reference_rank"]))
    if not needed:
        return findings.empty()
    wanted = pd.concat([minority[GROUP], minority[GROUP].assign(rank=minority["reference_rank"])])
    return compare(merged.signatures, merged.unit_sets, merged.fetch_orders(needed, wanted),
                   minority)


def compare(signatures: pd.DataFrame, unit_sets: pd.DataFrame, orders: pd.DataFrame,
            minority: pd.DataFrame | None = None) -> pd.DataFrame:
    """``orders``: positioned events of (at least) the diverging and reference ranks.

    ``minority``: ``divergent(signatures, unit_sets)``, when the caller has it already.
    """
    if minority is None:
        minority = divergent(signatures, unit_sets)
    if not len(minority):
        return findings.empty()
    # Only the diverging orders and their references are compared unit by unit.
    references = minority[GROUP].assign(rank=minority["reference_rank"])
    needed = orders[keys.isin(orders, minority, GROUP) | keys.isin(orders, references, GROUP)]
    plain = needed.assign(rank=needed["rank"].astype("int64"), phase=needed["phase"].astype(str),
                          unit=needed["unit"].astype(str))
    left = plain.merge(minority[GROUP], on=GROUP)
    right_keys = minority[GROUP].assign(reference_rank=minority["reference_rank"])
    right = plain.rename(columns={"rank": "reference_rank"}).merge(
        right_keys, on=["reference_rank", "step", "micro_step", "phase"])
    diff = first_difference(left, right, GROUP)
    rows = diff.merge(minority[GROUP + _REFERENCE], on=GROUP)
    rows["position"] = rows["index"]
    rows["unit"] = rows["left_unit"]
    rows["target"] = rows["right_unit"]
    message = ("rank " + rows["rank"].astype(str) + " ran " + rows["left_unit"] + " at index "
               + rows["index"].astype(str) + " of step " + rows["step"].astype(str)
               + ", micro-step " + rows["micro_step"].astype(str) + " " + rows["phase"]
               + " where " + compared_with(rows) + " ran " + rows["right_unit"]
               + ": collectives pair up across ranks in the wrong order "
               + "(hang, or silently swapped parameters); make the execution order "
               + "independent of the rank")
    return findings.make(NAME, SEVERITY, rows, message)


CHECK = Check(4, NAME, SEVERITY, ACROSS_RANKS, "ranks ran units in different orders", check)
