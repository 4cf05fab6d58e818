"""The unsharded-memory ledger: which units hold all-gathered parameters, when, and how much.

"Which FSDP unit is holding my memory?" A unit's parameters are held unsharded from the moment
its all-gather is issued (the output buffer exists) until FSDP2 reshards the group or drops the
gather: the ``allgathers`` table records both ends (``issue``; ``reshard`` or ``drop``) with the
group's bytes in the dtype it is gathered in. Replaying those rows per rank gives the bytes held
at every moment, the peak of each pass and the units that make it up.

This is parameter memory as FSDP holds it, not the allocator's view: activations, gradients,
communication buffers and fragmentation are not in it, and eval forwards are not recorded.

The *floor* of a pass is what its configuration needs at least: for the unit that needs most,
its own bytes plus the bytes it prefetched in that pass (explicit edges or FSDP2's implicit
backward prefetch). A peak above the floor is memory held for other reasons, and the units
held from an earlier pass say which (``reshard_after_forward=False``, a prefetch consumed a phase
later).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from fsdptrace.reading.keys import first_rows, group_ids, in_seq_order, row_keys
from fsdptrace.reading.text_columns import as_text

_HOLD, _FREE = "issue", ("reshard", "drop")
_NONE = np.empty(0, dtype=np.int64)  # a pass that held nothing at its peak
_PASS = ["rank", "step", "micro_step", "phase"]
TIMELINE_COLUMNS = ["rank", "seq", "t_ns", "step", "micro_step", "phase", "unit", "group",
                    "event", "num_bytes", "held_bytes"]
HELD_COLUMNS = ["rank", "seq", "t_ns", "step", "held_bytes"]
# The floors take a slot per (pass, unit) while that is at most this many per row.
DENSE_PAIRS_PER_ROW = 4
PEAK_COLUMNS = [*_PASS, "peak_bytes", "floor_bytes", "excess_bytes", "peak_units",
                "held_from_earlier", "largest_earlier_unit"]


def timeline(allgathers: pd.DataFrame) -> pd.DataFrame:
    """Every issue, reshard and drop, in order per rank, with the rank's bytes held after it."""
    rows = _held_rows(allgathers)
    for column in ("phase", "unit", "event"):
        rows[column] = as_text(rows[column])
    return rows[TIMELINE_COLUMNS]


def held_over_time(allgathers: pd.DataFrame) -> pd.DataFrame:
    """``timeline``'s numbers only (``HELD_COLUMNS``): what the report and the Chrome trace
    draw. Its names as text were most of its memory (3.7M rows: 445 MB against 120)."""
    return _held_rows(allgathers)[HELD_COLUMNS]


def _held_rows(allgathers: pd.DataFrame) -> pd.DataFrame:
    """``_lifecycle`` rows, in (rank, seq) order, with ``held_bytes``."""
    rows = _lifecycle(allgathers).reset_index(drop=True)
    held = held_after(rows) if len(rows) else np.zeros(0, dtype=np.int64)
    return rows.assign(held_bytes=pd.Series(held, dtype="int64"))


def held_after(rows: pd.DataFrame, key: np.ndarray | None = None) -> np.ndarray:
    """Per row of ``_lifecycle`` rows, the bytes its rank holds after it.

    A (rank, unit, group) holds an issue's bytes until its next free or issue (a free of a
    group not held, e.g. gathered before recording began, frees nothing), so what a rank holds
    is the running sum of what each row changed: on arrays (a Python replay row by row took
    42 s of a report on a 64-rank deep run). ``key``: the rows' (rank, unit, group) ids, where
    the caller has them.
    """
    rank = rows["rank"].to_numpy(dtype=np.int64)
    issue = (rows["event"] == _HOLD).to_numpy()
    size = np.zeros(len(rows), dtype=np.int64)  # a free's bytes are not read (may be null)
    size[issue] = rows["num_bytes"][issue].to_numpy(dtype=np.int64)
    key = group_ids(rows, ["rank", "unit", "group"]) if key is None else key
    before = pd.Series(size).groupby(key).shift(1, fill_value=0).to_numpy(dtype=np.int64)
    return pd.Series(size - before).groupby(rank).cumsum().to_numpy(dtype=np.int64)


@dataclass
class _Holding:
    unit: str
    num_bytes: int
    since: tuple  # (step, micro_step, phase) of the issue


