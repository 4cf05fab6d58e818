"""The silence before a rank's end: from its last recorded event to how it ended.

A 25 s hang records nothing for 25 s: the timeline of the step it hung in is a few
milliseconds of work and then nothing, unless the silence is drawn. For every rank whose
ending is not clean, the silence runs from its last recorded unit begin or end to its ending
marker (crashed, terminated, closed mid-step), or, killed or hung, to the last thing any rank
recorded (the moment the recording as a whole went quiet), on the wall clock. It is drawn on
the lane of the rank's last training step (eval forwards after it count as work, not silence).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from fsdptrace.reading import endings
from fsdptrace.reading.trace import Trace
from fsdptrace.render import wall_clock

# Shorter silences are the ordinary gap between a last event and a clean-looking exit.
MIN_SILENCE_NS = 1_000_000


def silences(trace: Trace, spans: pd.DataFrame) -> dict[int, dict[str, Any]]:
    """Per rank that did not end clean: ``step`` (its last), ``from_ns`` and ``to_ns`` on its
    own monotonic clock, and ``how`` it ended, in words."""
    if not len(spans):
        return {}
    ended = endings.rank_endings(trace.markers, trace.ranks)
    unclean = ended[ended["ending"] != endings.CLEAN]
    if not len(unclean):
        return {}
    shift = wall_clock.shifts(trace.meta)
    ends = spans["end_ns"].where(spans["end_ns"].notna(), spans["t_ns"]).astype("int64")
    last = pd.DataFrame({"rank": spans["rank"].astype("int64"), "step": spans["step"],
                         "t": pd.concat([spans["t_ns"].astype("int64"), ends], axis=1).max(axis=1)})
    last = last.sort_values("t").groupby("rank").tail(1).set_index("rank")
    evals = trace.eval_forwards
    if len(evals):  # eval forwards after the last step are work too, not silence
        latest = evals.groupby(evals["rank"].astype("int64"))["t_ns"].max()
        later = latest.reindex(last.index)
        last["t"] = last["t"].where(~(later > last["t"]), later).astype("int64")
    marks = endings.ending_markers(trace.markers)
    marked = (marks.assign(rank=marks["rank"].astype("int64")).groupby("rank")["t_ns"].max()
              if len(marks) else pd.Series(dtype="int64"))
    quiet_wall = _last_record_wall(trace, last["t"], shift)
    out = {}
    for row, how in zip(unclean.itertuples(index=False), endings.describe(unclean),
                        strict=True):
        rank = int(row.rank)
        if rank not in last.index:
            continue
        start = int(last.loc[rank, "t"])
        if row.ending != endings.KILLED_OR_HUNG and rank in marked.index:
            end = int(marked.loc[rank])
        else:
            end = quiet_wall - shift.get(rank, 0)
        if end - start >= MIN_SILENCE_NS:
            out[rank] = {"step": int(last.loc[rank, "step"]), "from_ns": start, "to_ns": end,
                         "how": str(how)}
    return out


def _last_record_wall(trace: Trace, last_event: pd.Series, shift: dict[int, int]) -> int:
    """The wall-clock time of the last thing any rank recorded (events or markers)."""
    latest = [int(t) + shift.get(int(r), 0) for r, t in last_event.items()]
    if len(trace.markers):
        per_rank = trace.markers.groupby(trace.markers["rank"].astype("int64"))["t_ns"].max()
        latest += [int(t) + shift.get(int(r), 0) for r, t in per_rank.items()]
    return max(latest)


def lane_silence(silence: dict[str, Any] | None, step: int, start: int) -> dict[str, Any] | None:
    """What one lane of ``step`` draws (microseconds from the lane's ``start``), if its rank
    went silent in that step."""
    if silence is None or silence["step"] != step:
        return None
    seconds = (silence["to_ns"] - silence["from_ns"]) / 1e9
    length = f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"
    return {"from": (silence["from_ns"] - start) // 1000, "to": (silence["to_ns"] - start) // 1000,
            "text": f"silent {length}, then {silence['how']}"}
