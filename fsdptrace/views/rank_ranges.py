"""Ranks, steps or micro-steps as a person reads a list of them: ``0-2,5,7-8``.

One spelling for every output that names many ranks: the summary, the folded findings, the
report's side-by-side orders and the stacks a watcher groups.
"""

from __future__ import annotations


def rank_ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    values = sorted(set(values))
    parts: list[str] = []
    start = prev = None
    for v in values:
        if start is not None and prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = v
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)
