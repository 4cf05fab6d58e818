"""What one rank's lane of the report's timeline holds for one optimizer step.

Ranks do not start a step together: one that waited for another's data loader begins its
forward hundreds of milliseconds later. Drawn on one shared clock, the late rank's lane is half
empty and the orders are hard to compare; drawn each from its own start, the lateness is hidden.
So each lane starts at its rank's own step start and carries its *skew*: how much later than
the earliest rank it started, on the wall clock (``wall_clock``), which the page prints beside
the lane.

Times are integer microseconds since the lane's start; a unit's end is ``-1`` where none was
recorded (``unit_spans``), and the bytes-held line starts with what the rank held when the step
began.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from fsdptrace.store import schema

MAX_MEMORY_POINTS = 4000


def step_starts(spans: pd.DataFrame, markers: pd.DataFrame, step: int) -> dict[int, int]:
    """Per rank, the monotonic ``t_ns`` its step began: its first micro-step begin marker or
    unit begin in the step, whichever came first."""
    begins = spans.loc[spans["step"] == step, ["rank", "t_ns"]]
    if len(markers):
        opened = markers[(markers["step"] == step)
                         & (markers["kind"].astype(str) == schema.MARKER_MICRO_STEP)]
        begins = pd.concat([begins, opened[["rank", "t_ns"]]], ignore_index=True)
    first = begins.groupby(begins["rank"].astype("int64"))["t_ns"].min()
    return {int(r): int(t) for r, t in first.items()}


def skews(starts: dict[int, int], shift: dict[int, int]) -> dict[int, int]:
    """Microseconds each rank started the step after the earliest one, on the wall clock."""
    if not starts:
        return {}
    wall = {r: t + shift.get(r, 0) for r, t in starts.items()}
    earliest = min(wall.values())
    return {r: (t - earliest) // 1000 for r, t in wall.items()}


def timings(rows: pd.DataFrame, start: int) -> dict[str, list[int]]:
    """Begins (``t``) and recorded ends (``e``, ``-1`` for none) in microseconds from ``start``."""
    ends = rows["end_ns"]
    return {
        "t": [int(v) for v in (rows["t_ns"].to_numpy(dtype="int64") - start) // 1000],
        "e": [-1 if pd.isna(v) else (int(v) - start) // 1000 for v in ends],
    }


def memory(ledger: pd.DataFrame, rank: int, step: int, start: int) -> list[list[int]]:
    """``[[t, bytes held], ...]`` over the step, from the bytes held when it began.

    ``ledger``: ``unsharded.held_over_time``, in (rank, seq) order, so a rank's rows are found by
    bisection (a filter of the whole ledger per lane and step was 7 % of a deep run's report).
    """
    if not len(ledger):
        return []
    first, end = np.searchsorted(ledger["rank"].to_numpy(), [rank, rank + 1])
    mine = ledger.iloc[first:end]
    before = mine[mine["step"] < step]
    points = [[0, int(before["held_bytes"].iloc[-1]) if len(before) else 0]]
    inside = mine[mine["step"] == step].head(MAX_MEMORY_POINTS)
    times = (inside["t_ns"].to_numpy(dtype="int64") - start) // 1000
    points += [[max(0, int(t)), int(b)] for t, b in zip(times, inside["held_bytes"], strict=True)]
    return points


def lane(rank: int, rows: pd.DataFrame, *, start: int, skew: int, ledger: pd.DataFrame,
         step: int) -> dict[str, Any]:
    """One rank's lane: its timings, skew and bytes held."""
    return {"rank": rank, **timings(rows, start), "skew": skew,
            "mem": memory(ledger, rank, step, start)}

