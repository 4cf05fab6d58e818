"""The findings table every check returns: the columns of docs/checks.md, one row per finding.

Where a finding is (``LOCATION``), what it says (``message``), and the figures the message
quotes as their own nullable columns (``FIGURES``), so scripts need not parse messages.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from fsdptrace.checks.kernel.columns import empty_frame, text_storage

LOCATION = ["check", "severity", "rank", "step", "micro_step", "phase", "unit", "target"]
# position: the index in the order the message names (check 1: the source's first call; 4, 7:
# the first difference; 6: the last unit entered); target_position: check 1's target's last
# call; bytes and held_ms: a wasted gather; call_index: which call of the source (1-based);
# parameters: the parameters named, comma-separated.
FIGURES = ["position", "target_position", "bytes", "held_ms", "call_index", "parameters"]
COLUMNS = [*LOCATION, "message", *FIGURES]
ERROR = "error"
WARNING = "warning"
SEVERITY_ORDER = {ERROR: 0, WARNING: 1}

_DTYPES = {
    "check": "string",
    "severity": "string",
    "rank": "Int64",
    "step": "Int64",
    "micro_step": "Int64",
    "phase": "string",
    "unit": "string",
    "target": "string",
    "message": "string",
    "position": "Int64",
    "target_position": "Int64",
    "bytes": "Int64",
    "held_ms": "Float64",
    "call_index": "Int64",
    "parameters": "string",
}

_EMPTY_DTYPES = {c: _DTYPES[c] for c in COLUMNS}


def _resolved() -> dict[str, Any]:
    """``_DTYPES`` as instances (``dtype == "string"`` also holds for pandas' NaN-valued
    ``str`` dtype), for the text storage now (``columns.text_storage``)."""
    return _resolved_for(text_storage())


@functools.cache
def _resolved_for(storage: str) -> dict[str, Any]:
    return {c: pd.Series([], dtype=d).dtype for c, d in _DTYPES.items()}

def empty() -> pd.DataFrame:
    """No findings, with the right columns and dtypes.

    Built once and copied (``empty_frame``): every check returns it on a clean step, and
    building the typed columns costs milliseconds, which the live option would pay before each
    optimizer step.
    """
    return empty_frame(_EMPTY_DTYPES)


def make(check: str, severity: str, rows: pd.DataFrame, message: Iterable[str]) -> pd.DataFrame:
    """Build findings from a frame holding some of the location and figure columns, plus
    messages; columns it lacks stay null."""
    given: dict[str, Any] = {c: rows[c].reset_index(drop=True)
                             for c in [*LOCATION[2:], *FIGURES] if c in rows}
    resolved = _resolved()
    given["check"] = pd.array([check] * len(rows), dtype=resolved["check"])
    given["severity"] = pd.array([severity] * len(rows), dtype=resolved["severity"])
    given["message"] = pd.array(list(message), dtype=resolved["message"])
    return _typed(given, pd.RangeIndex(len(rows)))


def from_records(records: list[dict[str, Any]]) -> pd.DataFrame:
    if not records:
        return empty()
    return normalize(pd.DataFrame.from_records(records, columns=COLUMNS))


def normalize(frame: pd.DataFrame) -> pd.DataFrame:
    """Cast to the declared dtypes; categoricals become plain strings."""
    return _typed(frame, frame.index)


def _typed(given: Mapping[str, Any], index: pd.Index) -> pd.DataFrame:
    """``COLUMNS`` from ``given`` (a frame or its columns by name, in ``index``'s order), each
    cast to its declared dtype; a column not given is null."""
    out = {}
    resolved = _resolved()
    for column in COLUMNS:
        if column not in given:
            out[column] = pd.array([None] * len(index), dtype=resolved[column])
            continue
        values = given[column]
        if values.dtype == resolved[column]:  # already normalized (combine's inputs)
            out[column] = values
            continue
        if isinstance(values.dtype, pd.CategoricalDtype):
            values = values.astype(object)
        if _DTYPES[column] == "Int64" and values.dtype == object:
            values = pd.to_numeric(values)
        out[column] = values.astype(_DTYPES[column])
    # One construction from arrays: inserting fifteen columns one by one, or aligning fifteen
    # indexes, costs more than the rows do.
    return pd.DataFrame({c: getattr(v, "array", v) for c, v in out.items()}, index=index)


def combine(frames: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate findings and sort them: errors first, then by step, rank, check."""
    frames = [f for f in frames if len(f)]
    if not frames:
        return empty()
    merged = pd.concat(frames, ignore_index=True)
    if not _is_normal(merged):
        merged = normalize(merged)
    return merged.take(_ordered(merged)).reset_index(drop=True)


def _is_normal(frame: pd.DataFrame) -> bool:
    """``COLUMNS`` in order, each of its declared dtype (what ``normalize`` returns)."""
    resolved = _resolved()
    return list(frame.columns) == COLUMNS and list(frame.dtypes) == [resolved[c] for c in COLUMNS]


def _ordered(merged: pd.DataFrame) -> list[int]:
    """Row positions by severity (unknown last), then ``_SORT_KEYS``, a missing value first
    in each, ties in their given order.

    A stable sort of Python tuples: findings are tens to thousands of rows, where a pandas
    sort on eight nullable columns costs milliseconds of fixed cost on every analysis (and
    on every optimizer step under ``live``).
    """
    severity = [SEVERITY_ORDER.get(s, 9) for s in merged["severity"].tolist()]
    keys = list(zip(severity, *(_missing_first(merged[c].tolist()) for c in _SORT_KEYS),
                    strict=True))
    return sorted(range(len(keys)), key=keys.__getitem__)


_SORT_KEYS = ["step", "rank", "check", "micro_step", "phase", "unit", "target"]


def _missing_first(values: list[Any]) -> list[tuple[Any, ...]]:
    return [(0,) if v is pd.NA else (1, v) for v in values]
