"""The FSDP settings in effect: the value of a unit's setting at a (step, micro_step).

The ``settings`` table holds a row per change; the value in effect at a micro-step is the last
row at or before it (of several rows in one micro-step, the last: what its backward used).
"""

from __future__ import annotations

import pandas as pd

from fsdptrace.reading.keys import step_key


def value_at(settings: pd.DataFrame, rows: pd.DataFrame, setting: str) -> pd.Series:
    """Per row of ``rows`` (rank, step, micro_step, unit): ``setting``'s JSON text in effect
    then on that rank, or None where nothing was recorded (older run dirs, HSDP's nulls)."""
    none = pd.Series(None, index=rows.index, dtype=object)
    if not len(settings) or not len(rows) or "setting" not in settings:
        return none
    mine = settings[settings["setting"].astype(str) == setting]
    if not len(mine):
        return none
    own = pd.DataFrame({"rank": mine["rank"].astype("int64"), "unit": mine["unit"].astype(str),
                        "key": step_key(mine["step"], mine["micro_step"]),
                        "value": mine["value"].astype(object)})
    own = own.drop_duplicates(["rank", "unit", "key"], keep="last").sort_values("key")
    left = pd.DataFrame({"_row": range(len(rows)), "rank": rows["rank"].astype("int64"),
                         "unit": rows["unit"].astype(str),
                         "key": step_key(rows["step"], rows["micro_step"])}).sort_values("key")
    joined = pd.merge_asof(left, own, on="key", by=["rank", "unit"], direction="backward")
    value = joined.sort_values("_row")["value"].astype(object)
    return pd.Series(value.where(value.notna(), None).to_numpy(), index=rows.index,
                     dtype=object)
