"""What a run dir holds, per rank: the answer to "what did I record?"."""

from __future__ import annotations

import pandas as pd

from fsdptrace import endings, schema, unsharded
from fsdptrace.checks import incomplete
from fsdptrace.render.folding import rank_ranges
from fsdptrace.trace import Trace


def per_rank(trace: Trace) -> pd.DataFrame:
    """One row per rank: steps, micro-steps, events, time span, and how recording ended."""
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
    return out.merge(_unsharded_peaks(trace), on="rank", how="left")


def _unsharded_peaks(trace: Trace) -> pd.DataFrame:
    """Per rank, its highest pass of unsharded parameter bytes and that pass's floor."""
    peaks = unsharded.peaks(trace.allgathers)
    top = peaks.sort_values("peak_bytes", kind="stable").groupby("rank").tail(1)
    return pd.DataFrame({"rank": top["rank"].astype("int64"),
                         "peak_unsharded_bytes": top["peak_bytes"].astype("Int64"),
                         "unsharded_floor_bytes": top["floor_bytes"].astype("Int64")})


def _endings(trace: Trace) -> dict[int, str]:
    found = endings.rank_endings(trace.markers, trace.ranks)
    text = found["ending"].astype(str).where(found["ending"] != endings.CLEAN, "clean close")
    detail = found["detail"].astype(str)
    text = text.where(detail == "", text + " (" + detail.str.slice(0, 120) + ")")
    return dict(zip(found["rank"].astype(int), text, strict=True))


def overview(trace: Trace) -> dict[str, object]:
    """The run in numbers (JSON-friendly)."""
    ranks = per_rank(trace)
    span = 0.0
    if len(trace.events):
        span = float((trace.events["t_ns"].max() - trace.events["t_ns"].min()) / 1e9)
    dropped = trace.markers[trace.markers["kind"] == schema.MARKER_DROPPED]
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
        "dropped_rows": int(dropped["count"].sum()) if len(dropped) else 0,
        "incomplete_steps": {str(row.rank): f"{row.steps} ({row.tables})"
                             for row in incomplete_per_rank(incomplete.parse(trace.markers))
                             .itertuples()},
    }


def incomplete_per_rank(ranges: pd.DataFrame) -> pd.DataFrame:
    """Per rank that lost rows: ``rank``, ``steps`` (``"steps 5-7"``), ``num_rows``, ``tables``
    (``"events: 1,204 rows"``), from ``incomplete_ranges``: what summary and report print."""
    rows = []
    for rank, mine in ranges.groupby("rank", sort=True):
        steps = {s for first, last in zip(mine["first_step"], mine["last_step"], strict=True)
                 for s in range(int(first), int(last) + 1)}
        by_table = mine.groupby("table", sort=True)["num_rows"].sum()
        label = "step " if len(steps) == 1 else "steps "
        rows.append({"rank": int(rank), "steps": label + rank_ranges(sorted(steps)),
                     "num_rows": int(mine["num_rows"].sum()),
                     "tables": ", ".join(f"{t}: {_rows(n)}" for t, n in by_table.items())})
    return pd.DataFrame(rows, columns=["rank", "steps", "num_rows", "tables"])


def _rows(num_rows: int) -> str:
    # A skipped unreadable chunk counts no rows: how many it held is unknown.
    return f"{int(num_rows):,} rows" if num_rows else "an unreadable chunk"
