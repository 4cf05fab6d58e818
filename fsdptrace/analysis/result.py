"""``Analysis``: what ``fsdptrace.analyze`` returns, and the one thing every output renders.

The findings alone do not make a report: a verdict must say how many ranks were checked of
how many, how each rank ended, which micro-steps a rank lost rows from (and so were not
checked). Commands, notebooks and renderers used to re-read the run dir for those facts, each
its own way; now the analysis carries them, computed once, in the map step that already read
every rank. What only some outputs need (the loaded tables, the run in numbers) is loaded on
first use and kept.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from fsdptrace.checks.findings import ERROR, WARNING

if TYPE_CHECKING:
    from fsdptrace.reading.trace import Trace

# ``--fail-on``: the severities that make an analysis fail.
FAIL_ON: dict[str, tuple[str, ...]] = {"error": (ERROR,), "warning": (ERROR, WARNING),
                                       "never": ()}
CLEAN, WARNINGS, ERRORS = "clean", "warnings", "errors"
VERDICTS = (CLEAN, WARNINGS, ERRORS)
# The run in numbers (``summary``) reads every table of every rank: only this many ranks
# are summarized where a caller asks for it in passing (``--format json``).
SUMMARY_MAX_RANKS = 64


@dataclass(frozen=True, eq=False)
class Analysis:
    """The result of checking one run: findings plus the facts that frame them.

    - ``findings``: one row per finding (``fsdptrace.checks.findings.COLUMNS``), sorted by
      severity, step, rank;
    - ``run_dir``: where the run was read from (``None`` for a trace built in memory);
    - ``ranks``: the ranks with data; ``world_size``: how many the job had;
    - ``endings``: per rank, how its recording ended (``fsdptrace.reading.endings.COLUMNS``);
    - ``incomplete``: where a rank's writer dropped rows or a chunk was unreadable, the
      micro-steps no check looked at (``fsdptrace.reading.incomplete.COLUMNS``);
    - ``checks``: the checks that ran, in contract order.
    """

    findings: pd.DataFrame
    run_dir: Path | None
    ranks: tuple[int, ...]
    world_size: int
    endings: pd.DataFrame
    incomplete: pd.DataFrame
    checks: tuple[str, ...]
    source: Trace | None = field(default=None, repr=False)

    @property
    def verdict(self) -> str:
        """``errors`` when any finding is an error, else ``warnings`` if any, else ``clean``."""
        severities = set(self.findings["severity"].dropna().astype(str))
        return ERRORS if ERROR in severities else WARNINGS if WARNING in severities else CLEAN

    def fails(self, fail_on: str = "error") -> bool:
        """Whether a finding of ``fail_on``'s severity or worse exists (``FAIL_ON``)."""
        if fail_on not in FAIL_ON:
            from fsdptrace.errors import UsageError

            raise UsageError(f"unknown --fail-on {fail_on!r}; one of {', '.join(FAIL_ON)}")
        return bool(self.findings["severity"].isin(FAIL_ON[fail_on]).any())

    def count(self, severity: str) -> int:
        """How many findings have ``severity`` (``error`` or ``warning``)."""
        return int((self.findings["severity"] == severity).sum())

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks of the job with no data at all in the run dir."""
        return sorted(set(range(self.world_size)) - set(self.ranks))

    @cached_property
    def trace(self) -> Trace:
        """Every table as DataFrames: the trace analyzed, or the run dir loaded on first use.

        For the outputs that draw the run (report, Chrome trace, summary); a large run dir
        costs its whole size in memory here, which the findings alone never do.
        """
        if self.source is not None:
            return self.source
        from fsdptrace.reading.trace import load

        assert self.run_dir is not None
        return load(self.run_dir)

    @property
    def trace_in_memory(self) -> Trace | None:
        """The trace if it is in memory already (analyzed, or ``trace`` read): an output that
        can read the run dir a rank at a time draws this instead when there is one."""
        return self.source if self.source is not None else self.__dict__.get("trace")

    def __repr__(self) -> str:
        where = self.run_dir if self.run_dir is not None else "a trace in memory"
        return (f"<fsdptrace.Analysis {where}: {self.verdict}, {self.count(ERROR)} error(s), "
                f"{self.count(WARNING)} warning(s) across {len(self.ranks)} of "
                f"{self.world_size} ranks>")

    def _repr_html_(self) -> str:
        from fsdptrace.reading.untrusted import printable

        head = html.escape(printable(repr(self)))
        shown = self.findings[["severity", "check", "rank", "step", "micro_step", "unit",
                               "message"]]
        return f"<p><b>{head}</b></p>" + shown.head(50).to_html(index=False)


__all__ = ["CLEAN", "ERRORS", "FAIL_ON", "VERDICTS", "WARNINGS", "Analysis"]
