"""Check 1, prefetch-order: a configured target that did not run, or ran before its source."""

from __future__ import annotations

import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.order import GROUP, drop_cut_off, first_positions, with_positions

NAME = "prefetch-order"
SEVERITY = findings.ERROR
_KEY_SCALE = 1_000_000


def edges_in_effect(groups: pd.DataFrame, prefetch: pd.DataFrame) -> pd.DataFrame:
    """Join each (rank, step, micro_step) group to the prefetch snapshot configured then."""
    edges = prefetch.dropna(subset=["target"])
    if not len(groups) or not len(edges):
        return pd.DataFrame(columns=["rank", "step", "micro_step", "unit", "phase", "target"])
    snapshots = prefetch[["rank", "step", "micro_step"]].drop_duplicates()
    snapshots = snapshots.assign(
        key=snapshots["step"].astype("int64") * _KEY_SCALE + snapshots["micro_step"],
        rank=snapshots["rank"].astype("int64"),
    ).rename(columns={"step": "snap_step", "micro_step": "snap_micro"})
    wanted = groups[["rank", "step", "micro_step"]].drop_duplicates()
    wanted = wanted.assign(
        key=wanted["step"].astype("int64") * _KEY_SCALE + wanted["micro_step"],
        rank=wanted["rank"].astype("int64"),
    )
    matched = pd.merge_asof(wanted.sort_values("key"), snapshots.sort_values("key"), on="key",
                            by="rank", direction="backward").dropna(subset=["snap_step"])
    edges = edges.assign(rank=edges["rank"].astype("int64")).rename(
        columns={"step": "snap_step", "micro_step": "snap_micro"})
    matched = matched.astype({"snap_step": "int64", "snap_micro": "int64"})
    edges = edges.astype({"snap_step": "int64", "snap_micro": "int64"})
    joined = matched.merge(edges, on=["rank", "snap_step", "snap_micro"])
    return joined[["rank", "step", "micro_step", "unit", "phase", "target"]]


def check(events: pd.DataFrame, prefetch: pd.DataFrame, markers: pd.DataFrame) -> pd.DataFrame:
    """Every executed source's configured targets, against the order units began."""
    positioned = first_positions(with_positions(drop_cut_off(events, markers)))
    if not len(positioned) or not len(prefetch):
        return findings.empty()
    plain = positioned.assign(
        rank=positioned["rank"].astype("int64"),
        unit=positioned["unit"].astype(str),
        phase=positioned["phase"].astype(str),
    )[GROUP + ["unit", "position"]]
    edges = edges_in_effect(plain, prefetch).astype({"unit": str, "phase": str, "target": str})
    sources = plain.merge(edges, on=GROUP + ["unit"])
    targets = plain.rename(columns={"unit": "target", "position": "target_position"})
    checked = sources.merge(targets, on=GROUP + ["target"], how="left")
    missing = checked[checked["target_position"].isna()]
    early = checked[checked["target_position"].notna()
                    & (checked["target_position"] <= checked["position"])]
    return findings.combine([_missing(missing), _early(early)])


def _missing(rows: pd.DataFrame) -> pd.DataFrame:
    if not len(rows):
        return findings.empty()
    message = (rows["unit"] + " prefetched " + rows["target"] + ", but " + rows["target"]
               + " did not execute in " + rows["phase"] + ": the all-gather is wasted and held; "
               + "remove " + rows["target"] + " from " + rows["unit"] + "'s " + rows["phase"]
               + " prefetch targets")
    return findings.make(NAME, SEVERITY, rows, message)


def _early(rows: pd.DataFrame) -> pd.DataFrame:
    if not len(rows):
        return findings.empty()
    position = rows["position"].astype("int64").astype(str)
    target_position = rows["target_position"].astype("int64").astype(str)
    message = (rows["unit"] + " prefetched " + rows["target"] + " at positions " + position
               + "->" + target_position + " in " + rows["phase"] + ": the target had already run, "
               + "so the prefetch is useless or gathers for the next pass; prefetch the unit "
               + "that runs after " + rows["unit"] + " instead (see fsdptrace suggest)")
    return findings.make(NAME, SEVERITY, rows, message)
