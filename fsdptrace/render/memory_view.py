"""The report's memory view: unsharded parameter bytes over time, per rank, as inline SVG.

Drawn here (no script): a step line per rank from the unsharded-memory ledger
(``fsdptrace.reading.unsharded``), the ranks with the highest peaks first, each with its peak
and the floor its worst pass needed. Parameter memory as FSDP holds it, not the allocator's view.
"""

from __future__ import annotations

from html import escape
from typing import Any

import numpy as np
import pandas as pd

from fsdptrace.reading import unsharded
from fsdptrace.reading.sizes import human_bytes
from fsdptrace.reading.unit_names import labeller

MAX_RANKS = 8
WIDTH, HEIGHT = 640, 60
# A rank's line of more rows than this per pixel column is drawn from the few each column
# needs (``drawn_rows``); a shorter one row by row.
MAX_ROWS_PER_PIXEL = 4


def memory_view(allgathers: pd.DataFrame, *, max_ranks: int = MAX_RANKS,
                types: dict[str, str] | None = None) -> dict[str, Any]:
    """``{"rows": [...], "hidden": n}``; each row: rank, peak and floor text, an SVG string.
    ``types``: module types of positional unit names, shown beside them."""
    label = labeller(types or {})
    # The peaks first, then the ledger: the replay's arrays are freed before the ledger is made
    # (on a 64-rank deep run both at once were 2.8 GB beside the tables). A run has passes
    # exactly when its ledger has rows.
    worst = unsharded.worst_passes(unsharded.peaks(allgathers))
    if not len(worst):
        return {"rows": [], "hidden": 0}
    ledger = unsharded.held_over_time(allgathers)
    worst = worst.sort_values(["peak_bytes", "rank"], ascending=[False, True], kind="stable")
    top = int(worst["peak_bytes"].max()) or 1
    rows = []
    for row in worst.head(max_ranks).itertuples(index=False):
        mine = ledger[ledger["rank"] == row.rank]
        rows.append({
            "rank": int(row.rank),
            "peak": human_bytes(row.peak_bytes),
            "floor": human_bytes(row.floor_bytes),
            "where": f"step {int(row.step)}, micro-step {int(row.micro_step)}, {row.phase}",
            "units": ", ".join(label(u) for u in str(row.peak_units).split(",")),
            "svg": _svg(mine["t_ns"].astype("int64").tolist(),
                        mine["held_bytes"].astype("int64").tolist(), top),
        })
    return {"rows": rows, "hidden": max(0, len(worst) - max_ranks)}


def _svg(times: list[int], held: list[int], top: int) -> str:
    """A step line of ``held`` over ``times``, scaled to ``top`` bytes."""
    start, end = times[0], max(times[-1], times[0] + 1)
    if len(times) > MAX_ROWS_PER_PIXEL * WIDTH:
        kept = drawn_rows(np.array(times, dtype=np.int64), np.array(held, dtype=np.int64),
                          start, end)
        times, held = [times[i] for i in kept], [held[i] for i in kept]
    points = []
    level = float(HEIGHT)  # nothing held before the first row
    for t, value in zip(times, held, strict=True):
        x = (t - start) / (end - start) * WIDTH
        points.append(f"{x:.1f},{level:.1f}")
        level = HEIGHT - value / top * HEIGHT
        points.append(f"{x:.1f},{level:.1f}")
    return (f'<svg class="memory" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
            f'height="{HEIGHT}" role="img"><polyline fill="none" stroke="currentColor" '
            f'points="{escape(" ".join(points))}"/></svg>')


def drawn_rows(times: np.ndarray, held: np.ndarray, start: int, end: int) -> list[int]:
    """The rows a step line ``WIDTH`` pixels wide needs, in order: of each pixel column, its
    last row and those holding least and most.

    A deep rank changes what it holds hundreds of thousands of times: drawn row by row, the
    8 lines of a 64-rank report were 51 MB of its 54. Within one pixel column the line only
    shows the range between the least and the most held, and it leaves the column at its last
    row's level (where the next column's line starts), so those rows draw the same picture at
    that width, every peak kept.
    """
    column = np.floor((times - start) / max(end - start, 1) * WIDTH).astype(np.int64)
    by_level = np.lexsort((held, column))  # per column, least held first and most held last
    edges = np.flatnonzero(np.diff(column[by_level])) + 1
    first_of = np.r_[0, edges]
    last_of = np.r_[edges - 1, len(by_level) - 1]
    leaves = np.r_[np.flatnonzero(np.diff(column)), len(times) - 1]  # a column's last row
    return np.unique(np.concatenate([by_level[first_of], by_level[last_of], leaves])).tolist()
