"""``fsdptrace.load``: a run dir as pandas DataFrames, for notebooks and for the checks.

Each table keeps the on-disk columns plus ``rank``; unit names, phases, targets and marker
kinds are categoricals, so a 10M-event trace stays small in memory.
"""

from __future__ import annotations

import html
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from fsdptrace.errors import RunDirError
from fsdptrace.reading import reader
from fsdptrace.store import schema, stack_dumps
from fsdptrace.store.stack_dumps import StackCapture

TABLE_NAMES = ("meta", "units", "events", "markers", "prefetch", "gradients", "pending",
               "allgathers", "findings", "backward_grads", "grads_written", "eval_forwards",
               "settings", "collectives")


@dataclass
class Trace:
    """All ranks of one run dir, as DataFrames (``trace.events``, ``trace.units``...)."""

    run_dir: Path
    meta: pd.DataFrame
    units: pd.DataFrame
    events: pd.DataFrame
    markers: pd.DataFrame
    prefetch: pd.DataFrame
    gradients: pd.DataFrame
    pending: pd.DataFrame
    allgathers: pd.DataFrame = field(default_factory=pd.DataFrame)
    findings: pd.DataFrame = field(default_factory=pd.DataFrame)
    # What checks 2, 10, 11 and 12 read (docs/recorded_for_checks.md); empty for run dirs
    # recorded before these tables existed.
    backward_grads: pd.DataFrame = field(default_factory=pd.DataFrame)
    grads_written: pd.DataFrame = field(default_factory=pd.DataFrame)
    eval_forwards: pd.DataFrame = field(default_factory=pd.DataFrame)
    settings: pd.DataFrame = field(default_factory=pd.DataFrame)
    # Every FSDP collective with its process group's sequence number (contract v3).
    collectives: pd.DataFrame = field(default_factory=pd.DataFrame)
    # Each rank's Python stacks a watcher captured while the run hung, oldest first
    # (``fsdptrace.store.stack_dumps``); empty when none was taken.
    stacks: dict[int, list[StackCapture]] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        """Ranks with data on disk."""
        return ranks_with_rows(self.meta, self.units, self.events, self.markers)

    @property
    def world_size(self) -> int:
        """World size the ranks reported (the largest, if they disagree)."""
        return world_size_of(self.meta, self.ranks)

    @property
    def steps(self) -> list[int]:
        return sorted(int(s) for s in self.events["step"].unique()) if len(self.events) else []

    def order(self, step: int, micro_step: int, phase: str = schema.FORWARD) -> pd.DataFrame:
        """The units each rank ran in one (step, micro_step, phase): rank x position."""
        sel = self.events[
            (self.events["step"] == step)
            & (self.events["micro_step"] == micro_step)
            & (self.events["phase"] == phase)
        ].sort_values(["rank", "seq"])
        sel = sel.assign(position=sel.groupby("rank", observed=True).cumcount())
        table = sel.pivot(index="rank", columns="position", values="unit")
        table.columns.name = "position"
        return table

    def prefetch_edges(self, step: int | None = None) -> pd.DataFrame:
        """Configured edges as a tidy table (rank, unit, phase, target, target_index).

        With ``step``, the edges in effect at that step's first micro-step; else every
        snapshot, with the (step, micro_step) it took effect.
        """
        # A unit with no targets is a row with a null target, which made target_index float.
        edges = self.prefetch.dropna(subset=["target"])
        edges = edges.assign(target_index=edges["target_index"].astype("int64"))
        if step is None:
            return edges.reset_index(drop=True)
        taken = edges[edges["step"] <= step]
        if not len(taken):
            return taken.reset_index(drop=True)
        keys = taken[["rank", "step", "micro_step"]].drop_duplicates()
        latest = keys.sort_values(["step", "micro_step"]).groupby("rank").tail(1)
        return taken.merge(latest, on=["rank", "step", "micro_step"]).reset_index(drop=True)

    def allgathers_per_step(self) -> pd.DataFrame:
        """All-gathers per (rank, optimizer step, unit), by issuer (all-gather provenance)."""
        from fsdptrace.reading.allgathers import per_step

        return per_step(self.allgathers)

    def bytes_held(self) -> pd.DataFrame:
        """Bytes gathered and not yet consumed, per unit and rank, after every change."""
        from fsdptrace.reading.allgathers import bytes_held

        return bytes_held(self.allgathers)

    def unsharded(self, *, peaks: bool = False) -> pd.DataFrame:
        """The unsharded-memory ledger (``fsdptrace.reading.unsharded``): bytes of all-gathered
        parameters each rank holds after every issue, reshard and drop; with ``peaks=True``,
        one row per pass with its peak, the units making it up, the floor and the excess.
        Parameter memory as FSDP holds it, not the allocator's view."""
        from fsdptrace.reading import unsharded

        return unsharded.peaks(self.allgathers) if peaks else unsharded.timeline(self.allgathers)

    def summary(self) -> dict[str, object]:
        """Counts a person wants first: ranks, steps, units, events."""
        from fsdptrace.reading.endings import clean_ranks

        closed = clean_ranks(self.markers, self.ranks)
        return {
            "run_dir": str(self.run_dir),
            "ranks": len(self.ranks),
            "world_size": self.world_size,
            "steps": len(self.steps),
            "units": int(self.units["unit"].nunique()) if len(self.units) else 0,
            "events": len(self.events),
            "clean_close": len(closed),
        }

    def __repr__(self) -> str:
        s = self.summary()
        return (f"<fsdptrace.Trace {s['run_dir']}: {s['ranks']} of {s['world_size']} ranks, "
                f"{s['steps']} steps, {s['units']} units, {s['events']} events, "
                f"{s['clean_close']} closed cleanly>")

    def _repr_html_(self) -> str:
        """The counts of ``summary()`` as a table. Findings are ``Analysis._repr_html_``'s:
        a notebook cell showing a trace never runs the checks."""
        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(str(k))}</th>"
            f"<td>{html.escape(str(v))}</td></tr>"
            for k, v in self.summary().items()
        )
        return f"<b>fsdptrace.Trace</b><table>{rows}</table>"


