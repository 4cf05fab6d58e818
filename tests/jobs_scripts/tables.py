"""Read a recorded run dir back with plain pyarrow, the way any hive-aware reader would.

Tests use this instead of ``fsdptrace.load`` on purpose: the recorder's contract is the
on-disk layout (``TABLE/rank=N/part-*.parquet``, rank only in the path), not our loader.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.dataset as ds


def read_table(run_dir: Path, table: str) -> pd.DataFrame:
    """One table of all ranks, ``rank`` taken from the hive path; empty if never written."""
    path = run_dir / table
    if not path.exists():
        return pd.DataFrame()
    frame = ds.dataset(path, format="parquet", partitioning="hive").to_table().to_pandas()
    for column in frame.columns:
        if isinstance(frame[column].dtype, pd.CategoricalDtype):
            frame[column] = frame[column].astype(object)
    frame["rank"] = frame["rank"].astype(int)
    return frame.sort_values([c for c in ("rank", "seq") if c in frame]).reset_index(drop=True)


def read_folded(run_dir: Path, table: str, ranks: list[int] | None = None) -> pd.DataFrame:
    """One table with each rank's journal tail folded in, as ``fsdptrace.load`` reads it.

    A rank that died (SIGKILL, or SIGTERM's default action right after its marker) leaves its
    last rows in the journal only: plain Parquet readers see what was converted before.
    """
    from fsdptrace.reading import reader

    ranks = reader.discover_ranks(run_dir) if ranks is None else ranks
    frame = reader.read_ranks(run_dir, table, ranks).to_pandas()
    for column in frame.columns:
        if isinstance(frame[column].dtype, pd.CategoricalDtype):
            frame[column] = frame[column].astype(object)
    return frame


def orders(run_dir: Path) -> dict[tuple[int, int, int, str], list[str]]:
    """Units in the order they began each (rank, step, micro_step, phase)."""
    events = read_table(run_dir, "events")
    return {
        (int(rank), int(step), int(micro), str(phase)): list(group["unit"])
        for (rank, step, micro, phase), group in events.groupby(
            ["rank", "step", "micro_step", "phase"], sort=True
        )
    }


def marker_kinds(run_dir: Path, rank: int) -> list[str]:
    markers = read_table(run_dir, "markers")
    return list(markers.loc[markers["rank"] == rank, "kind"])


def rows_of(frame: pd.DataFrame, *columns: str) -> set[tuple]:
    """The distinct value tuples of ``columns``: compare a table with a set literal."""
    return set(frame[list(columns)].itertuples(index=False, name=None))
