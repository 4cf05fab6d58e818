"""Order primitives the across-ranks checks share on pandas frames: first differences, unit
sets (majorities: ``checks.majority``).

An order is never materialized as a Python list per group; it is a
``(rank, step, micro_step, phase, position, unit)`` frame, and comparing two orders is a merge.
Positions themselves are computed on code columns (``checks.positions``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import pandas as pd

GROUP = ["rank", "step", "micro_step", "phase"]
END = "<end>"  # what a side that ended early has at an index
UNIT_SEP = "\x1f"  # between the unit names of ``param_sets``
T = TypeVar("T")


def first_difference(left: pd.DataFrame, right: pd.DataFrame, on: list[str]) -> pd.DataFrame:
    """For each pair of orders keyed by ``on``, the first index where they differ.

    ``left``/``right`` hold ``on + [position, unit]``. Returns ``on + [index, left_unit,
    right_unit]``; a side that ended early shows ``<end>``.
    """
    merged = left[on + ["position", "unit"]].merge(
        right[on + ["position", "unit"]], on=on + ["position"], how="outer",
        suffixes=("_left", "_right"),
    )
    lu = merged["unit_left"].astype(object)
    ru = merged["unit_right"].astype(object)
    differs = lu.isna() | ru.isna() | (lu != ru)
    diff = merged[differs].sort_values(on + ["position"])
    first = diff.drop_duplicates(on, keep="first")
    return pd.DataFrame({
        **{c: first[c].to_numpy() for c in on},
        "index": first["position"].to_numpy(),
        "left_unit": first["unit_left"].astype(object).fillna(END).to_numpy(),
        "right_unit": first["unit_right"].astype(object).fillna(END).to_numpy(),
    })


def unit_sets(units: pd.DataFrame) -> pd.DataFrame:
    """Per rank, a hash of the set of unit names: ranks of different stages never compare."""
    if not len(units):
        return pd.DataFrame(columns=["rank", "unit_set"])
    distinct = units[["rank", "unit"]].drop_duplicates()
    unit = distinct["unit"]
    if isinstance(unit.dtype, pd.CategoricalDtype) and not unit.isna().any():
        # The same hashes, each distinct name hashed once (``hash_array`` is per value).
        names = pd.util.hash_array(unit.cat.categories.astype(str).to_numpy())
        hashed = names[unit.cat.codes.to_numpy()]
    else:
        hashed = pd.util.hash_array(unit.astype(str).to_numpy())
    sets = pd.Series(hashed, index=distinct.index).groupby(distinct["rank"]).sum()
    return sets.rename("unit_set").reset_index()


def param_sets(units: pd.DataFrame, sets: pd.DataFrame) -> pd.DataFrame:
    """Per rank, a hash of its parameter names (``param_set``) and its unit names, sorted and
    joined by ``UNIT_SEP`` (``units``): ranks of one model hold the same parameters whatever
    units wrap them, so equal parameter sets with unequal unit sets (``sets``: ``unit_sets``
    of the same units) mean the model was wrapped differently on some ranks (pipeline stages
    hold different parameters). Each distinct name is hashed once, and each unit set's names
    joined once: ~17 ms for 256 ranks of 48 units of 10 parameters, ~1 ms for a small run."""
    if not len(units) or "param_names" not in units:
        return pd.DataFrame({"rank": pd.Series(dtype="int64"),
                             "param_set": pd.Series(dtype="uint64"),
                             "units": pd.Series(dtype="category")})
    lists = [v if isinstance(v, list | tuple | np.ndarray) else ()
             for v in units["param_names"].to_numpy()]
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    names = np.fromiter(itertools.chain.from_iterable(lists), dtype=object,
                        count=int(lengths.sum()))
    codes, distinct = pd.factorize(names)
    hashed = pd.util.hash_array(np.asarray(distinct, dtype=object).astype(str))[codes]
    ranks, row_rank = np.unique(units["rank"].to_numpy(dtype=np.int64), return_inverse=True)
    param_set = np.zeros(len(ranks), dtype=np.uint64)
    np.add.at(param_set, np.repeat(row_rank, lengths), hashed)  # wraps, as a hash sum may
    unit_names: list[set[str]] = [set() for _ in ranks]
    for at, name in zip(row_rank.tolist(), units["unit"].astype(str).tolist(), strict=True):
        unit_names[at].add(name)
    set_of = dict(zip(sets["rank"].astype("int64").tolist(), sets["unit_set"], strict=True))
    texts: dict[object, str] = {}
    for rank, mine in zip(ranks.tolist(), unit_names, strict=True):
        if set_of.get(rank) not in texts:
            texts[set_of.get(rank)] = UNIT_SEP.join(sorted(mine))
    return pd.DataFrame({"rank": ranks, "param_set": param_set,
                         "units": pd.Categorical([texts[set_of.get(r)] for r in ranks.tolist()])})


def first_difference_of(left: Sequence[T], right: Sequence[T]) -> tuple[int, T | str, T | str]:
    """Two orders held as lists (an eval interval, a stopped pass, a pass's collectives): the
    first index where they differ and each side's item there (``<end>`` past a side's end)."""
    for index in range(max(len(left), len(right))):
        mine = left[index] if index < len(left) else END
        theirs = right[index] if index < len(right) else END
        if mine != theirs:
            return index, mine, theirs
    raise AssertionError("the orders differ, so some index does")