def peaks(allgathers: pd.DataFrame, *, by_design: frozenset[str] = frozenset(),
          min_excess: int = 0) -> pd.DataFrame:
    """Per pass: the peak of bytes held, the units making it up, the floor and the excess.

    ``held_from_earlier`` names the units at the peak whose gather was issued in an earlier
    pass, with that pass: the usual cause of an excess. Units in ``by_design`` (a root FSDP2
    keeps unsharded from forward into backward) count toward the floor when held from earlier.
    ``min_excess``: only the passes whose excess may reach it (their peak is that far above
    the configuration's floor), for a check that reports no other.
    """
    rows = _lifecycle(allgathers).reset_index(drop=True)
    out = []
    replay = _Replay(rows) if len(rows) else None
    needs = (_floors_of(replay.passes, _floors(allgathers)) if replay
             else np.array([], dtype=np.int64))
    kept = (np.flatnonzero((replay.peak - needs >= min_excess) | (min_excess <= 0))
            if replay else np.array([], dtype=np.int64))
    if replay:
        replay.find_held(kept)
    passes = replay.passes.iloc[kept].itertuples(index=False, name=None) if replay else ()
    for index, (rank, step, micro_step, phase) in zip(kept, passes, strict=True):
        assert replay is not None
        where = (int(step), int(micro_step), str(phase))
        holding = replay.holding(int(index))
        earlier = [h for h in holding if h.since != where]
        floor = int(needs[index]) + sum(h.num_bytes for h in earlier if h.unit in by_design)
        causes = sorted((h for h in earlier if h.unit not in by_design),
                        key=lambda h: -h.num_bytes)
        peak = int(replay.peak[index])
        out.append({
            "rank": int(rank), "step": where[0], "micro_step": where[1], "phase": where[2],
            "peak_bytes": peak, "floor_bytes": floor, "excess_bytes": max(0, peak - floor),
            "peak_units": ",".join(h.unit for h in sorted(holding, key=lambda h: -h.num_bytes)),
            "held_from_earlier": ",".join(
                f"{h.unit} (since step {h.since[0]}, micro-step {h.since[1]}, "
                f"{h.since[2]})" for h in earlier),
            "largest_earlier_unit": causes[0].unit if causes else None,
        })
    frame = pd.DataFrame(out, columns=PEAK_COLUMNS)
    # None where no earlier unit is held, whatever pandas infers: a text column with some
    # missing values reads them as NaN, and a NaN cause is not None (check 13's message).
    cause = frame["largest_earlier_unit"].astype(object)
    frame["largest_earlier_unit"] = cause.where(cause.notna(), None)
    order = frame["phase"].map({"forward": 0, "backward": 1})
    return (frame.assign(_order=order).sort_values(["rank", "step", "micro_step", "_order"],
                                                    kind="stable")
            .drop(columns="_order").reset_index(drop=True))