def ranks_with_rows(*frames: pd.DataFrame) -> list[int]:
    """The ranks with a row in any of ``frames`` (``Trace.ranks`` asks meta, units, events
    and markers)."""
    present: set[int] = set()
    for frame in frames:
        if "rank" in frame:
            present.update(int(r) for r in frame["rank"].unique())
    return sorted(present)


def world_size_of(meta: pd.DataFrame, ranks: list[int]) -> int:
    """The world size the ranks reported (the largest, if they disagree); without meta, one
    more than the highest of ``ranks``."""
    if len(meta):
        return int(meta["world_size"].max())
    return max(ranks, default=-1) + 1


def to_frame(data: pa.Table) -> pd.DataFrame:
    """One Arrow table as ``load`` holds it (categoricals for dictionaries, int32 ranks)."""
    if "rank" in data.column_names:  # cast in Arrow: a pandas column cast copies the frame
        at = data.column_names.index("rank")
        data = data.set_column(at, "rank", pc.cast(data.column(at), pa.int32()))
    return data.to_pandas()


def read_frame(run_dir: Path, table: str, ranks: Iterable[int],
               journals: Mapping[int, reader.RankJournal] | None = None) -> pd.DataFrame:
    """One table of some ranks, as ``load`` would hold it (the reduce step needs no more)."""
    return to_frame(reader.read_ranks(run_dir, table, ranks, journals))


def load(run_dir: str | os.PathLike[str], *, ranks: Iterable[int] | None = None) -> Trace:
    """Read every rank of a run dir (or only ``ranks``) into a ``Trace``."""
    path = Path(run_dir)
    reader.check_run_dir(path)
    selected = sorted(ranks) if ranks is not None else reader.discover_ranks(path)
    journals = {rank: reader.rank_journal(path, rank) for rank in selected}
    tables = {name: read_frame(path, name, selected, journals) for name in TABLE_NAMES}
    check_meta(tables["meta"], path)
    stacks = {r: c for r, c in stack_dumps.read_captures(path).items() if r in selected}
    return Trace(run_dir=path, **tables, stacks=stacks)


