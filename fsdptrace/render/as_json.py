"""Findings as one JSON object, for scripts and CI."""

from __future__ import annotations

import json
from typing import Any, TextIO

import pandas as pd

from fsdptrace.checks.findings import COLUMNS


def _value(value: Any) -> Any:
    if value is None or value is pd.NA or (isinstance(value, float) and pd.isna(value)):
        return None
    if hasattr(value, "item"):
        return value.item()
    return value


def document(findings: pd.DataFrame, *, run_dir: str, ranks: list[int], world_size: int,
             summary: dict[str, Any]) -> dict[str, Any]:
    rows = [{c: _value(v) for c, v in zip(COLUMNS, values, strict=True)}
            for values in findings[COLUMNS].itertuples(index=False, name=None)]
    return {"run_dir": run_dir, "ranks": ranks, "world_size": world_size, "findings": rows,
            "summary": summary}


def render(findings: pd.DataFrame, out: TextIO, **context: Any) -> None:
    json.dump(document(findings, **context), out, indent=2)
    out.write("\n")
