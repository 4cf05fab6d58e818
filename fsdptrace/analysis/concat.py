"""The reduce's concatenation of the map step's summaries, names kept as category codes.

Checks 10 and 12 keep a row per rank, micro-step and unit, with unit, parameter and setting
names as categoricals: a few distinct texts, stored once, and a small integer per row. Each
batch numbers its own categories, and ``pd.concat`` of categoricals whose categories differ
falls back to object columns, one Python string per row: at thousands of ranks the reduce
would hold again the text the map step dropped. ``union_categoricals`` renumbers the codes
into one shared vocabulary instead.
"""

from __future__ import annotations

import pandas as pd
from pandas.api.types import union_categoricals


def concat_coded(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """``frames`` (of one summary, one per batch) as one frame with a fresh index; a column
    categorical in any of them is categorical in the result, over the union of categories."""
    non_empty = [f for f in frames if len(f)]
    if not non_empty:
        return frames[0] if frames else pd.DataFrame()
    if len(non_empty) == 1:
        return non_empty[0].reset_index(drop=True)
    columns = list(non_empty[0].columns)
    coded = [c for c in columns
             if any(isinstance(f[c].dtype, pd.CategoricalDtype) for f in non_empty)]
    out = pd.concat([f.drop(columns=coded) for f in non_empty], ignore_index=True)
    for column in coded:
        out[column] = union_categoricals(_same_kind([f[column] for f in non_empty]))
    return out[columns]


def _same_kind(columns: list[pd.Series]) -> list[pd.Series]:
    """``columns`` as categoricals whose categories share one dtype (``union_categoricals``
    refuses others): a batch whose column is all null holds no categories, of dtype object,
    where the others hold strings."""
    parts = [c.astype("category") for c in columns]
    if len({str(p.cat.categories.dtype) for p in parts}) > 1:
        parts = [p.astype(pd.CategoricalDtype(p.cat.categories.astype(object))) for p in parts]
    return parts
