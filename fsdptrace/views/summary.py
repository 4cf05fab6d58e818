"""What a run dir holds, per rank: the answer to "what did I record?"."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import reduce
from pathlib import Path

import pandas as pd

from fsdptrace.reading import allgathers, endings, incomplete, reader, unsharded
from fsdptrace.reading.trace import (
    Trace,
    ranks_with_rows,
    read_rank_by_rank,
    world_size_of,
)
from fsdptrace.reading.unit_names import module_types
from fsdptrace.store import schema
from fsdptrace.store.key_ranges import MAX_STEP
from fsdptrace.views.rank_ranges import rank_ranges


@dataclass(frozen=True, eq=False)
class RunSummary:
    """What ``fsdptrace summary`` renders: the run in numbers, one row per rank, each rank's
    unsharded-parameter peaks, the all-gathers in a few numbers, the units' module types.

    Counted a rank at a time (``summarize_run_dir``): loading the run for it held every table
    of every rank at once, 9.3 GB on a 64-rank run of 10M events. Not an ``Analysis``: that
    ran the analyzer's map step for nothing the summary prints.
    """

    run_dir: Path | None
    summary: dict[str, object]  # ``overview``
    per_rank: pd.DataFrame  # ``per_rank``
    peaks: pd.DataFrame  # ``unsharded.peaks`` of every rank
    all_gathers: dict[str, int]  # ``allgathers.overview`` of every rank
    module_types: dict[str, str]  # ``unit_names.module_types`` of every rank's units


def summarize(trace: Trace) -> RunSummary:
    """``trace`` ready for the summary renderers (``fsdptrace.render.formats.SUMMARY_FORMATS``)."""
    return _summary(trace.run_dir, [trace], meta=trace.meta, units=trace.units,
                    markers=trace.markers)


def summarize_run_dir(run_dir: Path) -> RunSummary:
    """``summarize(load(run_dir))``, holding one rank's events and all-gathers at a time (and
    every rank's meta, units and markers)."""
    run = read_rank_by_rank(run_dir, ("meta", "units", "markers"))
    return _summary(run_dir, run.traces(("events", "allgathers")), **run.whole)


def _summary(run_dir: Path | None, batches: Iterable[Trace], *, meta: pd.DataFrame,
             units: pd.DataFrame, markers: pd.DataFrame) -> RunSummary:
    """The summary of traces that each hold some ranks whole (at least one trace, every rank
    in one of them), and of the meta, units and markers of all of them."""
    tables, peaks, gathers, figures = [], [], [], EventFigures()
    for trace in batches:
        found = unsharded.peaks(trace.allgathers)
        tables.append(per_rank(trace, peaks=found))
        peaks.append(found)
        gathers.append(allgathers.overview(trace.allgathers))
        figures += event_figures(trace.events, count_micro_steps=False)
    table = pd.concat([t for t in tables if len(t)] or tables[:1], ignore_index=True)
    micro = table["micro_steps"]  # per_rank counted them
    figures = replace(figures, micro_steps=int(micro.max()) if micro.notna().any() else 0)
    return RunSummary(
        run_dir, _numbers(figures, meta=meta, units=units, markers=markers), table,
        pd.concat([p for p in peaks if len(p)] or peaks[:1], ignore_index=True),
        allgathers.combined(gathers), module_types(units))


