"""What the map step keeps for checks 10 and 12 (runs of ranks) stays category codes through
the reduce.

Each batch of ranks numbers its own categories (unit names, parameter lists, setting values);
the reduce must join them into one vocabulary, not fall back to a Python string per row, and
the findings must not depend on how the ranks were cut into batches.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import fsdptrace
from fsdptrace.analysis import map_step
from fsdptrace.analysis.concat import concat_coded
from fsdptrace.checks import resolve
from fsdptrace.reading import reader
from tests.recordings import Recordings

CODED = {"gradient-divergence": ["unit", "reduced", "received"],
         "setting-divergence": ["unit", "setting", "value"]}


def test_concat_joins_categories_of_batches() -> None:
    first = pd.DataFrame({"rank": pd.array([0, 0], dtype="int32"),
                          "unit": pd.Categorical(["a", "b"]),
                          "value": pd.Categorical(["x", None])})
    second = pd.DataFrame({"rank": pd.array([1], dtype="int32"),
                           "unit": pd.Categorical(["c"]),
                           "value": pd.Series([None], dtype=object)})  # all null: no codes
    joined = concat_coded([first, second.iloc[:0], second])
    assert list(joined.columns) == ["rank", "unit", "value"]
    assert str(joined["rank"].dtype) == "int32"
    assert isinstance(joined["unit"].dtype, pd.CategoricalDtype)
    assert isinstance(joined["value"].dtype, pd.CategoricalDtype)
    assert list(joined["unit"].astype(object)) == ["a", "b", "c"]
    assert [None if pd.isna(v) else v for v in joined["value"].astype(object)] == [
        "x", None, None]


@pytest.mark.parametrize("scenario", ["one_rank_param_in_no_sync", "one_rank_skips_sync"])
def test_one_rank_per_batch_finds_the_same(recordings: Recordings, scenario: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks whose parameter lists or settings differ, each its own batch: the summaries
    stay categorical once joined, and the findings equal those of one batch and of a Trace."""
    run_dir: Path = recordings.divergence(scenario)[0]
    whole = fsdptrace.analyze(run_dir).findings
    assert len(whole)
    monkeypatch.setattr(map_step, "BATCH_RANKS", 1)
    names = resolve(None)
    ranks = reader.discover_ranks(run_dir)
    assert len(map_step.map_ranks(run_dir, ranks, names)) == 1  # a piece's batches combined
    summaries = [s for rank in ranks for s in map_step.map_ranks(run_dir, [rank], names)]
    assert len(summaries) == 2
    for check, columns in CODED.items():
        joined = concat_coded([s.summaries[check] for s in summaries])
        assert len(joined)
        for column in columns:
            assert isinstance(joined[column].dtype, pd.CategoricalDtype), (check, column)
        assert {str(joined[c].dtype) for c in ("first_rank", "last_rank", "num_ranks", "step",
                                               "micro_step")} == {"int32"}
    pd.testing.assert_frame_equal(fsdptrace.analyze(run_dir).findings, whole)
    pd.testing.assert_frame_equal(fsdptrace.analyze(fsdptrace.load(run_dir)).findings, whole)
