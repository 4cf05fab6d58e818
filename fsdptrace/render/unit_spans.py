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

import numpy as np
import pandas as pd

from fsdptrace.reading.keys import row_keys
from fsdptrace.reading.text_columns import as_text
from fsdptrace.store import schema

FORWARD_END = "post-forward reshard"
BACKWARD_END = "post-backward"
NO_END = "none recorded"
SPAN_COLUMNS = ["rank", "seq", "t_ns", "step", "micro_step", "phase", "unit",
                "end_seq", "end_ns", "end_kind"]
_KEY = ["rank", "unit", "phase"]


def unit_spans(events: pd.DataFrame, allgathers: pd.DataFrame,
               backward_grads: pd.DataFrame) -> pd.DataFrame:
    """``events`` with ``end_seq``, ``end_ns`` (nullable) and ``end_kind`` per begin.

    Ranks in pieces of about ``PIECE_ROWS`` begins: a span never pairs rows of two ranks, and
    the sorts and merges then hold a piece's rows, not the run's (on a 64-rank run of 10M
    events they had held ~5 GB beside the tables while the report was made). A small run is
    one piece."""
    frames = (events, allgathers, backward_grads)
    rows = [_rows_by_rank(f) for f in frames]
    pieces = []
    for ranks in _pieces({r: len(p) for r, p in rows[0].items()}):
        own = [f.take(np.concatenate([by.get(r, _NONE) for r in ranks]))
               for f, by in zip(frames, rows, strict=True)]
        piece = _spans_of(*own)
        if len(piece):
            pieces.append(piece)
    if len(pieces) == 1:
        return pieces[0]
    return pd.concat(pieces, ignore_index=True) if pieces else pd.DataFrame(columns=SPAN_COLUMNS)


PIECE_ROWS = 1_000_000
_NONE = np.array([], dtype=np.intp)


def _rows_by_rank(frame: pd.DataFrame) -> dict[int, np.ndarray]:
    """Positions of each rank's rows in ``frame``, lowest rank first, each rank's in order
    (one grouping, no copy of rows)."""
    if not len(frame) or "rank" not in frame:
        return {}
    found = frame.groupby(frame["rank"].astype("int64")).indices
    return {int(r): found[r] for r in sorted(found)}


def _pieces(sizes: dict[int, int]) -> list[list[int]]:
    """Consecutive ranks, each list's rows adding up to ``PIECE_ROWS`` or one rank's more."""
    pieces: list[list[int]] = []
    total = PIECE_ROWS
    for rank, size in sizes.items():
        if total + size > PIECE_ROWS:
            pieces.append([])
            total = 0
        pieces[-1].append(rank)
        total += size
    return pieces


def _spans_of(events: pd.DataFrame, allgathers: pd.DataFrame,
              backward_grads: pd.DataFrame) -> pd.DataFrame:
    """``unit_spans`` of some ranks' rows, all at once."""
    begins = _plain(events, ["rank", "seq", "t_ns", "step", "micro_step", "phase", "unit"])
    if not len(begins):
        return pd.DataFrame(columns=SPAN_COLUMNS)
    begins = begins.sort_values("seq", kind="stable")
    forward, backward = _forward_ends(allgathers), _backward_ends(backward_grads)
    if not len(forward) and not len(backward):
        none = pd.array([pd.NA] * len(begins), dtype="Int64")
        return _spans(begins.assign(end_seq=none, end_ns=none, end_kind=NO_END))
    # (rank, unit, phase) as one integer in all three tables, from the names' codes: merged
    # and grouped on it, not on text (a categorical per table, each of its own names).
    key, *end_keys = row_keys([begins, forward, backward], _KEY)
    ends = pd.concat([e.drop(columns=_KEY).assign(_key=k)
                      for e, k in zip((forward, backward), end_keys, strict=True)],
                     ignore_index=True).sort_values("end_seq", kind="stable")
    # An end's clock is taken by its row, not carried through the merge: a begin without an end
    # makes the merged columns float64, which rounds clocks past 2**53 ns (a host up ~104 days).
    clocks = ends.pop("end_ns").to_numpy(dtype=np.int64)
    begins["next_seq"] = _next_of_same_key(key, begins["seq"].to_numpy())
    merged = pd.merge_asof(begins.assign(_key=key), ends.assign(_end=np.arange(len(ends))),
                           left_on="seq", right_on="end_seq", by="_key", direction="forward")
    row = merged["_end"].to_numpy(dtype=np.float64)
    end_ns = pd.array(clocks[np.nan_to_num(row).astype(np.int64)], dtype="Int64")
    end_ns[np.isnan(row)] = pd.NA
    merged["end_ns"] = pd.Series(end_ns, index=merged.index)
    own = ((merged["step_end"] == merged["step"])
           & (merged["micro_step_end"] == merged["micro_step"])
           & (merged["next_seq"].isna() | (merged["end_seq"] < merged["next_seq"])))
    merged["end_seq"] = merged["end_seq"].where(own).astype("Int64")
    merged["end_ns"] = merged["end_ns"].where(own).astype("Int64")
    merged["end_kind"] = merged["end_kind"].where(own, NO_END)
    return _spans(merged)


