"""Where each unit's forward or backward *ended*, from what the recording holds, never guessed.

The ``events`` table keeps only when a unit began a phase. Two other tables mark ends, and
only these two: FSDP2's post-forward reshard (an ``allgathers`` row ``reshard`` in phase
``forward``, written when the unit's forward returns, if the unit reshards after forward) and
its post-backward (the unit's first ``backward_grads`` row, written when its gradients are
ready, before the reduce-scatter). A unit that keeps its parameters after forward (the root,
``reshard_after_forward=False``) has no recorded forward end; a recording made before these
tables has none at all. Such a begin stays an instant: a span drawn to the next unit's begin
would show one rank's wait for another as work.

All tables share one sequence counter per rank (``seq``), so "the first end after this begin,
before the unit begins the same phase again" is exact even where clocks tie.
"""

from __future__ import annotations

import pandas as pd

from fsdptrace.store import schema

FORWARD_END = "post-forward reshard"
BACKWARD_END = "post-backward"
NO_END = "none recorded"
SPAN_COLUMNS = ["rank", "seq", "t_ns", "step", "micro_step", "phase", "unit",
                "end_seq", "end_ns", "end_kind"]
_KEY = ["rank", "unit", "phase"]


def unit_spans(events: pd.DataFrame, allgathers: pd.DataFrame,
               backward_grads: pd.DataFrame) -> pd.DataFrame:
    """``events`` with ``end_seq``, ``end_ns`` (nullable) and ``end_kind`` per begin."""
    begins = _plain(events, ["rank", "seq", "t_ns", "step", "micro_step", "phase", "unit"])
    if not len(begins):
        return pd.DataFrame(columns=SPAN_COLUMNS)
    begins = begins.sort_values("seq", kind="stable")
    nxt = begins.sort_values([*_KEY, "seq"], kind="stable").groupby(_KEY)["seq"].shift(-1)
    begins["next_seq"] = nxt.reindex(begins.index)
    ends = pd.concat([_forward_ends(allgathers), _backward_ends(backward_grads)],
                     ignore_index=True).sort_values("end_seq", kind="stable")
    if not len(ends):
        none = pd.array([pd.NA] * len(begins), dtype="Int64")
        merged = begins.assign(end_seq=none, end_ns=none, end_kind=NO_END)
        return merged.sort_values(["rank", "seq"], kind="stable").reset_index(drop=True)[
            SPAN_COLUMNS]
    merged = pd.merge_asof(begins, ends, left_on="seq", right_on="end_seq", by=_KEY,
                           direction="forward", suffixes=("", "_end"))
    own = ((merged["step_end"] == merged["step"])
           & (merged["micro_step_end"] == merged["micro_step"])
           & (merged["next_seq"].isna() | (merged["end_seq"] < merged["next_seq"])))
    merged["end_seq"] = merged["end_seq"].where(own).astype("Int64")
    merged["end_ns"] = merged["end_ns"].where(own).astype("Int64")
    merged["end_kind"] = merged["end_kind"].where(own, NO_END)
    return merged.sort_values(["rank", "seq"], kind="stable").reset_index(drop=True)[
        SPAN_COLUMNS]


def _forward_ends(allgathers: pd.DataFrame) -> pd.DataFrame:
    if not len(allgathers):
        return _ends(pd.DataFrame(columns=["rank", "seq", "t_ns", "step", "micro_step",
                                           "unit", "phase"]), FORWARD_END)
    rows = allgathers[(allgathers["event"].astype(str) == "reshard")
                      & (allgathers["phase"].astype(str) == schema.FORWARD)]
    return _ends(rows, FORWARD_END)


def _backward_ends(backward_grads: pd.DataFrame) -> pd.DataFrame:
    """The first row of each post-backward; ``idle`` rows come from the end-of-backward
    safety net for a unit that did not run backward, so they end nothing."""
    if not len(backward_grads):
        rows = pd.DataFrame(columns=["rank", "seq", "t_ns", "step", "micro_step", "unit"])
    else:
        rows = backward_grads[backward_grads["via"].astype(str) != "idle"]
    return _ends(rows.assign(phase=schema.BACKWARD), BACKWARD_END)


def _ends(rows: pd.DataFrame, kind: str) -> pd.DataFrame:
    plain = _plain(rows, ["rank", "seq", "t_ns", "step", "micro_step", "unit", "phase"])
    return pd.DataFrame({
        "rank": plain["rank"], "unit": plain["unit"], "phase": plain["phase"],
        "end_seq": plain["seq"], "end_ns": plain["t_ns"], "step_end": plain["step"],
        "micro_step_end": plain["micro_step"], "end_kind": kind,
    })


def _plain(frame: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Integer and string columns: categoricals of different tables do not merge."""
    out = pd.DataFrame(index=frame.index)
    for column in columns:
        values = frame[column] if column in frame else pd.Series(dtype=object)
        text = column in ("unit", "phase")
        out[column] = values.astype(str) if text else values.astype("int64")
    return out
