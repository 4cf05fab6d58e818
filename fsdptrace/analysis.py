"""``fsdptrace.analyze``: run the checks over a run dir as map (per rank) and reduce.

The map step reads one rank with pyarrow into code columns (``checks.tables.RankTables``, no
pandas copy of the events), runs the per-rank checks and keeps only small summaries (order
signatures, the last unit entered, how the recording ended). The reduce step compares those
across ranks and re-reads just the few diverging orders it must spell out. Memory stays
bounded by one rank's data plus the summaries, and the map fans out over processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from fsdptrace import chunk_gaps, endings, reader
from fsdptrace.checks import (
    ACROSS_RANKS,
    CHECKS,
    PER_RANK,
    findings,
    incomplete,
    positions,
    prefetch_config_divergence,
    resolve,
    selected,
)
from fsdptrace.checks.contract import Merged
from fsdptrace.checks.order import unit_sets
from fsdptrace.checks.tables import RankTables
from fsdptrace.result import Analysis
from fsdptrace.trace import TABLE_NAMES, Trace, check_meta, read_frame, to_frame


@dataclass
class RankSummary:
    """What the map step keeps of one rank (or of a whole in-memory trace)."""

    findings: pd.DataFrame
    signatures: pd.DataFrame
    config_signatures: pd.DataFrame
    unit_sets: pd.DataFrame
    last: pd.DataFrame
    ends: pd.DataFrame
    meta: pd.DataFrame
    ranks: list[int]
    # Chunks this rank's read skipped as unreadable: a worker process hands them to its parent,
    # which warns once for each.
    skipped: list[chunk_gaps.SkippedChunk] = field(default_factory=list)
    # What each across-ranks check with a ``summarize`` keeps of this rank, by check name.
    summaries: dict[str, pd.DataFrame] = field(default_factory=dict)
    # Where this rank lost rows (``checks.incomplete.COLUMNS``): what no check looked at.
    incomplete: pd.DataFrame = field(default_factory=incomplete.empty)


def per_rank_findings(source: Trace | RankTables, names: Iterable[str]) -> pd.DataFrame:
    """The per-rank checks named, on the tables of one or more ranks (also the live path)."""
    tables = source if isinstance(source, RankTables) else RankTables.from_trace(source)
    return findings.combine(check.run_per_rank(tables)
                            for check in selected(set(names), PER_RANK))


def map_trace(trace: Trace, names: Iterable[str]) -> RankSummary:
    """The map step: per-rank findings plus the summaries the reduce step compares."""
    return map_tables(RankTables.from_trace(trace), names, ranks=trace.ranks)


def map_tables(tables: RankTables, names: Iterable[str], *, ranks: list[int]) -> RankSummary:
    """``map_trace`` on code columns (a run dir's rank is read straight from Arrow)."""
    return RankSummary(
        findings=per_rank_findings(tables, names),
        signatures=tables.signatures,  # shared with check 7
        config_signatures=prefetch_config_divergence.config_signatures(tables),
        unit_sets=unit_sets(tables.frame("units")),
        last=positions.last_positions(tables.events),
        ends=endings.ending_markers(tables.frame("markers")),
        meta=tables.frame("meta"),
        ranks=ranks,
        summaries={check.name: check.summarize(tables)
                   for check in selected(set(names), ACROSS_RANKS) if check.summarize},
        incomplete=tables.incomplete,
    )


def reduce_summaries(summaries: list[RankSummary], names: Iterable[str],
                     fetch_orders: Callable[[list[int], pd.DataFrame], pd.DataFrame],
                     fetch_prefetch: Callable[[list[int]], pd.DataFrame]) -> pd.DataFrame:
    """The reduce step: the across-ranks checks, merged with the per-rank findings."""
    cat = _concat_field
    merged = Merged(signatures=cat(summaries, "signatures"),
                    config_signatures=cat(summaries, "config_signatures"),
                    unit_sets=cat(summaries, "unit_sets"), last=cat(summaries, "last"),
                    ends=cat(summaries, "ends"), meta=cat(summaries, "meta"),
                    ranks=sorted({r for s in summaries for r in s.ranks}),
                    fetch_orders=fetch_orders, fetch_prefetch=fetch_prefetch,
                    summaries=_concat_summaries(summaries))
    return findings.combine([cat(summaries, "findings")]
                            + [check.run_across_ranks(merged)
                               for check in selected(set(names), ACROSS_RANKS)])


def _concat_field(summaries: list[RankSummary], name: str) -> pd.DataFrame:
    frames = [getattr(s, name) for s in summaries]
    non_empty = [f for f in frames if len(f)]
    if not non_empty:
        return frames[0] if frames else pd.DataFrame()
    return pd.concat(non_empty, ignore_index=True)


def _concat_summaries(summaries: list[RankSummary]) -> dict[str, pd.DataFrame]:
    names = {name for s in summaries for name in s.summaries}
    out = {}
    for name in names:
        frames = [s.summaries[name] for s in summaries if name in s.summaries]
        non_empty = [f for f in frames if len(f)]
        out[name] = pd.concat(non_empty, ignore_index=True) if non_empty else frames[0]
    return out


def map_rank(run_dir: Path, rank: int, names: list[str]) -> RankSummary:
    """The map step for one rank of a run dir (what each process or Dask worker runs).

    Reads Arrow tables and hands their columns to the checks: no pandas copy of the events.
    """
    skipped_before = len(chunk_gaps.noted())
    arrow = {t: reader.read_rank(run_dir, t, rank) for t in TABLE_NAMES}
    tables = RankTables.from_arrow(arrow, lambda t: to_frame(arrow[t]))
    check_meta(tables.frame("meta"), run_dir)
    present = any(arrow[t].num_rows for t in ("meta", "units", "events", "markers"))
    summary = map_tables(tables, names, ranks=[rank] if present else [])
    summary.skipped = chunk_gaps.noted()[skipped_before:]
    return summary


def analyze(source: str | os.PathLike[str] | Trace, checks: Iterable[str] | None = None, *,
            jobs: int | None = 1, scheduler: Any = None,
            progress: Callable[[int, int], None] | None = None) -> Analysis:
    """Run the checks of CHECKS.md over a run dir or a loaded ``Trace``.

    A run dir is read rank by rank in ``jobs`` processes (``None``: one per available core),
    or on the Dask cluster ``scheduler`` names (``tcp://HOST:PORT`` or a
    ``distributed.Client``). ``progress(done, total)`` is called as ranks finish. Returns an
    ``Analysis``: the findings, sorted by severity, step, rank, with the facts that frame them.
    """
    names = resolve(list(checks) if checks is not None else None)
    if isinstance(source, Trace):
        return _analyze_trace(source, names)
    run_dir = Path(source)
    reader.check_run_dir(run_dir)
    ranks = reader.discover_ranks(run_dir)
    if scheduler is not None:
        from fsdptrace.distributed import map_distributed

        summaries = map_distributed(run_dir, ranks, names, scheduler, progress)
    else:
        summaries = _map_ranks(run_dir, ranks, names, available_cores() if jobs is None
                               else jobs, progress)
    return _result(reduce_run_dir(run_dir, summaries, names), summaries, names,
                   run_dir=run_dir)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), for the default ``jobs``."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def incomplete_ranges(source: str | os.PathLike[str] | Trace) -> pd.DataFrame:
    """Where each rank's writer dropped rows: the micro-steps ``analyze`` did not check.

    One row per contiguous run (``checks.incomplete.COLUMNS``: rank, table, first/last step
    and micro-step, num_rows); empty for a run without drops. A run dir is read for its
    markers only. (``analyze(...).incomplete`` holds the same, from the analysis's own read.)
    """
    if isinstance(source, Trace):
        return incomplete.parse(source.markers)
    run_dir = Path(source)
    reader.check_run_dir(run_dir)
    ranks = reader.discover_ranks(run_dir)
    return incomplete.from_arrow(reader.read_ranks(run_dir, "markers", ranks))


