"""Findings as instants in the Chrome trace, each at the first event it names."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

# Narrowing keys, most precise first: a finding lands on the first event that matches.
_FINDING_KEYS = (
    ["rank", "step", "micro_step", "phase", "unit"],
    ["rank", "step", "micro_step", "phase"],
    ["rank", "step", "micro_step"],
    ["rank", "step"],
)


def finding_instants(findings: pd.DataFrame, events: pd.DataFrame, tracks: dict[str, int],
                     *, end: float | None = None) -> list[dict[str, Any]]:
    """Each finding at the first event it names; else at its rank's last event; else (no
    rank, or a rank without events) at ``end``, by default the last of ``events``.

    ``events`` carries ``ts`` (the trace's clock); ``tracks`` maps a phase to its ``tid``.
    """
    if not len(findings):
        return []
    if end is None:
        end = float(events["ts"].max()) if len(events) else 0.0
    placed = _place_findings(findings.reset_index(drop=True), events, end)
    records = []
    for row in placed.itertuples(index=False):
        has_rank = pd.notna(row.rank)
        where = f"{row.unit}" + (f" -> {row.target}" if pd.notna(row.target) else "")
        records.append({
            "ph": "i", "s": "t" if has_rank else "g", "cat": f"finding,{row.severity}",
            "name": f"{row.check}: {where}" if pd.notna(row.unit) else str(row.check),
            "pid": int(row.rank) if has_rank else 0,
            "tid": tracks.get(str(row.phase), 0), "ts": float(row.ts),
            "args": {"severity": str(row.severity), "message": str(row.message)},
        })
    return records


def _place_findings(findings: pd.DataFrame, events: pd.DataFrame, end: float) -> pd.DataFrame:
    """Add ``ts`` to each finding by the narrowest key set that matches an event."""
    ts = pd.Series(np.nan, index=findings.index)
    keyed = events
    for keys in _FINDING_KEYS:
        todo = findings[ts.isna() & findings[keys].notna().all(axis=1)]
        if not len(todo) or not len(keyed):
            continue
        first = keyed.groupby(keys, observed=True)["ts"].min().rename("hit").reset_index()
        probe = _as_keys(todo[keys]).reset_index()
        hits = probe.merge(_as_keys(first[keys]).assign(hit=first["hit"]), on=keys, how="left")
        ts.loc[hits["index"]] = hits["hit"].to_numpy()
    last = events.groupby("rank")["ts"].max() if len(events) else pd.Series(dtype=float)
    fallback = findings["rank"].map(lambda r: last.get(int(r), end) if pd.notna(r) else end)
    return findings.assign(ts=ts.fillna(fallback.astype(float)))


def _as_keys(frame: pd.DataFrame) -> pd.DataFrame:
    """Location columns in one comparable form (findings use Int64/str, events int32/category)."""
    out = frame.copy()
    for column in out.columns:
        if column in ("rank", "step", "micro_step"):
            out[column] = out[column].astype("int64")
        elif column in ("phase", "unit"):
            out[column] = out[column].astype(object).astype("string")
    return out
