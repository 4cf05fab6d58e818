"""``against_majority`` (the rule every cross-rank check and the hang verdict share) agrees with
a plain reading of its docstring on random comparisons: groups of a few ranks, sides of equal
size, null keys and values, and the column types the checks pass (uint64 hashes, categoricals,
text)."""

from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest

from fsdptrace.checks.kernel.majority import COLUMNS, against_majority, ranks_text

VALUE_KINDS = ["uint64", "str", "category", "float64", "int64"]


def comparison(seed: int) -> tuple[pd.DataFrame, list[str]]:
    """Rows of one rank each per group: a few groups of 1-6 ranks, a few values, some null."""
    rng = random.Random(seed)
    rows, keys = [], ["slot", "unit"]
    for slot in range(rng.randint(0, 4)):
        for unit in rng.sample(["a", "b", None], rng.randint(1, 3)):
            ranks = rng.sample(range(12), rng.randint(1, 6))
            values = rng.sample(range(1, 9), rng.randint(1, 3))
            for rank in ranks:
                value = None if rng.random() < 0.1 else rng.choice(values)
                rows.append({"slot": slot, "unit": unit, "rank": rank, "value": value,
                             "detail": f"row {len(rows)}"})
    frame = pd.DataFrame(rows, columns=["slot", "unit", "rank", "value", "detail"])
    kind = rng.choice(VALUE_KINDS)
    if kind in ("uint64", "int64"):  # hashes and counts have no null
        frame = frame.dropna(subset=["value"])
        frame["value"] = frame["value"].astype(kind)
    elif kind == "float64":
        frame["value"] = frame["value"].astype(kind)
    else:
        frame["value"] = frame["value"].map(lambda v: None if pd.isna(v) else f"v{int(v)}"
                                            ).astype(kind)
    frame = frame.astype({"slot": "uint64", "rank": rng.choice(["int64", "int32"]),
                          "unit": "category"})
    if rng.random() < 0.5:
        frame = frame.sample(frac=1, random_state=seed)  # rows in no order, index shuffled
    return frame, keys


def expected(frame: pd.DataFrame, keys: list[str], every_row: bool) -> set[tuple]:
    """The docstring's rule, one group at a time."""
    groups: dict[tuple, list[tuple[int, object]]] = {}
    for *key, rank, value in frame[[*keys, "rank", "value"]].itertuples(index=False):
        if not any(pd.isna(k) for k in key):
            groups.setdefault(tuple(key), []).append((rank, None if pd.isna(value) else value))
    out = set()
    for key, members in groups.items():
        sides: dict[object, list[int]] = {}
        for rank, value in members:
            if value is not None:
                sides.setdefault(value, []).append(rank)
        if len(members) < 2 or not sides:
            continue
        top = max(map(len, sides.values()))
        tops = [v for v, ranks in sides.items() if len(ranks) == top]
        best = min(tops, key=lambda v: min(sides[v]))
        every_side = " | ".join(t for _, t in sorted((min(r), ranks_text(r))
                                                      for r in sides.values()))
        for rank, value in members:
            reference = best
            if len(tops) > 1 and value == best:  # a tie: against the next side instead
                reference = min((v for v in sides if v != value), key=lambda v: min(sides[v]))
            agrees = value == reference
            if agrees and not every_row:
                continue
            out.add((*key, rank, value, reference, min(sides[reference]),
                     len(sides[reference]), sum(map(len, sides.values())), len(tops) > 1,
                     None if agrees else ranks_text(sides[reference]),
                     None if agrees else every_side))
    return out


def got(result: pd.DataFrame, keys: list[str]) -> set[tuple]:
    columns = [*keys, "rank", "value", *COLUMNS]
    return {tuple(None if pd.isna(v) else v for v in row)
            for row in result[columns].astype(object).itertuples(index=False)}


@pytest.mark.parametrize("every_row", [False, True])
def test_against_majority_follows_its_rule(every_row: bool) -> None:
    exercised = {"tie": 0, "null value": 0, "outvoted": 0}
    for seed in range(300):
        frame, keys = comparison(seed)
        result = against_majority(frame, keys, "value", every_row=every_row)
        assert got(result, keys) == expected(frame, keys, every_row), seed
        assert len(got(result, keys)) == len(result), seed  # one row per rank and group
        assert list(result.columns) == [*frame.columns, *COLUMNS]
        if len(result):
            assert result["reference"].dtype == frame["value"].dtype, seed
            assert result["reference_rank"].dtype == frame["rank"].dtype, seed
        exercised["tie"] += bool(result["tied"].astype(bool).any()) if len(result) else 0
        exercised["null value"] += bool(result["value"].isna().any())
        exercised["outvoted"] += bool(len(result) and (~result["tied"].astype(bool)).any())
    assert min(exercised.values()) >= 20, exercised


def test_no_group_of_two_ranks_is_no_row() -> None:
    frame = pd.DataFrame({"slot": [0, 1, 2], "rank": [0, 1, 2], "value": ["x", "y", "z"]})
    for every_row in (False, True):
        result = against_majority(frame, ["slot"], "value", every_row=every_row)
        assert result.empty and list(result.columns) == [*frame.columns, *COLUMNS]


def test_the_rows_set_against_another_side_come_last() -> None:
    """Order is part of what the checks read (they keep the first row per rank): the rows
    in rows' order, then those of a tie's picked side, by the lowest rank they are set
    against."""
    frame = pd.DataFrame({"slot": [0] * 4 + [1] * 2, "rank": [0, 1, 5, 6, 1, 2],
                          "value": np.array([7, 7, 8, 8, 5, 6], dtype=np.uint64)})
    result = against_majority(frame, ["slot"], "value")
    assert list(zip(result["slot"], result["rank"], result["reference_rank"], strict=True)) == [
        (0, 5, 0), (0, 6, 0), (1, 2, 1), (1, 1, 2), (0, 0, 5), (0, 1, 5)]


def test_with_every_row_the_agreeing_rows_come_first() -> None:
    frame = pd.DataFrame({"slot": [0, 0, 0, 1, 1], "rank": [0, 1, 2, 0, 1],
                          "value": ["x", "y", "x", "z", "z"]})
    result = against_majority(frame, ["slot"], "value", every_row=True)
    assert list(zip(result["slot"], result["rank"], result["reference_ranks"].notna(),
                    strict=True)) == [(0, 0, False), (0, 2, False), (1, 0, False),
                                      (1, 1, False), (0, 1, True)]
