"""Ranks that issued different numbers of FSDP collectives in the same pass (contract v3).

Collectives pair up by their order on a process group: a rank that issues one all-gather
fewer in a pass (a skipped layer, a dropped expert) makes every later collective of the
group meet the wrong partner, which hangs, aborts on a size check, or silently exchanges the
wrong tensors. This is one input of stalled-rank's root cause (docs/checks.md 6, "a different
number of collectives issued in the same pass"); the verdict decides what to blame.

Pure: the ``collectives`` table in, one row per rank whose count differs, out.
"""

from __future__ import annotations

import pandas as pd

from fsdptrace.checks.kernel.majority import against_majority
from fsdptrace.checks.kernel.order import first_difference_of

PASS = ["step", "micro_step", "phase"]
COLUMNS = [*PASS, "group", "rank", "count", "others", "unit", "kind", "index"]


def collective_count_differences(collectives: pd.DataFrame) -> pd.DataFrame:
    """Per (step, micro_step, phase) and process group where the ranks' counts differ: each rank
    whose count is not the majority's (``majority.against_majority``: every rank when there is
    none), with ``count``, ``others`` ("rank 0: 8, rank 2: 8"), and the collective with no
    partner: ``unit`` and ``kind`` of the first collective where this rank's sequence and the
    others' part ways, taken from the side that issued more, at ``index`` (0-based)."""
    if not len(collectives):
        return pd.DataFrame(columns=COLUMNS)
    rows = pd.DataFrame({
        "rank": collectives["rank"].astype("int64"),
        "seq": collectives["seq"].astype("int64"),
        "step": collectives["step"].astype("int64"),
        "micro_step": collectives["micro_step"].astype("int64"),
        "phase": collectives["phase"].astype(str),
        "group": collectives["group"].astype(object).where(collectives["group"].notna(), ""),
        "unit": collectives["unit"].astype(str), "kind": collectives["kind"].astype(str)})
    key = [*PASS, "group"]
    counts = rows.groupby([*key, "rank"], sort=True).size().rename("count").reset_index()
    counts = counts[counts.groupby(key)["count"].transform("nunique") > 1]
    differs = against_majority(counts, key, "count")
    if not len(differs):
        return pd.DataFrame(columns=COLUMNS)
    differs = differs.sort_values([*key, "rank"])
    uneven = rows.merge(counts[key].drop_duplicates(), on=key).sort_values("seq")
    sequences = {(tuple(k), int(rank)): list(zip(part["unit"], part["kind"], strict=True))
                 for (*k, rank), part in uneven.groupby([*key, "rank"])}
    out = []
    for row in differs.itertuples(index=False):
        where = tuple(getattr(row, c) for c in key)
        group = counts[(counts[key] == pd.Series(where, index=key)).all(axis=1)]
        others = group[group["rank"] != row.rank]
        index, unit, kind = _unpaired(sequences[(where, int(row.rank))],
                                      sequences[(where, int(row.reference_rank))])
        out.append((*where, int(row.rank), int(row.count),
                    ", ".join(f"rank {r}: {c}" for r, c in zip(others["rank"], others["count"],
                                                                strict=True)),
                    unit, kind, index))
    return pd.DataFrame(out, columns=COLUMNS)


def _unpaired(mine: list[tuple[str, str]], reference: list[tuple[str, str]]
              ) -> tuple[int, str, str]:
    """Where two sequences part ways, and the collective there of the one that issued more."""
    index = first_difference_of(mine, reference)[0]
    unit, kind = (mine if len(mine) > len(reference) else reference)[index]
    return index, unit, kind
