"""Where each rank's events end: the last unit it entered, at which position and call.

The pass part of a stop point (``checks.stops``); ``fsdptrace.last_step`` reads the same answer
from a rank's last row groups without loading the rank.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from fsdptrace.checks.kernel.columns import Columns, distinct_ranks
from fsdptrace.checks.kernel.order import GROUP


def last_positions(events: Columns) -> pd.DataFrame:
    """Per rank, the last unit entered, its position in that pass and which call of the unit
    it was (1-based), with its ``seq``."""
    columns = GROUP + ["unit", "position", "call", "t_ns", "seq"]
    if not len(events):
        return pd.DataFrame(columns=columns)
    rank, seq = events["rank"], events["seq"]
    last, counts, calls = [], [], []
    for r in distinct_ranks(rank):  # one rank per map step, a few in a Trace
        mine = np.flatnonzero(rank == r)
        row = int(mine[np.argmax(seq[mine])])
        same = np.ones(len(mine), dtype=bool)
        for column in GROUP[1:]:
            same &= events[column][mine] == events[column][row]
        same &= seq[mine] <= seq[row]
        last.append(row)
        counts.append(int(same.sum()))
        calls.append(int((same & (events["unit"][mine] == events["unit"][row])).sum()))
    out = events.frame(np.array(last, dtype=np.int64))[GROUP + ["unit", "t_ns", "seq"]]
    out["rank"] = out["rank"].astype("int64")
    out["phase"] = out["phase"].astype(str)
    out["unit"] = out["unit"].astype(str)
    out["position"] = np.array(counts, dtype=np.int64) - 1
    out["call"] = np.array(calls, dtype=np.int64)
    return out[columns].reset_index(drop=True)
