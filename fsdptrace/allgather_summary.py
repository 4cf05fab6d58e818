"""All-gather provenance in numbers: how often each unit is gathered, and what is held when.

Answers the questions the ``allgathers`` table exists for before any check fires: does a unit
get gathered more often per optimizer step than its calls need (a wasted or repeated
prefetch), and how many bytes of gathered-but-unconsumed parameters a rank holds over time.
Pure functions over the table, so a notebook and ``fsdptrace summary`` share them.
"""

from __future__ import annotations

import pandas as pd

from fsdptrace.checks.wasted_prefetch import plain

ISSUER_KINDS = ("own", "prefetch", "implicit", "manual", "recompute", "other")
_PER_STEP = ["rank", "step", "unit"]


def per_step(allgathers: pd.DataFrame) -> pd.DataFrame:
    """One row per (rank, optimizer step, unit): all-gathers issued, their bytes, by issuer.

    ``all_gathers`` counts real collectives (``issue`` rows); ``noops`` counts ``unshard()``
    calls that found the unit already gathered or pending.
    """
    columns = [*_PER_STEP, "all_gathers", "num_bytes", *ISSUER_KINDS, "noops"]
    if not len(allgathers):
        return pd.DataFrame(columns=columns)
    rows = plain(allgathers)
    issues = rows[rows["event"] == "issue"]
    counts = (issues.groupby([*_PER_STEP, "issuer_kind"]).size()
              .unstack("issuer_kind", fill_value=0)
              .reindex(columns=list(ISSUER_KINDS), fill_value=0))
    totals = issues.groupby(_PER_STEP).agg(all_gathers=("seq", "size"),
                                           num_bytes=("num_bytes", "sum"))
    noops = rows[rows["event"] == "noop"].groupby(_PER_STEP).size().rename("noops")
    out = totals.join(counts, how="outer").join(noops, how="outer").fillna(0)
    return out.astype("int64").reset_index()[columns]


def bytes_held(allgathers: pd.DataFrame) -> pd.DataFrame:
    """After every issue, consume or drop: bytes gathered and not yet consumed, per unit and rank.

    ``held_bytes`` is that unit's, ``rank_held_bytes`` the whole rank's at that moment.
    """
    columns = ["rank", "seq", "t_ns", "step", "micro_step", "phase", "unit", "event",
               "held_bytes", "rank_held_bytes"]
    if not len(allgathers):
        return pd.DataFrame(columns=columns)
    rows = plain(allgathers)
    rows = rows[rows["event"].isin(["issue", "consume", "drop"])].sort_values(["rank", "seq"])
    sign = rows["event"].map({"issue": 1, "consume": -1, "drop": -1}).astype("int64")
    delta = sign * rows["num_bytes"]
    rows = rows.assign(
        held_bytes=delta.groupby([rows["rank"], rows["unit"], rows["group"]]).cumsum(),
        rank_held_bytes=delta.groupby(rows["rank"]).cumsum(),
    )
    return rows[columns].reset_index(drop=True)


def overview(allgathers: pd.DataFrame) -> dict[str, int]:
    """The table in a few numbers: issues by issuer, no-op prefetches, peak bytes held."""
    if not len(allgathers):
        return {}
    steps = per_step(allgathers)
    held = bytes_held(allgathers)
    numbers = {"issued": int(steps["all_gathers"].sum())}
    numbers.update({kind: int(steps[kind].sum()) for kind in ISSUER_KINDS if steps[kind].any()})
    rows = plain(allgathers)
    numbers["noop_prefetches"] = int(((rows["event"] == "noop")
                                      & (rows["issuer_kind"] == "prefetch")).sum())
    numbers["peak_held_bytes"] = int(held["rank_held_bytes"].max()) if len(held) else 0
    return numbers


def overview_line(allgathers: pd.DataFrame) -> str:
    """One line for ``fsdptrace summary``: 'not recorded' when the run has no provenance."""
    numbers = overview(allgathers)
    if not numbers:
        return "not recorded"
    return ", ".join(f"{key.replace('_', ' ')} {value:,}" for key, value in numbers.items())
