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


def fold(findings: pd.DataFrame) -> pd.DataFrame:
    """One row per distinct finding, with ``ranks``, ``steps``, ``micro_steps`` lists and
    ``count`` (the findings folded into it) and ``varies`` (their messages differ in numbers);
    the order of first appearance is kept.

    In plain Python over the rows: the findings a text output folds are a few dozen, where a
    pandas groupby costs more than the rows (every ``analyze`` prints through here).
    """
    if not len(findings):
        return findings.assign(ranks=[], steps=[], micro_steps=[], count=[], varies=[])
    keys = zip(*(_texts(findings[column], number_free=column == "message") for column in KEY),
               strict=True)
    groups: dict[tuple[str, ...], _Group] = {}
    messages = findings["message"].tolist()
    wheres = [findings[column].tolist() for column in WHERE]
    for position, (key, message, *where) in enumerate(zip(keys, messages, *wheres,
                                                           strict=True)):
        group = groups.get(key)
        if group is None:
            group = groups[key] = _Group(position)
        group.add(message, where)
    first = findings.iloc[[g.first for g in groups.values()]].reset_index(drop=True)
    return first.assign(
        ranks=[g.sorted(0) for g in groups.values()],
        steps=[g.sorted(1) for g in groups.values()],
        micro_steps=[g.sorted(2) for g in groups.values()],
        count=[g.count for g in groups.values()],
        varies=[len(g.messages) > 1 for g in groups.values()])


class _Group:
    """The findings folded into one row: where they are, how many, their messages."""

    def __init__(self, first: int) -> None:
        self.first, self.count = first, 0
        self.where: tuple[set[int], set[int], set[int]] = (set(), set(), set())
        self.messages: set[str] = set()

    def add(self, message: object, where: list[object]) -> None:
        self.count += 1
        if not pd.isna(message):
            self.messages.add(message)  # type: ignore[arg-type]
        for found, value in zip(self.where, where, strict=True):
            if not pd.isna(value):
                found.add(int(value))  # type: ignore[call-overload]

    def sorted(self, index: int) -> list[int]:
        return sorted(self.where[index])


def _texts(values: pd.Series, *, number_free: bool) -> list[str]:
    """A key column as text, a null as NUL; a message with every number as ``#``."""
    texts = ["\x00" if pd.isna(v) else str(v) for v in values.tolist()]
    return [_NUMBER.sub("#", t) for t in texts] if number_free else texts

