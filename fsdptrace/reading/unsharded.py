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

import pandas as pd

_HOLD, _FREE = "issue", ("reshard", "drop")
_PASS = ["rank", "step", "micro_step", "phase"]
TIMELINE_COLUMNS = ["rank", "seq", "t_ns", "step", "micro_step", "phase", "unit", "group",
                    "event", "num_bytes", "held_bytes"]
PEAK_COLUMNS = [*_PASS, "peak_bytes", "floor_bytes", "excess_bytes", "peak_units",
                "held_from_earlier", "largest_earlier_unit"]


def timeline(allgathers: pd.DataFrame) -> pd.DataFrame:
    """Every issue, reshard and drop, in order per rank, with the rank's bytes held after it."""
    rows = _lifecycle(allgathers)
    held: list[int] = []
    for _, frame in rows.groupby("rank", sort=True):
        state: dict[tuple, int] = {}
        for unit, group, event, num_bytes in zip(frame["unit"], frame["group"], frame["event"],
                                                 frame["num_bytes"], strict=True):
            key = (unit, group)
            if event == _HOLD:
                state[key] = int(num_bytes)
            else:
                state.pop(key, None)  # a reshard of a group held before recording began
            held.append(sum(state.values()))
    rows = rows.sort_values(["rank", "seq"], kind="stable").reset_index(drop=True)
    rows["held_bytes"] = pd.Series(held, dtype="int64")
    return rows[TIMELINE_COLUMNS]


@dataclass
class _Holding:
    unit: str
    num_bytes: int
    since: tuple  # (step, micro_step, phase) of the issue


def peaks(allgathers: pd.DataFrame, *, by_design: frozenset[str] = frozenset()
          ) -> pd.DataFrame:
    """Per pass: the peak of bytes held, the units making it up, the floor and the excess.

    ``held_from_earlier`` names the units at the peak whose gather was issued in an earlier
    pass, with that pass: the usual cause of an excess. Units in ``by_design`` (a root FSDP2
    keeps unsharded from forward into backward) count toward the floor when held from earlier.
    """
    rows = _lifecycle(allgathers)
    out = []
    all_floors = _floors(allgathers) if len(rows) else {}
    for rank, frame in rows.groupby("rank", sort=True):
        state: dict[tuple, _Holding] = {}
        best: dict[tuple, tuple[int, list[_Holding]]] = {}
        total = 0  # bytes held in ``state``, kept as it changes
        # Plain lists: iterating Arrow-backed columns row by row costs more than the replay.
        columns = [frame[c].tolist() for c in ("step", "micro_step", "phase", "unit", "group",
                                                 "event", "num_bytes")]
        for step, micro_step, phase, unit, group, event, num_bytes in zip(*columns,
                                                                          strict=True):
            where = (int(step), int(micro_step), str(phase))
            if where not in best:  # what the pass inherits counts from its start
                best[where] = (total, list(state.values()))
            key = (str(unit), int(group))
            dropped = state.pop(key, None)
            if dropped is not None:
                total -= dropped.num_bytes
            if event == _HOLD:
                state[key] = _Holding(str(unit), int(num_bytes), where)
                total += int(num_bytes)
            if total > best[where][0]:
                best[where] = (total, list(state.values()))
        for where, (peak, holding) in best.items():
            earlier = [h for h in holding if h.since != where]
            floor = all_floors.get((int(rank), *where), 0) + sum(h.num_bytes for h in earlier
                                               if h.unit in by_design)
            causes = sorted((h for h in earlier if h.unit not in by_design),
                            key=lambda h: -h.num_bytes)
            out.append({
                "rank": int(rank), "step": where[0], "micro_step": where[1], "phase": where[2],
                "peak_bytes": peak, "floor_bytes": floor, "excess_bytes": max(0, peak - floor),
                "peak_units": ",".join(h.unit for h in sorted(holding,
                                                              key=lambda h: -h.num_bytes)),
                "held_from_earlier": ",".join(
                    f"{h.unit} (since step {h.since[0]}, micro-step {h.since[1]}, "
                    f"{h.since[2]})" for h in earlier),
                "largest_earlier_unit": causes[0].unit if causes else None,
            })
    frame = pd.DataFrame(out, columns=PEAK_COLUMNS)
    order = frame["phase"].map({"forward": 0, "backward": 1})
    return (frame.assign(_order=order).sort_values(["rank", "step", "micro_step", "_order"],
                                                    kind="stable")
            .drop(columns="_order").reset_index(drop=True))


def _floors(allgathers: pd.DataFrame) -> dict[tuple, int]:
    """Per (rank, step, micro-step, phase), the most one unit needs: its own parameters plus
    what it prefetched there.

    Every unit with a row in the pass ran there (its gather, wait, reshard or a no-op unshard).
    One grouping over all passes: a pass is a few rows, and a group-by per pass cost 0.5 s
    per rank of a real run.
    """
    if not len(allgathers):
        return {}
    keys = {"rank": allgathers["rank"].astype("int64"), "step": allgathers["step"].astype("int64"),
            "micro_step": allgathers["micro_step"].astype("int64"),
            "phase": allgathers["phase"].astype(str)}
    frame = pd.DataFrame({**keys, "unit": allgathers["unit"].astype(str),
                          "num_bytes": allgathers["num_bytes"].astype("int64")})
    own = frame.groupby([*_PASS, "unit"], sort=False)["num_bytes"].max()
    prefetched = ((allgathers["event"].astype(str) == _HOLD)
                  & allgathers["issuer_kind"].astype(str).isin(["prefetch", "implicit"])).to_numpy()
    by_issuer = frame[prefetched].assign(unit=allgathers["issuer_unit"].astype(str)[prefetched])
    extra = by_issuer.groupby([*_PASS, "unit"], sort=False)["num_bytes"].sum()
    need = own.add(extra.reindex(own.index).fillna(0), fill_value=0)
    return {(int(r), int(s), int(m), str(p)): int(v)
            for (r, s, m, p), v in need.groupby(level=_PASS, sort=False).max().items()}


def _lifecycle(allgathers: pd.DataFrame) -> pd.DataFrame:
    """Issues, reshards and drops in order; none for a run recorded before reshards were (its
    holds would never end)."""
    events = allgathers["event"].astype(str) if len(allgathers) else pd.Series(dtype=str)
    if not (events == "reshard").any():
        return pd.DataFrame(columns=TIMELINE_COLUMNS[:-1])
    rows = allgathers[events.isin([_HOLD, *_FREE])].copy()
    for column in ("phase", "unit", "event"):
        rows[column] = rows[column].astype(str)
    return rows.sort_values(["rank", "seq"], kind="stable")[TIMELINE_COLUMNS[:-1]]


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