def _result(found: pd.DataFrame, summaries: list[RankSummary], names: list[str], *,
            run_dir: Path | None, source: Trace | None = None) -> Analysis:
    """The ``Analysis`` of a reduced run: findings plus what the map step learned on the way."""
    ranks = sorted({r for s in summaries for r in s.ranks})
    meta = _concat_field(summaries, "meta")
    world_size = (int(meta["world_size"].max()) if len(meta) and "world_size" in meta
                  else len(ranks))
    lost = _concat_field(summaries, "incomplete")
    return Analysis(findings=found, run_dir=run_dir, ranks=tuple(ranks), world_size=world_size,
                    endings=endings.rank_endings(_concat_field(summaries, "ends"), ranks),
                    incomplete=lost if len(lost) else incomplete.empty(),
                    checks=tuple(names), source=source)


def reduce_run_dir(run_dir: Path, summaries: list[RankSummary], names: list[str]
                   ) -> pd.DataFrame:
    """The reduce step for a run dir, re-reading only the tables of the ranks it must."""
    check_meta(_concat_field(summaries, "meta"), run_dir)

    def fetch_orders(needed: list[int], wanted: pd.DataFrame) -> pd.DataFrame:
        arrow = {t: reader.read_ranks(run_dir, t, needed) for t in ("events", "markers")}
        return RankTables.from_arrow(arrow, lambda t: to_frame(arrow[t])).orders(wanted)

    def fetch_prefetch(needed: list[int]) -> pd.DataFrame:
        return read_frame(run_dir, "prefetch", needed)

    return reduce_summaries(summaries, names, fetch_orders, fetch_prefetch)


def _analyze_trace(trace: Trace, names: list[str]) -> Analysis:
    tables = RankTables.from_trace(trace)
    summary = map_tables(tables, names, ranks=trace.ranks)
    found = reduce_summaries([summary], names, lambda _, wanted: tables.orders(wanted),
                             lambda _: trace.prefetch)
    return _result(found, [summary], names, run_dir=trace.run_dir, source=trace)


def _map_ranks(run_dir: Path, ranks: list[int], names: list[str], jobs: int,
               progress: Callable[[int, int], None] | None) -> list[RankSummary]:
    summaries: list[RankSummary] = []
    if jobs <= 1 or len(ranks) <= 1:
        for rank in ranks:
            summaries.append(map_rank(run_dir, rank, names))
            if progress:
                progress(len(summaries), len(ranks))
        return summaries
    with ProcessPoolExecutor(max_workers=jobs, initializer=chunk_gaps.quiet) as pool:
        for summary in pool.map(map_rank, [run_dir] * len(ranks), ranks, [names] * len(ranks),
                                chunksize=max(1, len(ranks) // (jobs * 8))):
            for chunk in summary.skipped:
                chunk_gaps.note(chunk)
            summaries.append(summary)
            if progress:
                progress(len(summaries), len(ranks))
    return summaries


__all__ = ["CHECKS", "Analysis", "RankSummary", "analyze", "available_cores",
           "incomplete_ranges", "map_rank", "map_trace", "per_rank_findings", "reduce_run_dir",
           "reduce_summaries"]