class _Replay:
    """Every rank's issues and frees replayed at once, on arrays (a replay row by row in
    Python cost 0.3 s per deep rank, most of check 13).

    A (rank, unit, group) holds an issue's bytes until its next free or issue; the bytes a
    rank holds after a row are the running sum of what each row changed. A pass's peak is the
    first row of the pass where that sum is highest, or what it inherited from the row before
    its first when nothing in it went higher. What is held at a peak is, of each of the rank's
    groups, the last row at or before it, where that row is an issue: in the order issued.
    """

    def __init__(self, rows: pd.DataFrame) -> None:
        rank = rows["rank"].to_numpy(dtype=np.int64)
        issue = (rows["event"] == _HOLD).to_numpy()
        key = group_ids(rows, ["rank", "unit", "group"])
        held = held_after(rows, key)
        passes = group_ids(rows, _PASS)
        first = first_rows(passes)  # each pass's first row, in pass order
        self.passes = rows.loc[first, _PASS].reset_index(drop=True)  # in pass order
        # What a pass inherits: held after the row before its first, on the same rank.
        previous = first - 1
        same = (previous >= 0) & (rank[np.maximum(previous, 0)] == rank[first])
        inherited = np.where(same, held[np.maximum(previous, 0)], 0)
        top_of = np.full(len(first), np.iinfo(np.int64).min, dtype=np.int64)
        np.maximum.at(top_of, passes, held)
        at_top = np.flatnonzero(held == top_of[passes])
        reached = np.full(len(first), len(held), dtype=np.int64)  # each pass's first top row
        np.minimum.at(reached, passes[at_top], at_top)
        rose = top_of > inherited
        self.peak = np.where(rose, top_of, inherited)
        # The row whose state is the peak; -1: nothing held (before the rank's first row).
        self.row = np.where(rose, reached, np.where(same, previous, -1)).astype(np.int64)
        self._rank, self._key, self._issue = rank, key, issue
        self._rows = rows
        self._held: dict[int, np.ndarray] = {}
        self._named: dict[int, tuple] = {}

    def find_held(self, passes: np.ndarray) -> None:
        """Find what ``passes`` held at their peaks (``holding``), and the columns ``holding``
        reads at those rows only (as lists for all rows, 0.6 s of a 16-rank deep analysis)."""
        rows = self.row[passes]
        self._held = self._held_at(np.unique(rows[rows >= 0]))
        named = np.unique(np.concatenate([_NONE, *self._held.values()]))
        columns = [_take(self._rows[c], named)
                   for c in ("unit", "num_bytes", "step", "micro_step", "phase")]
        self._named = dict(zip(named.tolist(), zip(*columns, strict=True), strict=True))

    def _held_at(self, wanted: np.ndarray) -> dict[int, np.ndarray]:
        """Per row of ``wanted``, the rows of the issues held after it, in the order issued."""
        rank, key, issue, n = self._rank, self._key, self._issue, len(self._rank)
        if not len(wanted):
            return {}
        by_key = np.lexsort((np.arange(n), key))
        code = key[by_key].astype(np.int64) * (n + 1) + by_key
        key_rank = pd.Series(rank).groupby(key).first()  # key id -> its rank
        keys_of = {r: ids.to_numpy() for r, ids in
                   pd.Series(key_rank.index.to_numpy()).groupby(key_rank.to_numpy())}
        found: dict[int, np.ndarray] = {}
        for r, snaps in pd.Series(wanted).groupby(rank[wanted]):
            keys = keys_of[r]
            snap, k = np.repeat(snaps.to_numpy(), len(keys)), np.tile(keys, len(snaps))
            at = np.searchsorted(code, k * (n + 1) + snap, side="right") - 1
            valid = at >= 0
            valid[valid] &= code[at[valid]] // (n + 1) == k[valid]
            last = by_key[np.where(valid, at, 0)]
            live = valid & issue[last]
            snap, last = snap[live], last[live]
            if not len(snap):
                continue  # nothing held at any of this rank's peaks
            order = np.lexsort((last, snap))
            snap, last = snap[order], last[order]
            cuts = np.flatnonzero(np.r_[True, snap[1:] != snap[:-1]])
            for start, end in zip(cuts, np.r_[cuts[1:], len(snap)], strict=True):
                found[int(snap[start])] = last[start:end]
        return found

    def holding(self, index: int) -> list[_Holding]:
        """What the pass ``index`` held at its peak."""
        return [_Holding(str(unit), int(num_bytes), (int(step), int(micro_step), str(phase)))
                for unit, num_bytes, step, micro_step, phase in
                (self._named[r] for r in self._held.get(int(self.row[index]), _NONE).tolist())]


