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

PASS = ["step", "micro_step", "phase"]
COLUMNS = [*PASS, "group", "rank", "count", "others", "unit", "kind", "index"]


def collective_count_differences(collectives: pd.DataFrame) -> pd.DataFrame:
    """Per (step, micro_step, phase) and process group where the ranks' counts differ: each rank
    whose count is not the most common one (every rank when no count is held by a strict
    majority), with ``count``, ``others`` ("rank 0: 8, rank 2: 8"), and the collective with no
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
    uneven = counts.groupby(key)["count"].transform("nunique") > 1
    counts = counts[uneven]
    if not len(counts):
        return pd.DataFrame(columns=COLUMNS)
    found = [_outliers(rows, tuple(k), group) for k, group in counts.groupby(key, sort=True)]
    return pd.concat(found, ignore_index=True)[COLUMNS]


def _outliers(rows: pd.DataFrame, key: tuple, counts: pd.DataFrame) -> pd.DataFrame:
    """The reported ranks of one uneven pass and group (a handful of rows per pass)."""
    by_count = counts["count"].value_counts()
    strict = by_count.iloc[0] * 2 > len(counts)
    common = int(by_count.index[0])
    picked = counts[counts["count"] != common] if strict else counts
    selected = rows[(rows[PASS + ["group"]] == pd.Series(key, index=PASS + ["group"])).all(axis=1)]
    sequences = {int(rank): list(zip(part["unit"], part["kind"], strict=True))
                 for rank, part in selected.sort_values("seq").groupby("rank")}
    out = []
    for rank, count in zip(picked["rank"], picked["count"], strict=True):
        others = counts[counts["rank"] != rank]
        if strict:
            reference = sequences[int(counts.loc[counts["count"] == common, "rank"].iloc[0])]
        else:
            reference = sequences[int(others["rank"].iloc[0])]
        index, unit, kind = _unpaired(sequences[int(rank)], reference)
        out.append((*key, int(rank), int(count),
                    ", ".join(f"rank {r}: {c}" for r, c in zip(others["rank"], others["count"],
                                                                strict=True)),
                    unit, kind, index))
    return pd.DataFrame(out, columns=COLUMNS)


def _unpaired(mine: list[tuple[str, str]], reference: list[tuple[str, str]]
              ) -> tuple[int, str, str]:
    """Where two sequences part ways, and the collective there of the longer one."""
    common = min(len(mine), len(reference))
    index = next((i for i in range(common) if mine[i] != reference[i]), common)
    longer = mine if len(mine) > len(reference) else reference
    unit, kind = longer[index] if index < len(longer) else ("", "")
    return index, unit, kind
