"""Runs of ranks (``checks.kernel.rank_runs``) are lossless: ``expand(code(rows))`` gives back
every row whose rank has a unit set, held to the rows themselves on random slots, values,
unit sets (interleaved stages too) and ranks missing rows; runs coded batch by batch and
joined (``join``) are the runs of the whole; a run never spans a rank that lacks the slot or
holds another value, and a batch that was not a contiguous range of ranks is refused, not
silently expanded."""

from __future__ import annotations

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptrace.analysis.concat import concat_coded
from fsdptrace.checks.kernel import rank_runs

KEYS = ["step", "unit"]
VALUES = ["value", "flag"]


def _rows(cells: list[tuple]) -> pd.DataFrame:
    rows = pd.DataFrame(cells, columns=["rank", *KEYS, *VALUES]).drop_duplicates(
        ["rank", *KEYS])
    return rows.astype({"rank": "int32", "step": "int32", "unit": "category",
                        "value": "category", "flag": "bool"})


def _as_tuples(frame: pd.DataFrame) -> list[tuple]:
    plain = frame[["rank", *KEYS, *VALUES]].astype(
        {"rank": "int64", "step": "int64", "unit": str, "value": object, "flag": bool})
    return sorted(plain.itertuples(index=False, name=None), key=repr)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 2), st.sampled_from("ab"),
                          st.sampled_from(["x", "y", None]), st.booleans()),
                max_size=80),
       st.lists(st.integers(0, 2), min_size=9, max_size=9))
def test_expanding_the_runs_gives_the_rows_back(cells: list[tuple], sets: list[int]) -> None:
    rows = _rows(cells)
    unit_sets = pd.DataFrame({"rank": range(9), "unit_set": sets})  # rank 9 has none
    runs = rank_runs.code(rows, unit_sets, KEYS, VALUES)
    assert list(runs.columns) == ["unit_set", *KEYS, *VALUES, *rank_runs.RUN_COLUMNS]
    assert int(runs["num_ranks"].sum()) == int((rows["rank"] < 9).sum())
    back = rank_runs.expand(runs, unit_sets)
    assert _as_tuples(back) == _as_tuples(rows[rows["rank"] < 9])
    assert (back.merge(unit_sets, on="rank", suffixes=("", "_of_rank"))
            .eval("unit_set == unit_set_of_rank").all())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 2), st.sampled_from("ab"),
                          st.sampled_from(["x", "y", None]), st.booleans()),
                max_size=80),
       st.lists(st.integers(0, 2), min_size=9, max_size=9),
       st.sets(st.integers(1, 9)))
def test_runs_of_batches_joined_are_the_runs_of_the_whole(cells: list[tuple], sets: list[int],
                                                           cuts: set[int]) -> None:
    rows = _rows(cells)
    unit_sets = pd.DataFrame({"rank": range(9), "unit_set": sets})
    bounds = [0, *sorted(cuts), 10]
    batches = [rank_runs.code(rows[rows["rank"].between(a, b - 1)],
                              unit_sets[unit_sets["rank"].between(a, b - 1)], KEYS, VALUES)
               for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    joined = rank_runs.join(concat_coded(batches), unit_sets)
    whole = rank_runs.code(rows, unit_sets, KEYS, VALUES)
    assert _as_runs(joined) == _as_runs(whole)
    assert _as_tuples(rank_runs.expand(joined, unit_sets)) == _as_tuples(rows[rows["rank"] < 9])


def _as_runs(runs: pd.DataFrame) -> list[tuple]:
    plain = runs.astype({"unit": str, "value": object})
    return sorted(plain.itertuples(index=False, name=None), key=repr)


def test_one_run_per_slot_where_every_rank_agrees() -> None:
    rows = _rows([(rank, step, "a", "x", False) for rank in range(6) for step in range(3)])
    unit_sets = pd.DataFrame({"rank": range(6), "unit_set": [7, 8] * 3})  # interleaved stages
    runs = rank_runs.code(rows, unit_sets, KEYS, VALUES)
    assert len(runs) == 3 * 2  # a run per step and unit set, whatever the ranks
    assert sorted(runs["num_ranks"]) == [3] * 6


def test_a_run_breaks_where_a_rank_differs_or_has_no_row() -> None:
    cells = [(rank, 0, "a", "y" if rank == 2 else "x", False) for rank in range(6) if rank != 4]
    runs = rank_runs.code(_rows(cells), pd.DataFrame({"rank": range(6), "unit_set": 1}),
                          KEYS, VALUES)
    assert runs[["first_rank", "last_rank", "value"]].astype({"value": str}).values.tolist() \
        == [[0, 1, "x"], [2, 2, "y"], [3, 3, "x"], [5, 5, "x"]]


def test_a_run_over_ranks_outside_its_batch_is_refused() -> None:
    runs = rank_runs.code(_rows([(0, 0, "a", "x", False), (2, 0, "a", "x", False)]),
                          pd.DataFrame({"rank": [0, 2], "unit_set": 1}), KEYS, VALUES)
    assert len(runs) == 1  # ranks 0 and 2, consecutive in that batch
    with pytest.raises(ValueError, match="contiguous range of ranks"):
        rank_runs.expand(runs, pd.DataFrame({"rank": [0, 1, 2], "unit_set": 1}))


def test_no_runs_is_code_of_no_rows_and_each_caller_gets_its_own() -> None:
    dtypes = {"rank": "int32", "step": "int32", "unit": "category", "value": "category",
              "flag": "bool"}
    empty = pd.DataFrame(columns=list(dtypes)).astype(dtypes)
    expected = rank_runs.code(empty, pd.DataFrame(columns=["rank", "unit_set"]), KEYS, VALUES)
    first = rank_runs.no_runs(dtypes, KEYS, VALUES)
    pd.testing.assert_frame_equal(first, expected)
    first["extra"] = 1  # a caller's change stays its own: the shape is built once, then copied
    pd.testing.assert_frame_equal(rank_runs.no_runs(dtypes, KEYS, VALUES), expected)
