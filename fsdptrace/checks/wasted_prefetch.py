"""Check 8, wasted-prefetch: a prefetched all-gather its target did not use in that pass.

A prefetch exists to overlap the target's all-gather with the source's compute in the same
phase. When the target does not consume it in that phase of that micro-step, the gathered
parameters sit in memory (into backward, into the next micro-step) or FSDP2 drops them in
``finalize_backward``: memory held and bandwidth spent for nothing. Needs the ``allgathers``
table (all-gather provenance); without it the check finds nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import PER_RANK, Check

if TYPE_CHECKING:
    from fsdptrace.checks.tables import RankTables

NAME = "wasted-prefetch"
SEVERITY = findings.WARNING
# Issuers that are prefetches: configured edges and FSDP2's implicit backward prefetch.
# Forward prefetches fired again by checkpoint recompute are ``recompute`` and not counted:
# CHECKS.md keeps recompute out of forward findings.
PREFETCH_KINDS = ("prefetch", "implicit")
_PASS = ["step", "micro_step", "phase"]
_ORDINALS = {1: "first", 2: "second", 3: "third", 4: "fourth", 5: "fifth"}


def plain(allgathers: pd.DataFrame) -> pd.DataFrame:
    """Categoricals as plain strings and ints as int64, so joins never trip on categories."""
    out = allgathers.copy()
    for column in ("phase", "unit", "event", "issuer_kind", "issuer_unit", "detail"):
        if column in out:
            out[column] = out[column].astype(object).astype(str)
    for column in ("rank", "step", "micro_step", "group", "seq", "t_ns", "num_bytes"):
        if column in out:
            out[column] = out[column].astype("int64")
    return out


def with_occurrence(rows: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """Add ``occurrence``: which call of the issuing unit in that pass issued the row.

    The recorder writes a unit's entry before FSDP's pre-forward/pre-backward runs, so the
    issuing call is the source's latest entry with a smaller seq in the same pass.
    """
    if not len(rows):
        return rows.assign(occurrence=pd.Series(dtype="Int64"))
    keys = ["rank", *_PASS, "issuer_unit"]
    entries = events.assign(
        rank=events["rank"].astype("int64"), step=events["step"].astype("int64"),
        micro_step=events["micro_step"].astype("int64"), phase=events["phase"].astype(str),
        issuer_unit=events["unit"].astype(str), entry_seq=events["seq"].astype("int64"),
    )[[*keys, "entry_seq"]].sort_values("entry_seq")
    entries["occurrence"] = entries.groupby(keys).cumcount() + 1
    left = rows.assign(issuer_unit=rows["issuer_unit"].fillna("").astype(str),
                       phase=rows["phase"].astype(str)).sort_values("seq")
    merged = pd.merge_asof(left, entries, left_on="seq", right_on="entry_seq", by=keys,
                           direction="backward")
    merged["occurrence"] = merged["occurrence"].astype("Int64")
    return merged.drop(columns="entry_seq")


def call_label(rows: pd.DataFrame) -> pd.Series:
    """'second call of tok_embeddings in forward' (or 'a call of ...' when unknown)."""
    ordinal = rows["occurrence"].map(
        lambda n: "a" if pd.isna(n) else _ORDINALS.get(int(n), f"{int(n)}th"))
    return ordinal + " call of " + rows["issuer_unit"].astype(str) + " in " + rows["phase"]


def paired(allgathers: pd.DataFrame) -> pd.DataFrame:
    """Each issue with the consume or drop that ended it (``end_*`` columns; NaN if none)."""
    life = allgathers[allgathers["event"].isin(["issue", "consume", "drop"])]
    life = life.sort_values(["rank", "unit", "group", "seq"])
    after = life.groupby(["rank", "unit", "group"], sort=False).shift(-1)
    ends = after[["event", "step", "micro_step", "phase", "t_ns", "detail"]].add_prefix("end_")
    out = pd.concat([life, ends], axis=1)
    return out[out["event"] == "issue"]


def check(tables: RankTables) -> pd.DataFrame:
    """Wasted prefetches outside micro-steps the writer lost all-gather rows of."""
    if not tables.sizes["allgathers"]:
        return findings.empty()
    found = wasted(tables.frame("allgathers"), tables.frame("events"))
    return tables.drop_lost(found, "allgathers")


def wasted(allgathers: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """Every prefetched all-gather held past its pass or dropped, one finding per issue."""
    if not len(allgathers):
        return findings.empty()
    issues = paired(plain(allgathers))
    ended = issues[issues["end_event"].isin(["consume", "drop"])
                   & issues["issuer_kind"].isin(PREFETCH_KINDS)]
    same_pass = ((ended["end_step"] == ended["step"])
                 & (ended["end_micro_step"] == ended["micro_step"])
                 & (ended["end_phase"] == ended["phase"]))
    wasted = ended[(ended["end_event"] == "drop") | ~same_pass]
    if not len(wasted):
        return findings.empty()
    wasted = with_occurrence(wasted, events)
    return findings.make(NAME, SEVERITY, _located(wasted), _messages(wasted))


def _located(rows: pd.DataFrame) -> pd.DataFrame:
    return rows.assign(target=rows["unit"], unit=rows["issuer_unit"], bytes=rows["num_bytes"],
                       held_ms=(rows["end_t_ns"] - rows["t_ns"]) / 1e6,
                       call_index=rows["occurrence"])


def _messages(rows: pd.DataFrame) -> pd.Series:
    held_ms = ((rows["end_t_ns"] - rows["t_ns"]) / 1e6).map("{:.3f}".format)
    size = rows["num_bytes"].astype("int64").map("{:,}".format)
    end_step = rows["end_step"].astype("int64").astype(str)
    end_micro = rows["end_micro_step"].astype("int64").astype(str)
    later = ("consumed only in step " + end_step + " micro-step " + end_micro + " "
             + rows["end_phase"].astype(str))
    dropped = "dropped unused by FSDP2 (" + rows["end_detail"].astype(str) + ")"
    fate = later.where(rows["end_event"] == "consume", dropped)
    kind = rows["issuer_kind"].map({"prefetch": "prefetched",
                                    "implicit": "implicitly prefetched (FSDP2 default)"})
    return (call_label(rows) + " " + kind + " " + rows["unit"] + " (" + size + " bytes), "
            + fate + " after holding it " + held_ms + " ms: the gather overlapped nothing; "
            + "prefetch " + rows["unit"] + " only from the call that runs right before it")


def issuer_text(rows: pd.DataFrame) -> pd.Series:
    """Who issued an all-gather, in words ('manual unshard()', 'prefetch from layers.0')."""
    source = rows["issuer_unit"].fillna("?").astype(str)
    kind = rows["issuer_kind"].astype(str)
    return pd.Series(
        "its own pre-forward/pre-backward" if k == "own"
        else "manual unshard()" if k == "manual"
        else f"prefetch from {s}" if k == "prefetch"
        else f"FSDP2's implicit backward prefetch from {s}" if k == "implicit"
        else f"checkpoint recompute of {s}" if k == "recompute"
        else "an unknown caller"
        for k, s in zip(kind, source, strict=True)
    ).set_axis(rows.index)


CHECK = Check(8, NAME, SEVERITY, PER_RANK,
              "prefetched all-gather not used by its target in that pass", check)
