"""Each rank's recorded clock moved onto the wall clock, so ranks and other traces line up.

The recorder stamps rows with ``CLOCK_MONOTONIC`` (``t_ns``), whose origin is the host's boot:
ranks on different hosts share no origin, and nothing else (a torch.profiler trace, logs)
uses it. At start each rank wrote one pair of readings taken together, ``wall_anchor_ns``
(``time.time_ns()``) and ``mono_anchor_ns``; adding their difference to ``t_ns`` gives
nanoseconds since the Unix epoch. Across hosts that is as good as their clock sync (NTP: about
a millisecond); on one host the monotonic differences between ranks are exact either way.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

_ANCHOR_COLUMNS = {"rank", "wall_anchor_ns", "mono_anchor_ns"}


def shifts(meta: pd.DataFrame) -> dict[int, int]:
    """Per rank with meta, what to add to ``t_ns`` for nanoseconds since the epoch."""
    return {int(rank): pair["wall_anchor_ns"] - pair["mono_anchor_ns"]
            for rank, pair in anchors(meta).items()}


def anchors(meta: pd.DataFrame) -> dict[str, dict[str, int]]:
    """The anchor pair of each rank, as written (for a trace's ``otherData``)."""
    if not len(meta) or not _ANCHOR_COLUMNS <= set(meta.columns):
        return {}
    rows = meta.drop_duplicates("rank")
    return {str(int(r)): {"wall_anchor_ns": int(w), "mono_anchor_ns": int(m)}
            for r, w, m in zip(rows["rank"], rows["wall_anchor_ns"], rows["mono_anchor_ns"],
                               strict=True) if pd.notna(w) and pd.notna(m)}


def wall_ns(t_ns: pd.Series, ranks: pd.Series, by_rank: dict[int, int]) -> pd.Series:
    """``t_ns`` of rows of the given ranks as epoch nanoseconds (unanchored ranks: as is).

    In integers throughout: a shift is ~1.8e18 ns, beyond a double's 2**53, so a detour
    through floats (a missing rank's NaN) moved every row by up to 256 ns."""
    rank = ranks.to_numpy(dtype=np.int64)
    seen, row_of = np.unique(rank, return_inverse=True)
    shift = np.array([by_rank.get(int(r), 0) for r in seen], dtype=np.int64)[row_of]
    return pd.Series(t_ns.to_numpy(dtype=np.int64) + shift, index=t_ns.index)


def epoch_us(t_ns: pd.Series, ranks: pd.Series, by_rank: dict[int, int]) -> pd.Series:
    """Microseconds since the epoch, the unit of Chrome trace ``ts`` (float: the integer part
    needs 51 bits, so a double keeps it to a quarter microsecond)."""
    return wall_ns(t_ns, ranks, by_rank) / 1000.0
