"""How a rank ended, read from markers in one place (``fsdptrace.reading.endings``); aborted
micro-steps are cut off in every table (``checks.incomplete``)."""

from __future__ import annotations

import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _merged_endings(markers: pd.DataFrame, ranks: list[int]) -> pd.DataFrame:
    """The definition ``rank_endings`` had in pandas (a left merge of the last ending of each
    rank onto the ranks asked)."""
    ends = endings.ending_markers(markers)
    present = pd.DataFrame({"rank": pd.Series(sorted({int(r) for r in ranks}), dtype="int64")})
    if len(ends):
        order = [c for c in ("t_ns", "seq") if c in ends]
        ends = ends.sort_values(order) if order else ends
        ends = ends.assign(rank=ends["rank"].astype("int64"),
                           ending=ends["kind"].astype(object).map(endings._BY_KIND))
        ends = ends.drop_duplicates("rank", keep="last")
        out = present.merge(ends[["rank", "ending", "detail", "step", "micro_step"]],
                            on="rank", how="left")
    else:
        out = present.assign(ending=None, detail=None, step=None, micro_step=None)
    out["ending"] = out["ending"].astype(object).where(out["ending"].notna(),
                                                       endings.KILLED_OR_HUNG)
    out["detail"] = out["detail"].astype(object).where(out["detail"].notna(), "").astype(str)
    out["step"] = pd.array(out["step"], dtype="Int64")
    out["micro_step"] = pd.array(out["micro_step"], dtype="Int64")
    return out[endings.COLUMNS]


_KINDS = [*schema.ENDING_MARKERS, schema.MARKER_OPTIMIZER_STEP, schema.MARKER_MICRO_STEP]
_MARKER = st.tuples(st.integers(0, 4), st.integers(0, 5), st.sampled_from(_KINDS),
                    st.sampled_from([None, "", "SIGTERM", "KeyError: 'x'"]),
                    st.one_of(st.none(), st.integers(0, 3)))


@settings(max_examples=200, deadline=None)
@given(st.lists(_MARKER, max_size=10), st.lists(st.integers(0, 5), max_size=6),
       st.booleans(), st.booleans())
def test_rank_endings_is_the_merge_it_replaced(rows: list[tuple], ranks: list[int],
                                               categorical: bool, with_time: bool) -> None:
    """Ties in time, ranks with two endings or none, ranks asked that have no markers, null
    details and steps, the kind column categorical or text."""
    markers = pd.DataFrame({
        "rank": pd.Series([r[0] for r in rows], dtype="int64"),
        "seq": pd.Series([r[1] for r in rows], dtype="int64"),
        "kind": pd.Series([r[2] for r in rows], dtype="category" if categorical else object),
        "detail": pd.Series([r[3] for r in rows], dtype="string"),
        "step": pd.array([r[4] for r in rows], dtype="Int64"),
        "micro_step": pd.array([r[4] for r in rows], dtype="Int64")})
    if with_time:
        markers["t_ns"] = markers["seq"] // 2
    pd.testing.assert_frame_equal(endings.rank_endings(markers, ranks),
                                  _merged_endings(markers, ranks))
