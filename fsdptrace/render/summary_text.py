"""``fsdptrace summary`` as text: what was recorded, per rank, every value printable."""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

import pandas as pd

from fsdptrace import unsharded
from fsdptrace.allgather_summary import overview_line
from fsdptrace.render.text import run_dir_label
from fsdptrace.render.untrusted import printable
from fsdptrace.summary import per_rank

if TYPE_CHECKING:
    from fsdptrace.result import Analysis


def render(analysis: Analysis, out: TextIO) -> None:
    """The run in numbers, its dropped rows, then one row per rank (hosts come from the run
    dir, so every cell goes through ``printable``)."""
    trace = analysis.trace
    numbers = dict(analysis.summary)
    out.write(f"run dir: {printable(run_dir_label(analysis))}\n")
    incomplete = numbers.pop("incomplete_steps")
    for key, value in numbers.items():
        out.write(f"{key.replace('_', ' ')}: {printable(value)}\n")
    assert isinstance(incomplete, dict)
    out.write("incomplete steps (rows dropped):" + ("" if incomplete else " none") + "\n")
    for rank, where in incomplete.items():
        out.write(f"  rank {rank}: {printable(where)}\n")
    out.write(f"all-gathers: {printable(overview_line(trace.allgathers))}\n")
    peaks = unsharded.peaks(trace.allgathers)
    if len(peaks):  # the rank that holds most: parameter memory as FSDP holds it
        top = int(peaks.loc[peaks["peak_bytes"].idxmax(), "rank"])
        out.write(f"unsharded parameters: {printable(unsharded.summary_line(peaks, top))}\n")
    table = per_rank(trace)
    for name in table.columns:
        if not pd.api.types.is_numeric_dtype(table[name]):
            table[name] = table[name].astype(object).map(printable, na_action="ignore")
    out.write("\n" + table.to_string(index=False) + "\n")
