"""The report's stacks section: what each rank was doing when a watcher saw the run hang.

At a thousand ranks, most hung ranks wait in the same place: ranks whose training thread had
the same frames share one collapsed block, named by their rank ranges, so the rank that is
elsewhere (the culprit, usually) stands out as its own block. Each block shows one rank's
whole dump (every thread) as faulthandler wrote it, bounded in lines.
"""

from __future__ import annotations

from typing import Any

from fsdptrace.store.stack_dumps import StackCapture
from fsdptrace.views.rank_ranges import rank_ranges

MAX_STACK_LINES = 400
MAX_BLOCKS = 32


def stack_blocks(stacks: dict[int, list[StackCapture]]) -> list[dict[str, Any]]:
    """One block per distinct training-thread stack in each rank's latest capture, fewest
    ranks first (the odd one out), each with a shown rank's dump as lines."""
    groups: dict[tuple[str, ...], list[StackCapture]] = {}
    for captures in stacks.values():
        if captures:
            latest = captures[-1]
            groups.setdefault(latest.main_frames, []).append(latest)
    ordered = sorted(groups.values(), key=lambda g: (len(g), min(c.rank for c in g)))
    blocks = []
    for group in ordered[:MAX_BLOCKS]:
        shown = min(group, key=lambda c: c.rank)
        lines = shown.text.splitlines()
        blocks.append({
            "ranks": rank_ranges([c.rank for c in group]),
            "num_ranks": len(group),
            "shown_rank": shown.rank,
            "captured_at": shown.captured_at,
            "complete": shown.complete,
            "flight_recorder": shown.flight_recorder or "",
            "innermost": shown.main_frames[0] if shown.main_frames else "no training-thread frame",
            "lines": lines[:MAX_STACK_LINES],
            "hidden_lines": max(0, len(lines) - MAX_STACK_LINES),
        })
    return blocks
