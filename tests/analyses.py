"""An ``Analysis`` around findings made by hand, for tests of the renderers alone."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fsdptrace.analysis.result import Analysis
from fsdptrace.checks import CHECKS
from fsdptrace.reading import endings, incomplete


def analysis_of(findings: pd.DataFrame, *, num_ranks: int = 2, world_size: int | None = None,
                run_dir: str = "r", lost: pd.DataFrame | None = None) -> Analysis:
    """``findings`` as if a run dir ``run_dir`` of ``num_ranks`` clean ranks produced them."""
    ranks = list(range(num_ranks))
    return Analysis(findings=findings, run_dir=Path(run_dir), ranks=tuple(ranks),
                    world_size=num_ranks if world_size is None else world_size,
                    endings=endings.rank_endings(pd.DataFrame(), ranks),
                    incomplete=incomplete.empty() if lost is None else lost,
                    checks=tuple(CHECKS))
