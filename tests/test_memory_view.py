"""The report's memory lines (``render.memory_view``): a deep rank's line is drawn from a few
rows per pixel column, which draw the same picture as every row would."""

from __future__ import annotations

import re

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptrace.render import memory_view
from fsdptrace.render.memory_view import MAX_ROWS_PER_PIXEL, WIDTH, drawn_rows


def pixels(times: list[int], held: list[int], rows: list[int]) -> dict[int, tuple]:
    """Per pixel column the line passes through, from ``rows``: the least and most held there,
    and the levels the line enters and leaves it at."""
    start, end = times[0], max(times[-1], times[0] + 1)
    seen: dict[int, tuple] = {}
    entering = None  # the level before the first row: nothing held
    for row in rows:
        column = int((times[row] - start) / (end - start) * WIDTH)
        low, high, enters, _ = seen.get(column, (held[row], held[row], entering, None))
        seen[column] = (min(low, held[row]), max(high, held[row]), enters, held[row])
        entering = held[row]
    return seen


def polyline(svg: str) -> list[str]:
    (text,) = re.findall(r'points="([^"]*)"', svg)
    return text.split()


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32), st.integers(WIDTH * MAX_ROWS_PER_PIXEL + 1, 20_000),
       st.sampled_from([1, 2, 50, 10**6]))
def test_a_long_line_keeps_every_columns_range_and_levels(seed: int, num_rows: int,
                                                          gap: int) -> None:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.integers(0, gap, num_rows)).tolist()
    held = rng.integers(0, 1 << 30, num_rows).tolist()
    kept = drawn_rows(np.array(times), np.array(held), times[0], max(times[-1], times[0] + 1))
    assert len(kept) <= 4 * (WIDTH + 1) and kept == sorted(set(kept))
    assert pixels(times, held, kept) == pixels(times, held, list(range(num_rows)))
    drawn = polyline(memory_view._svg(times, held, max(held) or 1))
    assert len(drawn) == 2 * len(kept)


def test_a_short_line_is_drawn_row_by_row() -> None:
    times, held = list(range(0, 100, 10)), [0, 5, 3, 9, 0, 1, 2, 3, 4, 0]
    assert len(polyline(memory_view._svg(times, held, 9))) == 2 * len(times)
