"""Micro-steps the writer lost rows from, so the checks do not read a gap as something the job did.

Aborted micro-steps (``reset_iter_state()``, an ``aborted`` marker) are cut off the same way,
in every table: what they recorded is not how the job runs.

A schema-1 writer that could not keep up dropped a table's oldest buffered rows and wrote one
``dropped_rows`` marker per contiguous run (schema 2 never drops). On that rank, every
(step, micro_step) from the run's first to its last is incomplete in that table: a unit missing
there may be a lost row. The checks that would misread such a gap skip those micro-steps
(orders, provenance) or optimizer steps (boundary snapshots) instead.

One implementation for every source: the map step filters a rank's Arrow markers down to the
few ``dropped_rows`` rows before converting them (``from_arrow``), a ``Trace`` hands its
markers frame over, and both end in ``parse``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from fsdptrace import schema
from fsdptrace.errors import RunDirError

if TYPE_CHECKING:
    from fsdptrace.checks.tables import RankTables

COLUMNS = ["rank", "table", "first_step", "first_micro_step", "last_step", "last_micro_step",
           "num_rows"]
_STEP_SCALE = 1 << 20  # micro-steps per optimizer step, as ``step * scale + micro_step``
_RANK_SCALE = 1 << 44  # leaves 2**24 optimizer steps per rank below the rank's part of a key


def empty() -> pd.DataFrame:
    """No incomplete ranges (what a run without drops, or the live path, holds)."""
    return pd.DataFrame({c: pd.Series([], dtype=object if c == "table" else "int64")
                         for c in COLUMNS})


def parse(markers: pd.DataFrame) -> pd.DataFrame:
    """Incomplete ranges (``COLUMNS``) from markers; only ``dropped_rows`` rows are read.

    The same run may be marked twice (a marker the cap itself dropped is written again at
    close), so duplicates are removed. Details are parsed with ``json`` (never evaluated).
    """
    if not len(markers) or "kind" not in markers:
        return empty()
    kind = markers["kind"].astype(object)
    aborted = _aborted(markers[kind == schema.MARKER_ABORTED])
    mine = markers[kind == schema.MARKER_DROPPED_ROWS]
    if not len(mine):
        return aborted
    ranks = mine["rank"].to_numpy().astype(np.int64)
    details = [_detail(d, r) for d, r in zip(mine["detail"].astype(str), ranks, strict=True)]
    fields = COLUMNS[1:-1]
    out = pd.DataFrame([[d.get(f) for f in fields] for d in details], columns=fields)
    out.insert(0, "rank", ranks)
    out["num_rows"] = mine["count"].to_numpy().astype(np.int64)
    # A run without a step range (not a number) says nothing about where it was: skip it.
    out[fields[1:]] = out[fields[1:]].apply(pd.to_numeric, errors="coerce")
    out = out.dropna(subset=fields[1:])
    out = out.astype({c: "int64" for c in fields[1:]})
    out = out.drop_duplicates().reset_index(drop=True)[COLUMNS]
    return pd.concat([out, aborted], ignore_index=True) if len(aborted) else out


def _aborted(markers: pd.DataFrame) -> pd.DataFrame:
    """``reset_iter_state()`` abandoned these micro-steps: cut off in every table."""
    if not len(markers):
        return empty()
    one = pd.DataFrame({"rank": markers["rank"].to_numpy().astype(np.int64),
                        "first_step": markers["step"].to_numpy().astype(np.int64),
                        "first_micro_step": markers["micro_step"].to_numpy().astype(np.int64)})
    one = one.assign(last_step=one["first_step"], last_micro_step=one["first_micro_step"],
                     num_rows=0)
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
    """``parse`` on Arrow markers: only the few drop markers become pandas, not the table."""
    if not markers.num_rows:
        return empty()
    kind = pc.cast(markers.column("kind"), pa.string())
    drops = markers.filter(pc.is_in(kind, pa.array([schema.MARKER_DROPPED_ROWS,
                                                    schema.MARKER_ABORTED])))
    return parse(drops.to_pandas()) if drops.num_rows else empty()


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
    whole = ranges.assign(first_micro_step=0, last_micro_step=_STEP_SCALE - 1)
    return in_micro_steps(whole, tables, rank, step, np.zeros(len(step), dtype=np.int64))


def _keys(rank: np.ndarray | pd.Series, step: np.ndarray | pd.Series,
          micro_step: np.ndarray | pd.Series) -> np.ndarray:
    def ints(values: np.ndarray | pd.Series) -> np.ndarray:
        return np.asarray(values).astype(np.int64)

    return ints(rank) * _RANK_SCALE + ints(step) * _STEP_SCALE + ints(micro_step)


def _inside(key: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Is each key within some [low, high]: intervals merged, then one binary search."""
    order = np.argsort(low, kind="stable")
    low, high = low[order], np.maximum.accumulate(high[order])
    # After the running max, the last interval starting at or before a key reaches furthest.
    found = np.searchsorted(low, key, side="right") - 1
    return (found >= 0) & (key <= high[np.maximum(found, 0)])


def cut_off_micro_steps(tables: RankTables) -> pd.DataFrame:
    """Per rank whose ending is not clean: the micro-step its recording stopped in (``rank,
    step, micro_step``) and the ``phase`` of its last event, i.e. the cut-off pass."""
    from fsdptrace.checks.positions import last_positions

    last = last_positions(tables.events)
    stopped = last[~last["rank"].isin(list(tables.closed))]
    return stopped[["rank", "step", "micro_step", "phase"]].astype(
        {"rank": "int64", "step": "int64", "micro_step": "int64"}).reset_index(drop=True)


def outside(frame: pd.DataFrame, cut: pd.DataFrame, table: str, ranges: pd.DataFrame
            ) -> pd.DataFrame:
    """Rows of ``frame`` (rank, step, micro_step) outside the ``cut`` micro-steps and outside
    the micro-steps whose ``table`` rows the writer lost or ``reset_iter_state()`` aborted."""
    if not len(frame):
        return frame
    rank, step = frame["rank"].to_numpy(), frame["step"].to_numpy()
    micro = frame["micro_step"].to_numpy()
    keep = ~in_micro_steps(ranges, (table,), rank, step, micro)
    if len(cut):
        mine = _keys(rank, step, micro)
        keep &= ~np.isin(mine, _keys(cut["rank"], cut["step"], cut["micro_step"]))
    return frame[keep]
