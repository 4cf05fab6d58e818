"""Micro-steps the writer lost rows from, so the checks do not read a gap as something the job did.

Aborted micro-steps (``reset_iter_state()``, an ``aborted`` marker) are cut off the same way,
in every table: what they recorded is not how the job runs.

A schema-1 writer that could not keep up dropped a table's oldest buffered rows and wrote one
``dropped_rows`` marker per contiguous run (schema 2 never drops). On that rank, every
(step, micro_step) from the run's first to its last is incomplete in that table: a unit missing
there may be a lost row. The checks that would misread such a gap skip those micro-steps
(orders, provenance) or optimizer steps (boundary snapshots) instead.

A rank whose recording stopped (``recording_disabled``: its run dir's disk filled, its writer
failed) recorded nothing more in any table: from that marker's micro-step to the last step its
markers reached, every table is incomplete. A chunk or journal segment the reader skipped as
unreadable is a ``dropped_rows`` marker of its own (``chunk_gaps``), and so are the rows a
writer could not get into the run dir (``record.unwritten``: their detail says ``unwritten``).
Each range says its ``cause`` (``CAUSES``), so what a person reads names what happened, not
only where.

One implementation for every source: the map step filters a rank's Arrow markers down to the
few loss and abort rows before converting them (``from_arrow``), a ``Trace`` hands its
markers frame over, and both end in ``parse``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from fsdptrace.errors import RunDirError
from fsdptrace.reading.keys import rank_step_key
from fsdptrace.store import schema
from fsdptrace.store.key_ranges import MAX_MICRO_STEP, MAX_STEP

COLUMNS = ["rank", "table", "first_step", "first_micro_step", "last_step", "last_micro_step",
           "num_rows", "cause"]
# Why a range is incomplete: rows a schema-1 writer dropped, a chunk or segment the reader
# could not read, rows the writer could not get into the run dir (its disk was full: they
# stayed in the recording host's hot folder), a micro-step ``reset_iter_state()`` aborted, a
# recording that stopped.
DROPPED, UNREADABLE, UNWRITTEN = "dropped", "unreadable", "unwritten"
ABORTED, STOPPED = "aborted", "stopped"
CAUSES = (DROPPED, UNREADABLE, UNWRITTEN, ABORTED, STOPPED)
# Marker kinds after which a rank recorded nothing more.
STOP_MARKERS = (schema.MARKER_DISABLED,)
_LOSS_MARKERS = (schema.MARKER_DROPPED_ROWS, schema.MARKER_ABORTED, *STOP_MARKERS)


_EMPTY: pd.DataFrame | None = None


def empty() -> pd.DataFrame:
    """No incomplete ranges (what a run without drops, or the live path, holds); built once
    and copied, as ``findings.empty``: every rank's summary starts with one."""
    global _EMPTY
    if _EMPTY is None:
        _EMPTY = pd.DataFrame({c: pd.Series([], dtype=object if c in ("table", "cause")
                                             else "int64") for c in COLUMNS})
    return _EMPTY.copy()


def parse(markers: pd.DataFrame, last_steps: pd.Series | None = None) -> pd.DataFrame:
    """Incomplete ranges (``COLUMNS``) from markers; only loss and abort markers are read.

    The same run may be marked twice (a marker the cap itself dropped is written again at
    close), so duplicates are removed. Details are parsed with ``json`` (never evaluated).
    ``last_steps``: per rank, the last step its markers reached (where a stopped recording's
    range ends), when ``markers`` holds only the loss rows; else taken from ``markers``.
    """
    if not len(markers) or "kind" not in markers:
        return empty()
    kind = markers["kind"].astype(object)
    if last_steps is None:
        last_steps = markers.groupby(markers["rank"].astype("int64"))["step"].max()
    found = [_aborted(markers[kind == schema.MARKER_ABORTED]),
             _stopped(markers[kind.isin(STOP_MARKERS)], last_steps),
             _dropped(markers[kind == schema.MARKER_DROPPED_ROWS])]
    found = [f for f in found if len(f)]
    if not found:
        return empty()
    return pd.concat(found, ignore_index=True) if len(found) > 1 else found[0]


def _dropped(mine: pd.DataFrame) -> pd.DataFrame:
    """``dropped_rows`` markers: a schema-1 writer's drops, chunks the reader skipped, rows a
    writer could not get into the run dir. Those last may run to the rank's end (``last_step``
    null: where its copy in the run dir ended while it ran on): to ``MAX_STEP``."""
    if not len(mine):
        return empty()
    ranks = mine["rank"].to_numpy().astype(np.int64)
    details = [_detail(d, r) for d, r in zip(mine["detail"].astype(str), ranks, strict=True)]
    fields = COLUMNS[1:-2]
    out = pd.DataFrame([[d.get(f) for f in fields] for d in details], columns=fields)
    out.insert(0, "rank", ranks)
    out["num_rows"] = mine["count"].to_numpy().astype(np.int64)
    out["cause"] = [UNREADABLE if "unreadable_chunk" in d else UNWRITTEN if UNWRITTEN in d
                    else DROPPED for d in details]
    open_ended = (out["cause"] == UNWRITTEN).to_numpy() & out["last_step"].isna().to_numpy()
    # To the rank's end: its tables were copied at different moments, so no table's last row
    # (the markers' included) says where the others' copies end.
    out.loc[open_ended, "last_step"] = MAX_STEP
    out.loc[open_ended, "last_micro_step"] = MAX_MICRO_STEP
    # A run without a step range (not a number) says nothing about where it was: skip it.
    out[fields[1:]] = out[fields[1:]].apply(pd.to_numeric, errors="coerce")
    out = out.dropna(subset=fields[1:])
    out = out.astype({c: "int64" for c in fields[1:]})
    return out.drop_duplicates().reset_index(drop=True)[COLUMNS]


