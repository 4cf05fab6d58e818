"""What a run dir holds, per rank: the answer to "what did I record?"."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pandas as pd

from fsdptrace.reading import endings, incomplete, unsharded
from fsdptrace.reading.trace import Trace
from fsdptrace.store import schema
from fsdptrace.store.key_ranges import MAX_STEP
from fsdptrace.views.rank_ranges import rank_ranges


@dataclass(frozen=True, eq=False)
class RunSummary:
    """What ``fsdptrace summary`` renders: a loaded run and its numbers.

    The summary renderers read ``trace``, ``summary`` and ``run_dir``, as they do of an
    ``Analysis``; building one ran the analyzer's map step (signatures, positions) for
    nothing the summary prints: a third of its time on a run of thousands of ranks.
    """

    trace: Trace

    @property
    def run_dir(self) -> Path | None:
        return self.trace.run_dir

    @cached_property
    def summary(self) -> dict[str, object]:
        """The run in numbers (``overview``)."""
        return overview(self.trace)


def summarize(trace: Trace) -> RunSummary:
    """``trace`` ready for the summary renderers (``fsdptrace.render.formats.SUMMARY_FORMATS``)."""
    return RunSummary(trace)


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
    endings = _endings(trace)
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


def _endings(trace: Trace) -> dict[int, str]:
    found = endings.rank_endings(trace.markers, trace.ranks)
    text = found["ending"].astype(str).where(found["ending"] != endings.CLEAN, "clean close")
    detail = found["detail"].astype(str)
    text = text.where(detail == "", text + " (" + detail.str.slice(0, 120) + ")")
    return dict(zip(found["rank"].astype(int), text, strict=True))


def overview(trace: Trace, *, ranks: pd.DataFrame | None = None) -> dict[str, object]:
    """The run in numbers (JSON-friendly). ``ranks``: ``per_rank(trace)``, where the caller
    prints it too (a group-by over every event: on a large run, seconds to compute twice)."""
    ranks = per_rank(trace) if ranks is None else ranks
    span = 0.0
    if len(trace.events):
        span = float((trace.events["t_ns"].max() - trace.events["t_ns"].min()) / 1e9)
    lost = incomplete.parse(trace.markers)
    return {
        "ranks": len(trace.ranks),
        "world_size": trace.world_size,
        "missing_ranks": sorted(set(range(trace.world_size)) - set(trace.ranks)),
        "steps": len(trace.steps),
        "micro_steps": int(ranks["micro_steps"].max()) if len(ranks) and ranks[
            "micro_steps"].notna().any() else 0,
        "units": int(trace.units["unit"].nunique()) if len(trace.units) else 0,
        "events": len(trace.events),
        "time_span_s": round(span, 3),
        "clean_close": int((ranks["ended"] == "clean close").sum()),
        **losses(trace.markers, lost),
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
