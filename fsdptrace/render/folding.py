"""Fold identical findings into one line: the same problem on many ranks and steps.

A finding's message says what is wrong; where (rank, step, micro-step) lives in its columns.
Findings that differ only in where, or in the numbers their message quotes (bytes, hold
times, the step it was consumed in), fold into one row listing every rank, step and
micro-step; the row keeps the first message as the example.
"""

from __future__ import annotations

import re

import pandas as pd

_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")

WHERE = ["rank", "step", "micro_step"]
KEY = ["check", "severity", "phase", "unit", "target", "message"]


def _ints(values: pd.Series) -> list[int]:
    return sorted({int(x) for x in values.dropna()})


def fold(findings: pd.DataFrame) -> pd.DataFrame:
    """One row per distinct finding, with ``ranks``, ``steps``, ``micro_steps`` lists and
    ``count`` (the findings folded into it) and ``varies`` (their messages differ in numbers);
    the order of first appearance is kept."""
    if not len(findings):
        return findings.assign(ranks=[], steps=[], micro_steps=[], count=[], varies=[])
    keyed = findings.reset_index(drop=True).assign(_order=range(len(findings)))
    key = keyed[KEY].astype(object).where(keyed[KEY].notna(), "\x00").astype(str)
    key["message"] = key["message"].str.replace(_NUMBER, "#", regex=True)
    keyed["_key"] = pd.util.hash_pandas_object(key, index=False).to_numpy()
    grouped = keyed.groupby("_key", sort=False)
    first = grouped.head(1).set_index("_key")
    first["ranks"] = grouped["rank"].agg(_ints)
    first["steps"] = grouped["step"].agg(_ints)
    first["micro_steps"] = grouped["micro_step"].agg(_ints)
    first["count"] = grouped.size()
    first["varies"] = grouped["message"].nunique() > 1
    return first.sort_values("_order").drop(columns="_order").reset_index(drop=True)