def _take(column: pd.Series, rows: np.ndarray) -> list:
    """``column.tolist()`` at the positions ``rows`` only (a categorical's names by its codes,
    not all its rows made objects first)."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        names = column.cat.categories.to_numpy(dtype=object)
        return [names[code] if code >= 0 else np.nan
                for code in column.cat.codes.to_numpy()[rows].tolist()]
    return column.to_numpy()[rows].tolist()


def _floors(allgathers: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step, micro-step, phase) of ``allgathers`` (``_PASS``, ``floor``), the most
    one unit needs there: its own parameters plus what it prefetched there.

    Every unit with a row in the pass ran there (its gather, wait, reshard or a no-op unshard).
    On arrays: each (pass, unit) numbered once, its bytes reduced in place, and only the passes
    sorted (a group-by per pass cost 0.5 s per rank of a real run; a sort of every row and
    three more of every (pass, unit) were most of what was left).
    """
    if not len(allgathers):
        return pd.DataFrame({c: pd.Series(dtype="int64") for c in [*_PASS, "floor"]})
    unit, issuer = _shared_codes(allgathers["unit"], allgathers["issuer_unit"])
    passes = group_ids(allgathers, _PASS)
    first = first_rows(passes)
    # (pass, unit) as one integer; -1 (no issuer) never matches a unit that ran.
    span = int(max(unit.max(initial=-1), issuer.max(initial=-1))) + 2
    num_bytes = allgathers["num_bytes"].to_numpy(dtype=np.int64)
    own = passes * span + unit + 1
    prefetched = ((allgathers["event"] == _HOLD)
                  & allgathers["issuer_kind"].isin(["prefetch", "implicit"])).to_numpy()
    extra, extra_bytes = (passes * span + issuer + 1)[prefetched], num_bytes[prefetched]
    if len(first) * span <= DENSE_PAIRS_PER_ROW * len(own) + 4096:  # a slot per (pass, unit)
        need = np.full(len(first) * span, -1, dtype=np.int64)  # -1: the unit did not run
        np.maximum.at(need, own, num_bytes)
        ran = need[extra] >= 0
        np.add.at(need, extra[ran], extra_bytes[ran])
        floor = need.reshape(len(first), span).max(axis=1)
    else:  # too many units for a slot each: number the pairs that occur
        pair, pairs = pd.factorize(own)
        need = np.zeros(len(pairs), dtype=np.int64)
        np.maximum.at(need, pair, num_bytes)
        by = pd.Index(pairs).get_indexer(extra)
        np.add.at(need, by[by >= 0], extra_bytes[by >= 0])
        floor = np.zeros(len(first), dtype=np.int64)
        np.maximum.at(floor, np.asarray(pairs) // span, need)
    phase = allgathers["phase"].astype("category")
    keys = [allgathers[c].to_numpy(dtype=np.int64)[first] for c in ("rank", "step", "micro_step")]
    code = phase.cat.codes.to_numpy(dtype=np.int64)[first]
    order = np.lexsort((code, *keys[::-1]))
    return pd.DataFrame({"rank": keys[0][order], "step": keys[1][order],
                         "micro_step": keys[2][order],
                         "phase": phase.cat.categories.astype(str).to_numpy()[code[order]],
                         "floor": floor[order]})


def _floors_of(passes: pd.DataFrame, floors: pd.DataFrame) -> np.ndarray:
    """``floors``' floor of each pass of ``passes`` (``_PASS`` columns), 0 where it has none."""
    wanted, have = row_keys([passes, floors], _PASS)
    at = pd.Index(have).get_indexer(wanted)
    return np.where(at >= 0, floors["floor"].to_numpy(dtype=np.int64)[at], 0)


def _shared_codes(unit: pd.Series, issuer: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Two name columns as codes of one vocabulary (-1: no name)."""
    unit, issuer = unit.astype("category"), issuer.astype("category")
    names = unit.cat.categories.union(issuer.cat.categories)
    return (unit.cat.set_categories(names).cat.codes.to_numpy(),
            issuer.cat.set_categories(names).cat.codes.to_numpy())


def _lifecycle(allgathers: pd.DataFrame) -> pd.DataFrame:
    """Issues, reshards and drops in order; none for a run recorded before reshards were (its
    holds would never end). Names stay as the table holds them (category codes, not text)."""
    if not len(allgathers) or not (allgathers["event"] == "reshard").any():
        return pd.DataFrame(columns=TIMELINE_COLUMNS[:-1])
    kept = allgathers["event"].isin([_HOLD, *_FREE]).to_numpy()
    return in_seq_order(allgathers[TIMELINE_COLUMNS[:-1]][kept])


def worst_passes(peak_rows: pd.DataFrame) -> pd.DataFrame:
    """Per rank, the pass with its highest peak; among passes with the same peak, the earliest
    (the first time the run reached it). ``summary`` and the report both read this, so they
    name the same step."""
    ordered = peak_rows.sort_values("peak_bytes", ascending=False, kind="stable")
    return ordered.groupby("rank", sort=True).head(1).sort_values("rank").reset_index(drop=True)


def summary_line(peak_rows: pd.DataFrame, rank: int,
                 types: dict[str, str] | None = None) -> str | None:
    """``rank R: peak unsharded X (where, units); floor Y`` for ``summary``; ``types``: the
    module types of positional unit names (``fsdptrace.reading.unit_names``), shown beside them."""
    from fsdptrace.reading.sizes import human_bytes
    from fsdptrace.reading.unit_names import labeller

    label = labeller(types or {})

    mine = worst_passes(peak_rows[peak_rows["rank"] == rank])
    if not len(mine):
        return None
    top = mine.iloc[0]
    return (f"rank {rank}: peak unsharded parameters {human_bytes(top['peak_bytes'])} at step "
            f"{top['step']}, micro-step {top['micro_step']}, {top['phase']} "
            f"({', '.join(label(u) for u in str(top['peak_units']).split(','))}); "
            f"floor {human_bytes(top['floor_bytes'])}")