@dataclass(frozen=True)
class RankByRank:
    """A run dir read for an answer that adds up over ranks (``summary``, ``suggest``): the
    small tables of every rank at once, and one ``Trace`` per rank.

    ``load`` holds every table of every rank at once: 9.3 GB for a 64-rank run of 10M events,
    for outputs that count a rank at a time. Here each rank's other tables are still read and
    validated as ``load`` reads them (a newer table version, a bad value: refused alike), and
    only those a caller keeps are turned into DataFrames.
    """

    run_dir: Path
    ranks: list[int]  # the ranks on disk, in order
    whole: dict[str, pd.DataFrame]  # the small tables (meta among them), of every rank
    journals: dict[int, reader.RankJournal] = field(default_factory=dict)  # found once a rank

    def whole_trace(self) -> Trace:
        """A ``Trace`` of the small tables of every rank, the other tables empty."""
        return Trace(run_dir=self.run_dir, **{t: self.whole.get(t, pd.DataFrame())
                                              for t in TABLE_NAMES})

    def traces(self, kept: Iterable[str]) -> Iterator[Trace]:
        """Per rank, in order: a ``Trace`` of its rows of the small tables and of ``kept``,
        the other tables empty (read all the same: validated)."""
        kept = set(kept)
        highest = reader.highest_meta_rank(self.run_dir)
        parts = {t: _by_rank(frame) for t, frame in self.whole.items()}
        for rank in self.ranks:
            tables = {}
            journal = self.journals.get(rank) or reader.rank_journal(self.run_dir, rank)
            for table in TABLE_NAMES:
                if table in self.whole:
                    tables[table] = parts[table].get(rank, self.whole[table].iloc[:0])
                    continue
                read = reader.read_rank(self.run_dir, table, rank, highest_rank=highest,
                                        journal=journal)
                tables[table] = (to_frame(reader.concat_ranks([read], table)) if table in kept
                                 else pd.DataFrame())
            yield Trace(run_dir=self.run_dir, **tables)


def read_rank_by_rank(run_dir: Path, whole: Iterable[str] = ("meta",)) -> RankByRank:
    """A run dir as ``RankByRank``: refused where ``load`` refuses it; ``whole``: the small
    tables to read for every rank at once (meta always)."""
    reader.check_run_dir(run_dir)
    ranks = reader.discover_ranks(run_dir)
    journals = {rank: reader.rank_journal(run_dir, rank) for rank in ranks}
    tables = {t: read_frame(run_dir, t, ranks, journals) for t in dict.fromkeys(("meta", *whole))}
    check_meta(tables["meta"], run_dir)
    return RankByRank(run_dir, ranks, tables, journals)


def _by_rank(frame: pd.DataFrame) -> dict[int, pd.DataFrame]:
    """``frame``'s rows of each rank (one pass, not one filter per rank)."""
    if not len(frame):
        return {}
    return {int(rank): part for rank, part in frame.groupby(
        frame["rank"].astype("int64"), sort=False)}


def check_meta(meta: pd.DataFrame, run_dir: Path) -> None:
    """Refuse run dirs where two processes claim the same rank."""
    if not len(meta):
        return
    # In plain Python: one row per rank and recording, where a groupby costs milliseconds.
    claims: dict[int, tuple[set[object], set[object]]] = {}
    for rank, host, pid in zip(meta["rank"].tolist(), meta["host"].tolist(),
                               meta["pid"].tolist(), strict=True):
        hosts, pids = claims.setdefault(rank, (set(), set()))
        if not pd.isna(host):
            hosts.add(host)
        if not pd.isna(pid):
            pids.add(pid)
    for rank in sorted(r for r, (hosts, pids) in claims.items() if len(hosts) > 1 or len(pids) > 1):
        rows = meta[meta["rank"] == rank]
        who = ", ".join(f"pid {p} on {h}" for h, p in zip(rows["host"], rows["pid"], strict=True))
        raise RunDirError(
            f"rank {rank} in {run_dir} was recorded by several processes ({who}): "
            "two runs share this run dir; give each run its own --run-dir"
        )
