"""``fsdptrace.analyze``: run the checks over a run dir as map (per rank) and reduce.

The map step (``fsdptrace.analysis.map_step``) reads one rank with pyarrow into code columns
(``checks.tables.RankTables``, no pandas copy of the events), runs the per-rank checks and keeps
only small summaries (order signatures, where each rank stopped, how the recording ended). The
reduce step compares those across ranks and re-reads just the few diverging orders it must
spell out. Memory stays bounded by one rank's data plus the summaries, and the map fans out over
processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from fsdptrace.analysis import heap
from fsdptrace.analysis.map_step import (
    RankSummary,
    concat_field,
    concat_summaries,
    is_small,
    map_ranks,
    map_tables,
    rank_pieces,
    read_batches,
    with_causes,
)
from fsdptrace.analysis.result import Analysis
from fsdptrace.checks import (
    ACROSS_RANKS,
    CHECKS,
    REGISTRY,
    findings,
    per_rank_findings,
    resolve,
    selected,
    stalled_rank,
)
from fsdptrace.checks.contract import KEPT_FRAMES, Merged
from fsdptrace.checks.kernel.tables import RankTables
from fsdptrace.checks.stalled_rank import NAME as STALLED_RANK
from fsdptrace.reading import chunk_gaps, endings, flight_recorder, incomplete, reader
from fsdptrace.reading.trace import Trace, check_meta, read_frame, to_frame

# Collectives a Flight Recorder dump shows not completed, quoted per stalled rank.
MAX_NAMED_COLLECTIVES = 3


def reduce_summaries(summaries: list[RankSummary], names: Iterable[str],
                     fetch_orders: Callable[[list[int], pd.DataFrame], pd.DataFrame],
                     fetch_prefetch: Callable[[list[int]], pd.DataFrame]) -> pd.DataFrame:
    """The reduce step: the across-ranks checks, merged with the per-rank findings."""
    unit_sets = concat_field(summaries, "unit_sets")
    merged = Merged(**{name: concat_field(summaries, name, unit_sets) for name in KEPT_FRAMES},
                    ranks=sorted({r for s in summaries for r in s.ranks}),
                    summaries=concat_summaries(summaries, unit_sets),
                    fetch_orders=fetch_orders, fetch_prefetch=fetch_prefetch)
    found = {check.name: check.run_across_ranks(merged)
             for check in selected(with_causes(names) - {STALLED_RANK}, ACROSS_RANKS)}
    if STALLED_RANK in names:
        causes = [found[c.name] for c in REGISTRY if c.number in stalled_rank.CAUSE_CHECKS
                  and c.name in found]
        found[STALLED_RANK] = stalled_rank.check(replace(
            merged, divergences=findings.combine(causes)))
    return findings.combine([concat_field(summaries, "findings")]
                            + [found[c.name] for c in selected(set(names), ACROSS_RANKS)])


def analyze(source: str | os.PathLike[str] | Trace, checks: Iterable[str] | None = None, *,
            jobs: int | None = 1, scheduler: Any = None,
            progress: Callable[[int, int], None] | None = None) -> Analysis:
    """Run the checks of docs/checks.md over a run dir or a loaded ``Trace``.

    A run dir is read rank by rank in ``jobs`` processes (``None``: one per available core),
    or on the Dask cluster ``scheduler`` names (``tcp://HOST:PORT`` or a
    ``distributed.Client``). ``progress(done, total)`` is called as ranks finish. Returns an
    ``Analysis``: the findings, sorted by severity, step, rank, with the facts that frame them.
    """
    names = resolve(list(checks) if checks is not None else None)
    with heap.freed_memory_kept():
        if isinstance(source, Trace):
            return _analyze_trace(source, names)
        return _analyze_run_dir(Path(source), names, jobs, scheduler, progress)


def _analyze_run_dir(run_dir: Path, names: list[str], jobs: int | None, scheduler: Any,
                     progress: Callable[[int, int], None] | None) -> Analysis:
    """``analyze`` of a run dir: mapped here, in a process pool or on Dask, then reduced."""
    reader.check_run_dir(run_dir)
    ranks = reader.discover_ranks(run_dir)
    if scheduler is not None:
        from fsdptrace.analysis.distributed import map_distributed

        summaries = map_distributed(run_dir, ranks, names, scheduler, progress)
    else:
        small = is_small(run_dir, ranks)
        summaries = _map_ranks(run_dir, ranks, names, (1 if small else available_cores())
                               if jobs is None else jobs, progress, small=small)
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
    meta = concat_field(summaries, "meta")
    world_size = (int(meta["world_size"].max()) if len(meta) and "world_size" in meta
                  else len(ranks))
    lost = concat_field(summaries, "incomplete")
    return Analysis(findings=found, run_dir=run_dir, ranks=tuple(ranks), world_size=world_size,
                    endings=endings.rank_endings(concat_field(summaries, "ends"), ranks),
                    incomplete=_rank_by_rank(lost) if len(lost) else incomplete.empty(),
                    checks=tuple(names), source=source)


def _rank_by_rank(lost: pd.DataFrame) -> pd.DataFrame:
    """The rows of each rank together, in the order a batch of that one rank lists them: the
    same whatever ranks the map step's batches held (a batch lists them table by table)."""
    return lost.sort_values("rank", kind="stable").reset_index(drop=True)


