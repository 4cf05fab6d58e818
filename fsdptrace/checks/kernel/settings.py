"""The FSDP settings in effect: the value of a unit's setting at a (step, micro_step).

The ``settings`` table holds a row per change; the value in effect at a micro-step is the last
row at or before it (of several rows in one micro-step, the last: what its backward used).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from fsdptrace.reading.keys import KEY_LIMIT, row_keys, step_key


def value_at(settings: pd.DataFrame, rows: pd.DataFrame, setting: str) -> pd.Series:
    """Per row of ``rows`` (rank, step, micro_step, unit): ``setting``'s JSON text in effect
    then on that rank, or None where nothing was recorded (older run dirs, HSDP's nulls).

    On arrays: each (rank, unit) of the changes numbered, and one sorted key per change
    (that number, then its step key) searched for every row. A ``merge_asof`` by rank and unit
    name made every row's unit a string, a tenth of check 10's summary on deep ranks.
    """
    none = pd.Series(np.full(len(rows), None, dtype=object), index=rows.index, dtype=object)
    if not len(settings) or not len(rows) or "setting" not in settings:
        return none
    mine = settings[(settings["setting"] == setting).to_numpy()]
    if not len(mine):
        return none
    own_pair, row_pair = row_keys([mine, rows], ["rank", "unit"])
    pairs, own_pair = np.unique(own_pair, return_inverse=True)
    at_pair = np.searchsorted(pairs, row_pair)
    known = at_pair < len(pairs)
    known[known] = pairs[at_pair[known]] == row_pair[known]
    own_key = step_key(mine["step"].to_numpy(), mine["micro_step"].to_numpy())
    row_key = step_key(rows["step"].to_numpy(), rows["micro_step"].to_numpy())
    bound = int(max(own_key.max(), row_key.max())) + 1
    if len(pairs) * bound >= KEY_LIMIT:  # keys re-coded densely, in their order
        _, dense = np.unique(np.concatenate([own_key, row_key]), return_inverse=True)
        own_key, row_key = dense[:len(own_key)], dense[len(own_key):]
        bound = int(dense.max()) + 1
    own = own_pair.astype(np.int64) * bound + own_key
    order = np.argsort(own, kind="stable")  # of equal keys, the last row is the last change
    wanted = np.where(known, at_pair, 0).astype(np.int64) * bound + row_key
    last = np.searchsorted(own[order], wanted, side="right") - 1
    found = known & (last >= 0)
    found[found] &= own_pair[order[last[found]]] == at_pair[found]
    values = mine["value"].to_numpy(dtype=object, na_value=None)
    picked = np.full(len(rows), None, dtype=object)
    picked[found] = values[order[last[found]]]
    return pd.Series(picked, index=rows.index, dtype=object)
