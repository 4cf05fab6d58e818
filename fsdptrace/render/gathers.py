"""Each recorded all-gather from its issue to its consume: what the timeline draws as a flow.

The ``allgathers`` table (FSDP2 provenance) has one ``issue`` row when a parameter group's
all-gather is started (by the unit itself, a prefetching unit, or FSDP2's implicit backward
prefetch) and one ``consume`` row when a unit waits for it and uses it; a gather never used
ends with ``reshard`` or ``drop`` instead. Rows of one gather share (rank, unit, group) and
follow each other in ``seq``; a consume before any issue belongs to a gather started before
recording began and is left out.
"""

from __future__ import annotations

import pandas as pd

GATHER_COLUMNS = ["rank", "unit", "group", "issue_seq", "issue_ns", "end_seq", "end_ns",
                  "end_event", "step", "micro_step", "phase", "end_phase", "issuer_kind",
                  "issuer_unit", "num_bytes"]
_KEY = ["rank", "unit", "group"]
_ENDS = ("consume", "reshard", "drop")


def gathers(allgathers: pd.DataFrame) -> pd.DataFrame:
    """One row per issued all-gather, ending at its first consume (else reshard or drop)."""
    if not len(allgathers):
        return pd.DataFrame(columns=GATHER_COLUMNS)
    rows = allgathers.assign(
        event=allgathers["event"].astype(str), unit=allgathers["unit"].astype(str),
        phase=allgathers["phase"].astype(str),
        issuer_unit=allgathers["issuer_unit"].astype(object).where(
            allgathers["issuer_unit"].notna(), None),
        issuer_kind=allgathers["issuer_kind"].astype(object).where(
            allgathers["issuer_kind"].notna(), None),
    )
    rows = rows[rows["event"].isin(("issue", *_ENDS))].sort_values([*_KEY, "seq"],
                                                                    kind="stable")
    rows["gather"] = (rows["event"] == "issue").astype("int64").groupby(
        [rows[k] for k in _KEY]).cumsum()
    rows = rows[rows["gather"] > 0]
    issues = rows[rows["event"] == "issue"]
    ends = rows[rows["event"] != "issue"].copy()
    # The first consume wins; without one, the reshard or drop that ended the hold.
    ends["rank_of_end"] = (ends["event"] != "consume").astype("int64")
    first = (ends.sort_values([*_KEY, "gather", "rank_of_end", "seq"], kind="stable")
             .drop_duplicates([*_KEY, "gather"]))
    paired = issues.merge(first[[*_KEY, "gather", "seq", "t_ns", "event", "phase"]],
                          on=[*_KEY, "gather"], how="inner", suffixes=("", "_end"))
    out = pd.DataFrame({
        "rank": paired["rank"].astype("int64"), "unit": paired["unit"],
        "group": paired["group"].astype("int64"),
        "issue_seq": paired["seq"].astype("int64"), "issue_ns": paired["t_ns"].astype("int64"),
        "end_seq": paired["seq_end"].astype("int64"),
        "end_ns": paired["t_ns_end"].astype("int64"), "end_event": paired["event_end"],
        "step": paired["step"].astype("int64"), "micro_step": paired["micro_step"].astype("int64"),
        "phase": paired["phase"], "end_phase": paired["phase_end"],
        "issuer_kind": paired["issuer_kind"], "issuer_unit": paired["issuer_unit"],
        "num_bytes": paired["num_bytes"].astype("int64"),
    })
    return out.sort_values(["rank", "issue_seq"], kind="stable").reset_index(drop=True)


def lanes(starts: list[int], ends: list[int]) -> list[int]:
    """A lane per gather so that gathers on one lane never overlap (first free lane wins).

    Trace viewers nest slices of one track by time; two gathers in flight at once on one
    track would be drawn as parent and child, which they are not.
    """
    free_at: list[int] = []
    out = []
    for start, end in zip(starts, ends, strict=True):
        lane = next((i for i, t in enumerate(free_at) if t <= start), len(free_at))
        if lane == len(free_at):
            free_at.append(end)
        else:
            free_at[lane] = end
        out.append(lane)
    return out