def reduce_run_dir(run_dir: Path, summaries: list[RankSummary], names: list[str]
                   ) -> pd.DataFrame:
    """The reduce step for a run dir, re-reading only the tables of the ranks it must."""
    check_meta(concat_field(summaries, "meta"), run_dir)
    stops = concat_field(summaries, "last")

    def fetch_orders(needed: list[int], wanted: pd.DataFrame) -> pd.DataFrame:
        return orders_by_batch(run_dir, needed, wanted, stops)

    def fetch_prefetch(needed: list[int]) -> pd.DataFrame:
        return read_frame(run_dir, "prefetch", needed)

    found = reduce_summaries(summaries, names, fetch_orders, fetch_prefetch)
    return with_flight_recorder(run_dir, found)


def orders_by_batch(run_dir: Path, needed: list[int], wanted: pd.DataFrame,
                    stops: pd.DataFrame) -> pd.DataFrame:
    """The positioned complete orders ``wanted`` (``RankTables.orders``) of the ranks
    ``needed``, read a batch of ranks at a time, as the map step reads them.

    Each order asked for is one pass of a rank, but a rank's tables hold all its steps: the hang
    verdict asks for every other rank's pass, and reading those ranks at once held the whole
    run's events (and their positions) in memory, most of triage's peak at 10,240 ranks.

    ``stops``: the stop points the map step found (``RankTables.stops``, from every table).
    Which passes are cut off follows from them; computed again from the events and markers
    read here, a rank that stopped in an eval forward right after a pass looked stopped in
    that pass, and its order was dropped.
    """
    ranks = sorted(set(needed))
    tables = ("events", "markers")  # positions; how each rank ended and what it lost
    found = [_orders({t: reader.concat_ranks([a[t] for _, a in batch], t) for t in tables},
                     wanted, stops)
             for batch in read_batches(run_dir, ranks, tables,
                                       highest_rank=reader.highest_meta_rank(run_dir))]
    if not found:  # no rank: the empty frame of the right columns
        return _orders({t: reader.read_ranks(run_dir, t, []) for t in tables}, wanted, stops)
    return pd.concat([f for f in found if len(f)] or found[:1], ignore_index=True)


def _orders(arrow: dict[str, pa.Table], wanted: pd.DataFrame, stops: pd.DataFrame
            ) -> pd.DataFrame:
    tables = RankTables.from_arrow(arrow, lambda t: to_frame(arrow[t]))
    return tables.with_stops(stops).orders(wanted)


def with_flight_recorder(run_dir: Path, found: pd.DataFrame) -> pd.DataFrame:
    """stalled-rank's findings, each with the collectives torch's Flight Recorder saw its rank
    never complete, named by FSDP unit, phase and issuer (docs/checks.md v3, Collectives).

    The dumps are files beside the tables, read only when a rank stalled and saved one, so this
    joins them here, after the pure checks ran.
    """
    stalled = found["check"] == STALLED_RANK if len(found) else pd.Series([], dtype=bool)
    if not stalled.any():
        return found
    entries = flight_recorder.read_dumps(run_dir)
    if not len(entries):
        return found
    ranks = sorted({int(r) for r in entries["rank"]})
    named = flight_recorder.not_completed(entries, read_frame(run_dir, "collectives", ranks))
    if not len(named):
        return found
    per_rank = named.groupby("rank")["description"].agg(
        lambda d: "; Flight Recorder: " + "; ".join(d.head(MAX_NAMED_COLLECTIVES))
        + (f" (and {len(d) - MAX_NAMED_COLLECTIVES} more)" if len(d) > MAX_NAMED_COLLECTIVES
           else ""))
    extra = found["rank"].map(lambda r: per_rank.get(int(r), "") if pd.notna(r) else "")
    found = found.copy()
    found.loc[stalled, "message"] = found.loc[stalled, "message"] + extra[stalled]
    return found


def _analyze_trace(trace: Trace, names: list[str]) -> Analysis:
    tables = RankTables.from_trace(trace)
    summary = map_tables(tables, names, ranks=trace.ranks)
    found = reduce_summaries([summary], names, lambda _, wanted: tables.orders(wanted),
                             lambda _: trace.prefetch)
    return _result(found, [summary], names, run_dir=trace.run_dir, source=trace)


def _start_worker(string_storage: str) -> None:
    """A map worker: its parent warns of skipped chunks; it keeps freed memory for reuse, and
    its parent's pandas text storage (the command line's, ``fsdptrace_cli.strings``), which a
    worker started without fork (Python 3.14's default) would not have."""
    chunk_gaps.quiet()
    heap.keep_freed_memory()
    pd.set_option("mode.string_storage", string_storage)


def _map_ranks(run_dir: Path, ranks: list[int], names: list[str], jobs: int,
               progress: Callable[[int, int], None] | None, *, small: bool = False
               ) -> list[RankSummary]:
    """``small``: one piece, where one process maps it (pieces are for balance and progress)."""
    highest = reader.highest_meta_rank(run_dir)
    pieces = [ranks] if small and jobs <= 1 else rank_pieces(ranks, jobs)
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
    with ProcessPoolExecutor(max_workers=jobs, initializer=_start_worker,
                             initargs=(pd.get_option("mode.string_storage"),)) as pool:
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
           "incomplete_ranges", "map_ranks", "per_rank_findings", "reduce_run_dir",
           "reduce_summaries"]