def per_rank(trace: Trace, *, peaks: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per rank: steps, micro-steps, events, time span, and how recording ended.
    ``peaks``: ``unsharded.peaks(trace.allgathers)``, where the caller prints them too."""
    ranks = pd.DataFrame({"rank": pd.Series(trace.ranks, dtype="int64")})
    ev = trace.events.assign(rank=trace.events["rank"].astype("int64"))
    stats = ev.groupby("rank").agg(
        steps=("step", "nunique"),
        first_step=("step", "min"),
        last_step=("step", "max"),
        events=("seq", "size"),
        first_ns=("t_ns", "min"),
        last_ns=("t_ns", "max"),
    )
    micro = ev[["rank", "step", "micro_step"]].drop_duplicates().groupby("rank").size()
    stats["micro_steps"] = micro
    stats["span_s"] = (stats["last_ns"] - stats["first_ns"]) / 1e9
    out = ranks.merge(stats.drop(columns=["first_ns", "last_ns"]).reset_index(), on="rank",
                      how="left")
    endings = _endings(trace.markers, trace.ranks)
    out["ended"] = [endings.get(int(r), "no close (stalled or running)") for r in out["rank"]]
    meta = trace.meta.assign(rank=trace.meta["rank"].astype("int64"))
    meta = meta.drop_duplicates("rank", keep="last")[["rank", "host", "pid", "backend",
                                                      "fsdptrace_version"]]
    out = out.merge(meta, on="rank", how="left")
    peaks = unsharded.peaks(trace.allgathers) if peaks is None else peaks
    return out.merge(_unsharded_peaks(peaks), on="rank", how="left")


def _unsharded_peaks(peaks: pd.DataFrame) -> pd.DataFrame:
    """Per rank, its highest pass of unsharded parameter bytes and that pass's floor."""
    top = unsharded.worst_passes(peaks)
    return pd.DataFrame({"rank": top["rank"].astype("int64"),
                         "peak_unsharded_bytes": top["peak_bytes"].astype("Int64"),
                         "unsharded_floor_bytes": top["floor_bytes"].astype("Int64")})


def _endings(markers: pd.DataFrame, ranks: Iterable[int]) -> dict[int, str]:
    """Per rank, how its recording ended, as ``per_rank``'s ``ended`` column says it."""
    found = endings.rank_endings(markers, ranks)
    text = found["ending"].astype(str).where(found["ending"] != endings.CLEAN, "clean close")
    detail = found["detail"].astype(str)
    text = text.where(detail == "", text + " (" + detail.str.slice(0, 120) + ")")
    return dict(zip(found["rank"].astype(int), text, strict=True))


@dataclass(frozen=True)
class EventFigures:
    """What the run in numbers says of the events, counted a batch of whole ranks at a time
    and added up: ``analyze --format json`` never holds a run's events at once for them
    (``overview_of_run_dir``; loading the run cost 5 GB on a 64-rank run of 10M events)."""

    num_events: int = 0
    steps: frozenset[int] = frozenset()
    micro_steps: int = 0  # the most (step, micro_step) pairs one rank recorded
    first_ns: int | None = None
    last_ns: int | None = None
    ranks: frozenset[int] = frozenset()  # those with events

    def __add__(self, other: EventFigures) -> EventFigures:
        times = [t for t in (self.first_ns, self.last_ns, other.first_ns, other.last_ns)
                 if t is not None]
        return EventFigures(self.num_events + other.num_events, self.steps | other.steps,
                            max(self.micro_steps, other.micro_steps),
                            min(times, default=None), max(times, default=None),
                            self.ranks | other.ranks)


def event_figures(events: pd.DataFrame, *, count_micro_steps: bool = True) -> EventFigures:
    """``EventFigures`` of ``events`` (``rank``, ``step``, ``micro_step``, ``t_ns``), which
    holds each of its ranks whole. ``count_micro_steps=False``: the caller has them."""
    if not len(events):
        return EventFigures()
    micro_steps = 0
    if count_micro_steps:
        pairs = events[["rank", "step", "micro_step"]].drop_duplicates()
        micro_steps = int(pairs.groupby(pairs["rank"].astype("int64")).size().max())
    return EventFigures(len(events), frozenset(int(s) for s in events["step"].unique()),
                        micro_steps, int(events["t_ns"].min()), int(events["t_ns"].max()),
                        frozenset(int(r) for r in events["rank"].unique()))


def overview(trace: Trace) -> dict[str, object]:
    """The run in numbers (JSON-friendly)."""
    return _numbers(event_figures(trace.events), meta=trace.meta, units=trace.units,
                    markers=trace.markers)


def overview_of_run_dir(run_dir: Path) -> dict[str, object]:
    """``overview`` of the run dir's ``load``, reading its events one rank at a time: what it
    holds at once is one rank's events and every rank's meta, units and markers."""
    run = read_rank_by_rank(run_dir, ("meta", "units", "markers"))
    highest = reader.highest_meta_rank(run_dir)
    figures = reduce(EventFigures.__add__, (event_figures(_event_columns(
        run_dir, rank, highest)) for rank in run.ranks), EventFigures())
    return _numbers(figures, **run.whole)


def _event_columns(run_dir: Path, rank: int, highest: int | None) -> pd.DataFrame:
    """The columns ``event_figures`` counts of one rank's events."""
    table = reader.read_rank(run_dir, "events", rank, highest_rank=highest)
    return table.select(["rank", "step", "micro_step", "t_ns"]).to_pandas()


def _numbers(events: EventFigures, *, meta: pd.DataFrame, units: pd.DataFrame,
             markers: pd.DataFrame) -> dict[str, object]:
    """The run in numbers, from its events' figures and every rank's meta, units and markers
    (the ranks and world size as ``Trace`` has them)."""
    ranks = sorted(set(ranks_with_rows(meta, units, markers)) | events.ranks)
    world_size = world_size_of(meta, ranks)
    span = 0.0
    if events.first_ns is not None and events.last_ns is not None:
        span = (events.last_ns - events.first_ns) / 1e9
    lost = incomplete.parse(markers)
    return {
        "ranks": len(ranks),
        "world_size": world_size,
        "missing_ranks": sorted(set(range(world_size)) - set(ranks)),
        "steps": len(events.steps),
        "micro_steps": events.micro_steps,
        "units": int(units["unit"].nunique()) if len(units) else 0,
        "events": events.num_events,
        "time_span_s": round(span, 3),
        "clean_close": sum(e == "clean close" for e in _endings(markers, ranks).values()),
        **losses(markers, lost),
        "incomplete_steps": {str(row.rank): f"{row.steps} ({row.tables})"
                             for row in incomplete_per_rank(lost).itertuples()},
    }


def losses(markers: pd.DataFrame, ranges: pd.DataFrame) -> dict[str, object]:
    """Every kind of loss, counted: rows a schema-1 writer dropped or a writer could not get
    into the run dir (``dropped_rows``), chunks and journal segments the reader skipped as
    unreadable, ranks whose recording stopped (and where)."""
    num_dropped = num_skipped = 0
    if len(markers) and "kind" in markers:
        drops = markers[markers["kind"].astype(object) == schema.MARKER_DROPPED_ROWS]
        skipped = drops["detail"].astype(str).str.contains('"unreadable_chunk"', regex=False)
        num_dropped, num_skipped = int(drops.loc[~skipped, "count"].sum()), int(skipped.sum())
    stopped = ranges[ranges["cause"] == incomplete.STOPPED].drop_duplicates("rank")
    return {
        "dropped_rows": num_dropped,
        "unreadable_chunks": num_skipped,
        "recording_stopped": ", ".join(
            f"rank {row.rank} at step {row.first_step}" for row in stopped.itertuples()
        ) or "none",
        **writer_trouble(markers),
    }


# What a writer process's trouble means for the findings, said once after the ranks it hit.
_LOST_MEANS = ("its writer process died and was restarted, which picks up the rows where it "
               "stopped: the findings hold")
_STALLED_MEANS = ("its writer process went silent (stopped, or a frozen filesystem): rows after "
                  "its last write wait in the recording host's hot folder, so read elsewhere "
                  "the steps after it may be missing")


def writer_trouble(markers: pd.DataFrame) -> dict[str, str]:
    """``writers_lost`` and ``writers_stalled``: each a line per rank whose writer process died
    or went silent, and what that means for the findings (``"none"`` when none did); said by
    ``summary`` and under ``analyze``'s verdict alike."""
    return {"writers_lost": _writer_notices(markers, schema.MARKER_WRITER_LOST, _LOST_MEANS),
            "writers_stalled": _writer_notices(markers, schema.MARKER_WRITER_STALLED,
                                               _STALLED_MEANS)}


def _writer_notices(markers: pd.DataFrame, kind: str, means: str) -> str:
    """``"rank 1 at step 5 (2 times): <what it means>"`` per rank with ``kind`` markers (a
    writer process lost or stalled), or ``"none"``."""
    if not len(markers) or "kind" not in markers:
        return "none"
    mine = markers[markers["kind"].astype(object) == kind]
    if not len(mine):
        return "none"
    ranks = mine.groupby(mine["rank"].astype("int64"), sort=True)["step"].agg(["min", "size"])
    said = ", ".join(f"rank {rank} at step {int(row['min'])}"
                     + (f" ({int(row['size'])} times)" if row["size"] > 1 else "")
                     for rank, row in ranks.iterrows())
    return f"{said}: {means}"


def incomplete_per_rank(ranges: pd.DataFrame) -> pd.DataFrame:
    """Per rank that lost rows: ``rank``, ``steps`` (``"steps 5-7"``), ``num_rows``, ``tables``
    (``"events: 1,204 rows"``) and ``what`` happened (``"dropped 1,204 rows"``), from
    ``incomplete_ranges``: what summary and report print."""
    rows = []
    for rank, mine in ranges.groupby("rank", sort=True):
        # A range to the rank's end (``MAX_STEP``: a killed rank's copy) is said as "N on".
        open_ended = mine["last_step"].to_numpy() >= MAX_STEP
        steps = {s for first, last in zip(mine["first_step"], mine["last_step"], strict=True)
                 if last < MAX_STEP for s in range(int(first), int(last) + 1)}
        label = "step " if len(steps) == 1 and not open_ended.any() else "steps "
        since = int(mine["first_step"].to_numpy()[open_ended].min()) if open_ended.any() else None
        steps = {s for s in steps if since is None or s < since}
        num_rows = int(mine["num_rows"].sum())
        said = ", ".join([rank_ranges(sorted(steps))] * bool(steps)
                         + [f"{since} on"] * (since is not None))
        rows.append({"rank": int(rank), "steps": label + said,
                     "num_rows": num_rows, "tables": _tables(mine),
                     "what": ", ".join(_what(c, num_rows)
                                       for c in incomplete.CAUSES if (mine["cause"] == c).any())})
    return pd.DataFrame(rows, columns=["rank", "steps", "num_rows", "tables", "what"])


_WHAT = {incomplete.DROPPED: "dropped {n:,} rows", incomplete.UNREADABLE: "could not read a chunk",
         incomplete.UNWRITTEN: "could not write {n:,} rows to its run dir",
         incomplete.ABORTED: "aborted a micro-step", incomplete.STOPPED: "stopped recording"}
def _what(cause: str, num_rows: int) -> str:
    if cause == incomplete.UNWRITTEN and not num_rows:  # where a killed rank's copy ended
        return "has rows its run dir may lack (they were not copied there yet)"
    return _WHAT[cause].format(n=num_rows)


_EVERY_TABLE = {incomplete.ABORTED: "every table: aborted", incomplete.STOPPED:
                "every table: recording stopped"}


def _tables(ranges: pd.DataFrame) -> str:
    """Which tables lost what (a cause that spans every table is said once)."""
    whole = [_EVERY_TABLE[c] for c in _EVERY_TABLE if (ranges["cause"] == c).any()]
    some = ranges[~ranges["cause"].isin(list(_EVERY_TABLE))]
    by_table = some.groupby("table", sort=True)["num_rows"].sum()
    return ", ".join([*(f"{t}: {_rows(n)}" for t, n in by_table.items()), *whole])


def _rows(num_rows: int) -> str:
    # A skipped unreadable chunk counts no rows: how many it held is unknown.
    return f"{int(num_rows):,} rows" if num_rows else "an unreadable chunk"
