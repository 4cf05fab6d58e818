"""How a rank ended, read from markers in one place (``fsdptrace.reading.endings``); aborted
micro-steps are cut off in every table (``checks.incomplete``)."""

from __future__ import annotations

import pandas as pd

from fsdptrace.reading import endings, incomplete
from fsdptrace.store import schema


def _markers(rows: list[tuple[int, int, str, str]]) -> pd.DataFrame:
    """(rank, seq, kind, detail) at step 2, micro-step 1."""
    return pd.DataFrame({"rank": [r[0] for r in rows], "seq": [r[1] for r in rows],
                         "t_ns": [r[1] for r in rows], "step": 2, "micro_step": 1,
                         "kind": [r[2] for r in rows], "count": 0,
                         "detail": [r[3] for r in rows]})


def test_every_ending_is_named_and_a_rank_without_one_is_killed_or_hung() -> None:
    markers = _markers([
        (0, 5, schema.MARKER_OPTIMIZER_STEP, ""), (0, 6, schema.MARKER_CLOSE, ""),
        (1, 7, schema.MARKER_CRASH, "RuntimeError: boom"),
        (2, 3, schema.MARKER_TERMINATED, "SIGTERM"),
        (3, 4, schema.MARKER_CLOSED_MID_STEP, "step 2, micro-step 1"),
        (4, 4, schema.MARKER_MICRO_STEP, ""),
    ])
    found = endings.rank_endings(markers, range(6))
    assert list(found["ending"]) == ["clean", "crashed", "terminated", "closed mid-step",
                                     "killed or hung", "killed or hung"]
    assert list(found["detail"]) == ["", "RuntimeError: boom", "SIGTERM",
                                     "step 2, micro-step 1", "", ""]
    assert list(found["step"].iloc[:4]) == [2, 2, 2, 2] and found["step"].iloc[4] is pd.NA
    assert endings.clean_ranks(markers) == {0}
    assert list(endings.describe(found))[1:3] == ["crashed (RuntimeError: boom)",
                                                  "was terminated by SIGTERM"]


def test_a_rank_recorded_again_after_a_close_ends_as_its_last_recorder() -> None:
    markers = _markers([(0, 9, schema.MARKER_CLOSE, ""), (0, 12, schema.MARKER_CRASH, "E: x")])
    assert endings.rank_endings(markers, [0])["ending"].tolist() == ["crashed"]


def test_no_markers_at_all() -> None:
    found = endings.rank_endings(pd.DataFrame(), [0, 1])
    assert found["ending"].tolist() == ["killed or hung"] * 2
    assert endings.clean_ranks(pd.DataFrame(), [0, 1]) == set()


def test_an_aborted_micro_step_is_incomplete_in_every_table() -> None:
    ranges = incomplete.parse(_markers([(1, 4, schema.MARKER_ABORTED, "reset_iter_state")]))
    assert set(ranges["table"]) == set(schema.TABLES)
    assert set(ranges["first_step"]) == {2} and set(ranges["last_micro_step"]) == {1}
    mask = incomplete.in_micro_steps(ranges, ("events",), pd.Series([1, 1, 0]).to_numpy(),
                                     pd.Series([2, 2, 2]).to_numpy(),
                                     pd.Series([1, 0, 1]).to_numpy())
    assert mask.tolist() == [True, False, False]
