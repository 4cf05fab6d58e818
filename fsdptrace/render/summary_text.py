"""``fsdptrace summary`` as text: what was recorded, per rank, every value printable."""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

import pandas as pd

from fsdptrace.reading import unsharded
from fsdptrace.reading.allgathers import overview_line
from fsdptrace.reading.untrusted import printable
from fsdptrace.render.text import run_dir_label

if TYPE_CHECKING:
    from fsdptrace.views.summary import RunSummary

# Past this many ranks, summary prints the highest peaks only (JSON keeps every rank).
MAX_MEMORY_RANKS = 64


def render(run: RunSummary, out: TextIO) -> None:
    """The run in numbers, its dropped rows, then one row per rank (hosts come from the run
    dir, so every cell goes through ``printable``)."""
    numbers = dict(run.summary)
    out.write(f"run dir: {printable(run_dir_label(run))}\n")
    incomplete = numbers.pop("incomplete_steps")
    for key, value in numbers.items():
        out.write(f"{key.replace('_', ' ')}: {printable(value)}\n")
    assert isinstance(incomplete, dict)
    out.write("incomplete steps (rows dropped):" + ("" if incomplete else " none") + "\n")
    for rank, where in incomplete.items():
        out.write(f"  rank {rank}: {printable(where)}\n")
    out.write(f"all-gathers: {printable(overview_line(run.all_gathers))}\n")
    write_memory_lines(run.peaks, out, types=run.module_types)
    table = run.per_rank.copy()
    for name in table.columns:
        if not pd.api.types.is_numeric_dtype(table[name]):
            table[name] = table[name].astype(object).map(printable, na_action="ignore")
    out.write("\n" + table.to_string(index=False) + "\n")


def write_memory_lines(peaks: pd.DataFrame, out: TextIO, *, max_ranks: int = MAX_MEMORY_RANKS,
                       types: dict[str, str] | None = None) -> None:
    """Every rank's unsharded-parameter peak (parameter memory as FSDP holds it), one line
    each; past ``max_ranks``, the highest ones and how many are left out."""
    if not len(peaks):
        return
    worst = unsharded.worst_passes(peaks).sort_values(
        ["peak_bytes", "rank"], ascending=[False, True], kind="stable")
    ranks = [int(r) for r in worst["rank"]]
    shown = sorted(ranks if len(ranks) <= max_ranks else ranks[:max_ranks])
    out.write("unsharded parameters:\n")
    for rank in shown:
        out.write(f"  {printable(unsharded.summary_line(peaks, rank, types))}\n")
    if len(ranks) > len(shown):
        out.write(f"  ... {len(ranks) - len(shown)} more ranks with lower peaks "
                  "(all of them: --format json)\n")
