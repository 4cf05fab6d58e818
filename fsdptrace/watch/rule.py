"""The hang rule and the straggler rule of docs/checks.md v3 ("Watching a live run"), as pure
functions of what the probe saw: no clock read, no file opened, so tests give them numbers.

Hung: no rank recorded anything for the hang time while a rank has not ended. The hang time
holds while some rank is inside a pass or an eval forward (``checks.stops``' kinds); when every
rank that has not ended stopped at an optimizer boundary (a checkpoint save, data loading,
an evaluation outside FSDP), the longer idle time holds instead, so a checkpoint is no hang.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fsdptrace.record.writer import DEFAULT_FLUSH_INTERVAL_S
from fsdptrace.watch.probe import RankState

# The default hang time: this many times the slowest micro-step seen, and never less than
# ``MIN_HANG_S`` (a job's first micro-steps compile, warm caches, gather for the first time).
HANG_FACTOR = 5.0
MIN_HANG_S = 10.0
# Every rank between steps: a checkpoint of a large model takes minutes.
DEFAULT_IDLE_S = 600.0
# Stragglers: over the last ``STRAGGLER_WINDOW`` micro-steps every rank began, a rank that
# began them later than the median rank by at least this share of the median micro-step
# period, and by at least ``STRAGGLER_MIN_S``. A rank slow before its forward (data loading,
# a slow disk) is late at every micro-step's begin; the others wait for it in all-gathers, so
# their micro-steps last as long as its own: lateness tells it apart, duration does not.
STRAGGLER_WINDOW = 8
STRAGGLER_SHARE = 0.25
STRAGGLER_MIN_S = 0.2

INSIDE = ("pass", "eval")
# A rank read through the run dir's mirror is seen up to one flush interval late, later on a
# loaded host: the limits grow by this many flush intervals.
MIRROR_LAG_FLUSHES = 2
MIRROR_LAG_S = MIRROR_LAG_FLUSHES * DEFAULT_FLUSH_INTERVAL_S


@dataclass(frozen=True)
class Verdict:
    """What the rule says after a poll: ``hung`` with the limit that was passed and why."""

    hung: bool
    quiet_s: float
    limit_s: float
    inside: tuple[int, ...]  # ranks inside a pass or an eval forward
    reason: str


def hang_time(ranks: Iterable[RankState], hang_after: float | None) -> float:
    """``hang_after`` when given, else ``HANG_FACTOR`` times the slowest micro-step seen."""
    if hang_after is not None:
        return hang_after
    slowest = max((max(r.micro_step_ns, default=0) for r in ranks), default=0) / 1e9
    return max(MIN_HANG_S, HANG_FACTOR * slowest)


def judge(ranks: dict[int, RankState], quiet_s: float, *, hang_after: float | None,
          idle_after: float, mirrored: bool = False) -> Verdict:
    """Whether the run is hung after ``quiet_s`` seconds in which no rank recorded anything
    (``mirrored``: some rank is seen through the mirror, ``MIRROR_LAG_S`` late)."""
    running = [r for r in ranks.values() if r.ending is None]
    inside = tuple(sorted(r.rank for r in running if r.where() in INSIDE))
    limit = hang_time(ranks.values(), hang_after) if inside else idle_after
    limit += MIRROR_LAG_S if mirrored else 0.0
    if not running:
        return Verdict(False, quiet_s, limit, inside, "every rank ended")
    if quiet_s < limit:
        return Verdict(False, quiet_s, limit, inside, "recording")
    if inside:
        reason = (f"no rank recorded anything for {quiet_s:.1f} s (hang time {limit:.1f} s) "
                  f"while rank(s) {', '.join(map(str, inside))} were inside a pass or an "
                  "eval forward")
    else:
        reason = (f"no rank recorded anything for {quiet_s:.1f} s (idle time {limit:.1f} s) "
                  "while every running rank was between optimizer steps")
    return Verdict(True, quiet_s, limit, inside, reason)


@dataclass(frozen=True)
class Straggler:
    rank: int
    late_s: float
    period_s: float
    num_micro_steps: int


def stragglers(ranks: dict[int, RankState], offsets_ns: dict[int, int] | None = None
               ) -> list[Straggler]:
    """Ranks that began the recent micro-steps far later than the median rank.

    ``offsets_ns``: per rank, what turns its monotonic clock into wall time (``wall_anchor_ns
    - mono_anchor_ns`` of its meta), so ranks of different hosts compare; 0 when missing.
    """
    begins: dict[tuple[int, int], dict[int, int]] = {}
    for state in ranks.values():
        offset = (offsets_ns or {}).get(state.rank, 0)
        for step, micro, t_ns in state.micro_steps[-4 * STRAGGLER_WINDOW:]:
            begins.setdefault((step, micro), {})[state.rank] = t_ns + offset
    order = sorted(ranks)
    if len(order) < 2:
        return []
    common = [k for k in sorted(begins) if len(begins[k]) == len(order)][-STRAGGLER_WINDOW:]
    if len(common) < 3:
        return []
    times = np.array([[begins[k][r] for r in order] for k in common], dtype=np.float64) / 1e9
    median = np.sort(times, axis=1)[:, (len(order) - 1) // 2]
    late = np.median(times - median[:, None], axis=0)
    period = float(np.median(np.diff(median))) if len(common) > 1 else 0.0
    limit = max(STRAGGLER_MIN_S, STRAGGLER_SHARE * period)
    return [Straggler(order[i], float(late[i]), period, len(common))
            for i in np.flatnonzero(late >= limit)]
