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
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from fsdptrace import chunk_gaps, endings, last_step, reader
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
from fsdptrace.checks.stalled_rank import NAME as STALLED_RANK
from fsdptrace.checks.tables import RankTables
from fsdptrace.result import Analysis
from fsdptrace.trace import TABLE_NAMES, Trace, check_meta, read_frame, to_frame

# A map-step batch grows until it holds this many rows or ranks (``map_ranks``): big enough
# that the checks' fixed cost per call is shared by many small ranks, small enough that memory
# stays bounded (a deep rank is a batch of its own).
BATCH_ROWS = 1_000_000
BATCH_RANKS = 256
# Checks that read only each rank's ending and last pass: when they are all that is asked
# (hang triage), the map step reads meta, markers and the last step's events, not history.
ENDING_CHECKS = frozenset({STALLED_RANK})
# Markers last: probing a rank's chunks for damage skips those already read whole.
_READ_ORDER = tuple(t for t in TABLE_NAMES if t != "markers") + ("markers",)


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
    """The map step for one rank of a run dir (``map_ranks`` of one rank)."""
    return map_ranks(run_dir, [rank], names)[0]


def map_ranks(run_dir: Path, ranks: list[int], names: list[str], *,
              highest_rank: int | None = None) -> list[RankSummary]:
    """The map step for some ranks of a run dir (what each process or Dask worker runs).

    Ranks are read one by one with pyarrow, into batches of at most ``BATCH_ROWS`` rows or
    ``BATCH_RANKS`` ranks, and the checks run once per batch on its code columns (no pandas
    copy of the events): a check's fixed cost is milliseconds of pandas whatever its rows,
    and a 10,000-rank run would pay it per rank. One summary per batch.
    """
    highest = reader.highest_meta_rank(run_dir) if highest_rank is None else highest_rank
    triage = set(names) <= ENDING_CHECKS
    summaries: list[RankSummary] = []
    batch: list[tuple[int, dict[str, pa.Table]]] = []
    rows = 0
    skipped_before = len(chunk_gaps.noted())
    for rank in ranks:
        arrow = (_read_ending(run_dir, rank, highest) if triage
                 else {t: reader.read_rank(run_dir, t, rank, highest_rank=highest)
                       for t in _READ_ORDER})
        batch.append((rank, arrow))
        rows += sum(table.num_rows for table in arrow.values())
        if rows >= BATCH_ROWS or len(batch) >= BATCH_RANKS or rank == ranks[-1]:
            summaries.append(_map_batch(run_dir, batch, names, triage=triage))
            summaries[-1].skipped = chunk_gaps.noted()[skipped_before:]
            skipped_before += len(summaries[-1].skipped)
            batch, rows = [], 0
    return summaries


def _read_ending(run_dir: Path, rank: int, highest: int) -> dict[str, pa.Table]:
    """What the ending checks read of a rank: meta, markers and the last step's events."""
    # No probe of other tables' chunks for damage: a gap's rows are no ending.
    arrow = {t: reader.read_rank(run_dir, t, rank, highest_rank=highest, gaps=False)
             for t in ("meta", "markers")}
    arrow["events"] = last_step.read_last_step(run_dir, rank)
    if not any(table.num_rows for table in arrow.values()):  # present through units alone?
        arrow["units"] = reader.read_rank(run_dir, "units", rank, highest_rank=highest)
    return arrow


def _map_batch(run_dir: Path, batch: list[tuple[int, dict[str, pa.Table]]],
               names: list[str], *, triage: bool) -> RankSummary:
    read = {t for _, arrow in batch for t in arrow}
    arrow = {t: reader.concat_ranks([a[t] for _, a in batch if t in a], t) for t in read}
    tables = RankTables.from_arrow(arrow, lambda t: to_frame(arrow[t]))
    check_meta(tables.frame("meta"), run_dir)
    present = [rank for rank, a in batch
               if any(a[t].num_rows for t in ("meta", "units", "events", "markers") if t in a)]
    if triage:
        return _map_endings(tables, ranks=present)
    return map_tables(tables, names, ranks=present)


def _map_endings(tables: RankTables, *, ranks: list[int]) -> RankSummary:
    """``map_tables`` for the ending checks: the summaries they read, the rest left empty."""
    empty = pd.DataFrame()
    return RankSummary(findings=findings.empty(), signatures=empty, config_signatures=empty,
                       unit_sets=empty, last=positions.last_positions(tables.events),
                       ends=endings.ending_markers(tables.frame("markers")),
                       meta=tables.frame("meta"), ranks=ranks, incomplete=tables.incomplete)


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


def rank_pieces(ranks: list[int], workers: int) -> list[list[int]]:
    """``ranks`` cut into pieces of work for ``map_ranks``: a few per worker for balance and
    for progress that moves, each at most one batch."""
    size = max(1, min(BATCH_RANKS, -(-len(ranks) // (max(workers, 1) * 4))))
    return [ranks[i:i + size] for i in range(0, len(ranks), size)]


def _map_ranks(run_dir: Path, ranks: list[int], names: list[str], jobs: int,
               progress: Callable[[int, int], None] | None) -> list[RankSummary]:
    highest = reader.highest_meta_rank(run_dir)
    pieces = rank_pieces(ranks, jobs)
    summaries: list[RankSummary] = []
    done = 0
    if jobs <= 1 or len(pieces) <= 1:
        for piece in pieces:
            summaries += map_ranks(run_dir, piece, names, highest_rank=highest)
            done += len(piece)
            if progress:
                progress(done, len(ranks))
        return summaries
    by_piece: dict[int, list[RankSummary]] = {}
    with ProcessPoolExecutor(max_workers=jobs, initializer=chunk_gaps.quiet) as pool:
        futures = {pool.submit(map_ranks, run_dir, piece, names, highest_rank=highest): i
                   for i, piece in enumerate(pieces)}
        for future in as_completed(futures):  # progress as pieces finish, in any order
            by_piece[futures[future]] = future.result()
            done += len(pieces[futures[future]])
            if progress:
                progress(done, len(ranks))
    for i in range(len(pieces)):
        for summary in by_piece[i]:
            for chunk in summary.skipped:
                chunk_gaps.note(chunk)
            summaries.append(summary)
    return summaries


__all__ = ["CHECKS", "Analysis", "RankSummary", "analyze", "available_cores",
           "incomplete_ranges", "map_rank", "map_ranks", "map_trace", "per_rank_findings",
           "reduce_run_dir", "reduce_summaries"]
