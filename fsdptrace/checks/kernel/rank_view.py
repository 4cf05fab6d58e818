"""What the kernel's derived facts read of ``RankTables``: a Protocol, so they need not import it.

``RankTables`` computes its stop points (``checks.stops``) and complete positions
(``checks.positions``) on first use and keeps them; those modules in turn read the tables.
Typed against ``RankTables`` itself, each pair would be an import circle (the class needs the
functions, the functions name the class). They type against this view instead: the data
fields and the one derived fact (``stops``) they read, which ``RankTables`` satisfies.
"""

from __future__ import annotations

from typing import Protocol

import pandas as pd

from fsdptrace.checks.kernel.columns import Columns, Vocab


class RankView(Protocol):
    """One or more ranks' tables as code columns (``checks.tables.RankTables``)."""

    vocab: Vocab
    events: Columns
    closed: set[int]
    sizes: dict[str, int]
    incomplete: pd.DataFrame

    def frame(self, table: str) -> pd.DataFrame: ...

    @property
    def stops(self) -> pd.DataFrame: ...