def _spans(begins: pd.DataFrame) -> pd.DataFrame:
    """``SPAN_COLUMNS`` of begins with their ends, in (rank, seq) order, names as text."""
    out = begins.sort_values(["rank", "seq"], kind="stable").reset_index(drop=True)
    return out.assign(phase=as_text(out["phase"]), unit=as_text(out["unit"]))[SPAN_COLUMNS]


def _next_of_same_key(key: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Per row (rows in ``seq`` order), the ``seq`` of the next row with the same key; NaN for
    a key's last row."""
    order = np.argsort(key, kind="stable")  # by key, in seq order within each
    following = np.full(len(key), np.nan)
    same = key[order[1:]] == key[order[:-1]]
    following[order[:-1][same]] = seq[order[1:][same]]
    return following


def _forward_ends(allgathers: pd.DataFrame) -> pd.DataFrame:
    if not len(allgathers):
        return _ends(pd.DataFrame(columns=["rank", "seq", "t_ns", "step", "micro_step",
                                           "unit", "phase"]), FORWARD_END)
    rows = allgathers[(as_text(allgathers["event"]) == "reshard")
                      & (as_text(allgathers["phase"]) == schema.FORWARD)]
    return _ends(rows, FORWARD_END)


def _backward_ends(backward_grads: pd.DataFrame) -> pd.DataFrame:
    """The first row of each post-backward; ``idle`` rows come from the end-of-backward
    safety net for a unit that did not run backward, so they end nothing."""
    if not len(backward_grads):
        rows = pd.DataFrame(columns=["rank", "seq", "t_ns", "step", "micro_step", "unit"])
    else:
        rows = backward_grads[as_text(backward_grads["via"]) != "idle"]
    phase = pd.Categorical.from_codes(np.zeros(len(rows), dtype=np.int8), [schema.BACKWARD])
    return _ends(rows.assign(phase=phase), BACKWARD_END)


def _ends(rows: pd.DataFrame, kind: str) -> pd.DataFrame:
    plain = _plain(rows, ["rank", "seq", "t_ns", "step", "micro_step", "unit", "phase"])
    return pd.DataFrame({
        "rank": plain["rank"], "unit": plain["unit"], "phase": plain["phase"],
        "end_seq": plain["seq"], "end_ns": plain["t_ns"], "step_end": plain["step"],
        "micro_step_end": plain["micro_step"], "end_kind": kind,
    })


def _plain(frame: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """``columns`` of ``frame``: numbers as int64, names as the table holds them (compared
    through ``row_keys``, which reads categoricals of different tables alike)."""
    out = pd.DataFrame(index=frame.index)
    for column in columns:
        values = frame[column] if column in frame else pd.Series(dtype=object)
        out[column] = values if column in ("unit", "phase") else values.astype("int64")
    return out