def _stopped(markers: pd.DataFrame, last_steps: pd.Series) -> pd.DataFrame:
    """A stopped recording: every table, from its marker to the last step the rank reached."""
    if not len(markers):
        return empty()
    first = markers.sort_values(["step", "micro_step"]).drop_duplicates("rank")
    ranks = first["rank"].to_numpy().astype(np.int64)
    steps = first["step"].to_numpy().astype(np.int64)
    last = last_steps.reindex(ranks).fillna(0).to_numpy().astype(np.int64)
    one = pd.DataFrame({"rank": ranks, "first_step": steps,
                        "first_micro_step": first["micro_step"].to_numpy().astype(np.int64),
                        "last_step": np.maximum(last, steps),
                        "last_micro_step": MAX_MICRO_STEP, "num_rows": 0, "cause": STOPPED})
    out = pd.concat([one.assign(table=table) for table in schema.TABLES], ignore_index=True)
    return out[COLUMNS]


def _aborted(markers: pd.DataFrame) -> pd.DataFrame:
    """``reset_iter_state()`` abandoned these micro-steps: cut off in every table."""
    if not len(markers):
        return empty()
    one = pd.DataFrame({"rank": markers["rank"].to_numpy().astype(np.int64),
                        "first_step": markers["step"].to_numpy().astype(np.int64),
                        "first_micro_step": markers["micro_step"].to_numpy().astype(np.int64)})
    one = one.assign(last_step=one["first_step"], last_micro_step=one["first_micro_step"],
                     num_rows=0, cause=ABORTED)
    out = pd.concat([one.assign(table=table) for table in schema.TABLES], ignore_index=True)
    return out[COLUMNS]


def _detail(text: str, rank: int) -> dict[str, Any]:
    """One marker's detail; a run dir comes from someone else's job, so say what is wrong."""
    try:
        detail = json.loads(text)
    except ValueError:
        detail = None
    if not isinstance(detail, dict):
        raise RunDirError(
            f"rank {rank}: a {schema.MARKER_DROPPED_ROWS} marker's detail is not a JSON object "
            f"({text[:80]!r}); the markers table is corrupt or was not written by fsdptrace")
    return detail


def from_arrow(markers: pa.Table) -> pd.DataFrame:
    """``parse`` on Arrow markers: only the few loss markers become pandas, not the table."""
    if not markers.num_rows:
        return empty()
    kind = pc.cast(markers.column("kind"), pa.string())
    losses = markers.filter(pc.is_in(kind, pa.array(_LOSS_MARKERS)))
    if not losses.num_rows:
        return empty()
    last = markers.group_by("rank").aggregate([("step", "max")]).to_pandas()
    last_steps = pd.Series(last["step_max"].to_numpy(), index=last["rank"].astype("int64"))
    return parse(losses.to_pandas(), last_steps)


def in_micro_steps(ranges: pd.DataFrame, tables: tuple[str, ...], rank: np.ndarray,
                   step: np.ndarray, micro_step: np.ndarray) -> np.ndarray:
    """Mask of rows whose (rank, step, micro_step) lies in an incomplete range of ``tables``."""
    chosen = ranges[ranges["table"].isin(tables)] if len(ranges) else ranges
    if not len(chosen) or not len(rank):
        return np.zeros(len(rank), dtype=bool)
    low = _keys(chosen["rank"], chosen["first_step"], chosen["first_micro_step"])
    high = _keys(chosen["rank"], chosen["last_step"], chosen["last_micro_step"])
    return _inside(_keys(rank, step, micro_step), low, high)


def in_steps(ranges: pd.DataFrame, tables: tuple[str, ...], rank: np.ndarray,
             step: np.ndarray) -> np.ndarray:
    """Mask of rows whose (rank, step) has an incomplete micro-step in ``tables``: for the
    checks that judge a whole optimizer step (its forwards, its boundary snapshot)."""
    whole = ranges.assign(first_micro_step=0, last_micro_step=MAX_MICRO_STEP)
    return in_micro_steps(whole, tables, rank, step, np.zeros(len(step), dtype=np.int64))


def _keys(rank: np.ndarray | pd.Series, step: np.ndarray | pd.Series,
          micro_step: np.ndarray | pd.Series) -> np.ndarray:
    def ints(values: np.ndarray | pd.Series) -> np.ndarray:
        return np.asarray(values).astype(np.int64)

    return rank_step_key(ints(rank), ints(step), ints(micro_step))


def _inside(key: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Is each key within some [low, high]: intervals merged, then one binary search."""
    order = np.argsort(low, kind="stable")
    low, high = low[order], np.maximum.accumulate(high[order])
    # After the running max, the last interval starting at or before a key reaches furthest.
    found = np.searchsorted(low, key, side="right") - 1
    return (found >= 0) & (key <= high[np.maximum(found, 0)])


def outside(frame: pd.DataFrame, cut: pd.DataFrame, table: str, ranges: pd.DataFrame
            ) -> pd.DataFrame:
    """Rows of ``frame`` (rank, step, micro_step) outside the ``cut`` micro-steps (rank, step,
    micro_step) and outside the micro-steps whose ``table`` rows the writer lost or
    ``reset_iter_state()`` aborted."""
    if not len(frame):
        return frame
    rank, step = frame["rank"].to_numpy(), frame["step"].to_numpy()
    micro = frame["micro_step"].to_numpy()
    keep = ~in_micro_steps(ranges, (table,), rank, step, micro)
    if len(cut):
        mine = _keys(rank, step, micro)
        keep &= ~np.isin(mine, _keys(cut["rank"], cut["step"], cut["micro_step"]))
    return frame[keep]
