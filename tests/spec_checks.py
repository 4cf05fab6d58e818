"""docs/checks.md, rules 1, 2, 4, 5, 7, 10, 11 and 12, as plain pandas: the executable spec of the
checks.

Written for reading, not speed: one function per check, straight from the contract's words,
taking a ``fsdptrace.Trace`` and returning the findings as a set of tuples. The property test
(``tests/test_spec.py``) asserts that the real checks find the same on random traces.
"""

from __future__ import annotations

from collections import Counter

import pandas as pd

from fsdptrace.reading import endings
from fsdptrace.reading.trace import Trace
from fsdptrace.store import schema

PASS = ["rank", "step", "micro_step", "phase"]


def stop_points(trace: Trace) -> dict[int, tuple]:
    """Per rank whose ending is not clean, its last record: ("pass", step, micro_step, phase),
    ("eval", interval) or ("boundary", step); one ``seq`` numbers all three."""
    clean = endings.clean_ranks(trace.markers, trace.ranks)
    last: dict[int, tuple[int, tuple]] = {}

    def see(rank: int, seq: int, place: tuple) -> None:
        if rank not in clean and (rank not in last or seq > last[rank][0]):
            last[rank] = (seq, place)

    for r, q, s, m, p in zip(trace.events["rank"], trace.events["seq"], trace.events["step"],
                             trace.events["micro_step"], trace.events["phase"], strict=True):
        see(int(r), int(q), ("pass", int(s), int(m), str(p)))
    for r, q, s in zip(trace.eval_forwards["rank"], trace.eval_forwards["seq"],
                       trace.eval_forwards["step"], strict=True):
        see(int(r), int(q), ("eval", int(s)))
    markers = trace.markers
    for r, q, s, k in zip(markers["rank"], markers["seq"], markers["step"], markers["kind"],
                          strict=True):
        if str(k) == schema.MARKER_OPTIMIZER_STEP:
            see(int(r), int(q), ("boundary", int(s)))
    return {rank: place for rank, (_, place) in last.items()}


def passes(trace: Trace) -> dict[tuple, list[str]]:
    """Per pass (rank, step, micro_step, phase): its calls in order, every call kept.

    Cut-off passes are left out: the pass holding the stop point of each rank whose ending is
    not clean (the recording stops there, so it is not an order the job ran).
    """
    events = trace.events.astype({"phase": str, "unit": str}).sort_values(["rank", "seq"])
    stops = stop_points(trace)
    out: dict[tuple, list[str]] = {}
    for rank, mine in events.groupby("rank"):
        for key, calls in mine.groupby(PASS[1:], sort=False):
            if ("pass", *key) != stops.get(int(rank)):
                out[(int(rank), int(key[0]), int(key[1]), key[2])] = list(calls["unit"])
    return out


def edges_in_effect(trace: Trace, rank: int, step: int, micro_step: int
                    ) -> dict[tuple[str, str], list[str]]:
    """The rank's latest prefetch snapshot at or before (step, micro_step):
    ``{(unit, phase): [targets in order]}``."""
    edges = trace.prefetch.astype({"unit": str, "phase": str, "target": object})
    mine = edges[edges["rank"] == rank]
    taken = sorted({(int(s), int(m)) for s, m in zip(mine["step"], mine["micro_step"],
                                                    strict=True) if (s, m) <= (step, micro_step)})
    if not taken:
        return {}
    snapshot = mine[(mine["step"] == taken[-1][0]) & (mine["micro_step"] == taken[-1][1])]
    snapshot = snapshot.dropna(subset=["target"]).sort_values("target_index")
    out: dict[tuple[str, str], list[str]] = {}
    for unit, phase, target in zip(snapshot["unit"], snapshot["phase"], snapshot["target"],
                                   strict=True):
        out.setdefault((unit, phase), []).append(str(target))
    return out


def prefetch_order(trace: Trace) -> set[tuple]:
    """Rule 1: (rank, step, micro_step, phase, S, T, i, j); j is None when T did not execute.

    T absent from the pass: did not execute. Every call of T before S's first call: out of
    order at positions i (S's first call) -> j (T's last call). A later call of T is fine.
    """
    found = set()
    for (rank, step, micro, phase), calls in passes(trace).items():
        edges = edges_in_effect(trace, rank, step, micro)
        for source in dict.fromkeys(calls):
            first_source = calls.index(source)
            for target in edges.get((source, phase), []):
                if target not in calls:
                    found.add((rank, step, micro, phase, source, target, first_source, None))
                    continue
                last_target = len(calls) - 1 - calls[::-1].index(target)
                if last_target < first_source:
                    found.add((rank, step, micro, phase, source, target, first_source,
                               last_target))
    return found


def bypassed_unit(trace: Trace) -> set[tuple]:
    """Rule 2: (rank, step, unit) for a non-root unit that began forward in none of the step's
    micro-steps, yet one of its parameters received a gradient during the step.

    Received: held at the boundary and written in the step (``grads_written``); where a
    (rank, step) has no ``grads_written`` rows, held is all there is.
    """
    roots = trace.units[trace.units["is_root"].fillna(False).astype(bool)]
    root_units = {(int(r), str(u)) for r, u in zip(roots["rank"], roots["unit"], strict=True)}
    forward = trace.events[trace.events["phase"].astype(str) == schema.FORWARD]
    ran = {(int(r), int(s), str(u)) for r, s, u in zip(forward["rank"], forward["step"],
                                                       forward["unit"], strict=True)}
    written = trace.grads_written
    judged = {(int(r), int(s)) for r, s in zip(written["rank"], written["step"], strict=True)}
    fresh = {(int(r), int(s), str(u), str(p)) for r, s, u, p, w in zip(
        written["rank"], written["step"], written["unit"], written["param"], written["written"],
        strict=True) if w}
    grads = trace.gradients[trace.gradients["has_grad"].fillna(False).astype(bool)]
    return {(int(r), int(s), str(u)) for r, s, u, p in zip(grads["rank"], grads["step"],
                                                          grads["unit"], grads["param"],
                                                          strict=True)
            if (int(r), str(u)) not in root_units and (int(r), int(s), str(u)) not in ran
            and ((int(r), int(s)) not in judged or (int(r), int(s), str(u), str(p)) in fresh)}


def unit_set(trace: Trace, rank: int) -> frozenset[str]:
    units = trace.units
    return frozenset(units.loc[units["rank"] == rank, "unit"].astype(str))


def _references(values: dict[int, object]) -> dict[int, tuple[object, int]]:
    """Per rank whose value is not the majority's: (the value it is set against, the lowest
    rank holding that). With no strict majority every rank is set against another side: the
    side holding the lowest rank outside its own."""
    counts = Counter(values.values())
    best = max(counts.values())
    top = [v for v in counts if counts[v] == best]
    lowest = {v: min(r for r in values if values[r] == v) for v in counts}
    out = {}
    for rank, value in values.items():
        if len(top) == 1:
            if value != top[0]:
                out[rank] = (top[0], lowest[top[0]])
        else:
            other = min((v for v in counts if v != value), key=lambda v: lowest[v])
            out[rank] = (other, lowest[other])
    return out


def rank_divergence(trace: Trace) -> set[tuple]:
    """Rule 4: (rank, step, micro_step, phase, index, its unit, the majority's unit).

    Per (step, micro_step, phase) recorded on two or more ranks with the same units.
    """
    by_slot: dict[tuple, dict[int, tuple[str, ...]]] = {}
    for (rank, step, micro, phase), calls in passes(trace).items():
        by_slot.setdefault((unit_set(trace, rank), step, micro, phase), {})[rank] = tuple(calls)
    found = set()
    for (_, step, micro, phase), orders in by_slot.items():
        if len(orders) < 2:
            continue
        for rank, (reference, _) in _references(orders).items():
            assert isinstance(reference, tuple)
            order = orders[rank]
            index = next(i for i in range(max(len(order), len(reference)) + 1)
                         if _at(order, i) != _at(reference, i))
            found.add((rank, step, micro, phase, index, _at(order, index),
                       _at(reference, index)))
    return found


def _at(order: tuple[str, ...] | list[str], index: int) -> str:
    return order[index] if index < len(order) else "<end>"


def prefetch_config_divergence(trace: Trace) -> set[tuple]:
    """Rule 5: (rank, step, micro_step) where a rank's edges first differ from the majority of
    ranks with its units, once per distinct configuration of that rank.

    Compared at every (step, micro_step) where some rank took a snapshot, each rank by the
    snapshot it had in effect then.
    """
    prefetch = trace.prefetch
    times = sorted({(int(s), int(m)) for s, m in zip(prefetch["step"], prefetch["micro_step"],
                                                     strict=True)})
    ranks = sorted({int(r) for r in prefetch["rank"]})
    seen: set[tuple] = set()
    found = set()
    for step, micro in times:
        configs: dict[frozenset, dict[int, frozenset]] = {}
        for rank in ranks:
            if any((int(s), int(m)) <= (step, micro) for s, m in zip(
                    prefetch.loc[prefetch["rank"] == rank, "step"],
                    prefetch.loc[prefetch["rank"] == rank, "micro_step"], strict=True)):
                edges = edges_in_effect(trace, rank, step, micro)
                config = frozenset((u, p, tuple(t)) for (u, p), t in edges.items())
                configs.setdefault(unit_set(trace, rank), {})[rank] = config
        for group in configs.values():
            if len(group) < 2:
                continue
            for rank in sorted(_references(group)):
                config = group[rank]
                if (rank, config) not in seen:
                    seen.add((rank, config))
                    found.add((rank, step, micro))
    return found


def order_instability(trace: Trace) -> set[tuple]:
    """Rule 7: (rank, step, micro_step, index, its unit, the first order's unit) for a forward
    order that differs from the rank's first recorded forward order."""
    forward = {k: v for k, v in passes(trace).items() if k[3] == schema.FORWARD}
    first: dict[int, list[str]] = {}
    found = set()
    for (rank, step, micro, _), order in sorted(forward.items()):
        reference = first.setdefault(rank, order)
        if order != reference:
            index = next(i for i in range(max(len(order), len(reference)) + 1)
                         if _at(order, i) != _at(reference, i))
            found.add((rank, step, micro, index, _at(order, index), _at(reference, index)))
    return found


def gradient_divergence(trace: Trace) -> set[tuple]:
    """Rule 10: (rank, step, micro_step where its gradients began to differ, unit, parameters
    that differ), once per (rank, step, unit).

    Per (step, micro_step, unit) on two or more ranks with the same units: each rank's set of
    parameters with a gradient to reduce (received, carried, zero-filled) against the most
    common set. Slots told ``reduce_scatter_unused_params`` on every rank are not compared;
    a backward a rank stopped in is cut off.
    """
    stops = stop_points(trace)
    rows = trace.backward_grads.dropna(subset=["param"])
    sets: dict[tuple, dict[int, tuple[frozenset, frozenset, bool]]] = {}
    for (rank, step, micro, unit), mine in rows.groupby(["rank", "step", "micro_step", "unit"],
                                                      observed=True):
        rank, step, micro = int(rank), int(step), int(micro)
        if stops.get(rank) == ("pass", step, micro, schema.BACKWARD):
            continue
        state = mine["state"].astype(str)
        reduced = frozenset(mine.loc[state.isin(["received", "carried", "zero_filled"]),
                                     "param"].astype(str))
        received = frozenset(mine.loc[state == "received", "param"].astype(str))
        told = _setting_at(trace, rank, step, micro, str(unit),
                           "reduce_scatter_unused_params") == "true"
        sets.setdefault((unit_set(trace, rank), step, micro, str(unit)), {})[rank] = (
            reduced, received, told)
    first: dict[tuple, tuple[int, frozenset, frozenset]] = {}
    began: dict[tuple, int] = {}
    for (_, step, micro, unit), by_rank in sorted(sets.items(), key=lambda kv: kv[0][1:]):
        if len(by_rank) < 2 or all(told for _, _, told in by_rank.values()):
            continue
        references = _references({r: v[0] for r, v in by_rank.items()})
        for rank, (reduced, received, _) in by_rank.items():
            key = (rank, step, unit)
            reference, reference_rank = references.get(
                rank, (reduced, min(r for r, v in by_rank.items() if v[0] == reduced)))
            if received != by_rank[reference_rank][1]:
                began[key] = min(began.get(key, micro), micro)
            if reduced != reference and key not in first:
                first[key] = (micro, reduced, reference)
    found = set()
    for (rank, step, unit), (micro, reduced, reference) in first.items():
        differ = sorted(reduced - reference) + sorted(reference - reduced)
        found.add((rank, step, began.get((rank, step, unit), micro), unit, ", ".join(differ)))
    return found


def _setting_at(trace: Trace, rank: int, step: int, micro: int, unit: str, setting: str
                ) -> str | None:
    """The value in effect: the last row at or before (step, micro) for the rank and unit."""
    rows = trace.settings
    mine = rows[(rows["rank"] == rank) & (rows["unit"].astype(str) == unit)
                & (rows["setting"].astype(str) == setting)]
    # Rows are in recording order: the last one at or before (step, micro) is in effect.
    at = [v for s, m, v in zip(mine["step"], mine["micro_step"], mine["value"], strict=True)
          if (int(s), int(m)) <= (step, micro)]
    return None if not at or pd.isna(at[-1]) else str(at[-1])


def eval_divergence(trace: Trace) -> set[tuple]:
    """Rule 11: (rank, interval, index of the first difference, its unit, the majority's unit).

    A rank's eval interval ``k`` is its eval forwards' units in order; it reached the interval
    if it trained in step ``k``, passed boundary ``k-1``, or ran an eval forward there. The
    interval a rank stopped in (or was about to begin, stopped at boundary ``k-1``) is cut off.
    """
    stops = stop_points(trace)
    cut = {(r, p[1]) for r, p in stops.items() if p[0] == "eval"}
    cut |= {(r, p[1] + 1) for r, p in stops.items() if p[0] == "boundary"}
    evals = trace.eval_forwards.sort_values(["rank", "seq"])
    reached = {(int(r), int(s)) for r, s in zip(trace.events["rank"], trace.events["step"],
                                                strict=True)}
    reached |= {(int(r), int(s) + 1) for r, s in zip(trace.gradients["rank"],
                                                      trace.gradients["step"], strict=True)}
    reached |= {(int(r), int(s)) for r, s in zip(evals["rank"], evals["step"], strict=True)}
    intervals: dict[tuple, dict[int, tuple[str, ...]]] = {}
    for rank, step in reached - cut:
        mine = evals[(evals["rank"] == rank) & (evals["step"] == step)]
        intervals.setdefault((unit_set(trace, rank), step), {})[rank] = tuple(
            mine["unit"].astype(str))
    found = set()
    for (_, step), by_rank in intervals.items():
        if len(by_rank) < 2:
            continue
        for rank, (reference, _) in _references(by_rank).items():
            assert isinstance(reference, tuple)
            interval = by_rank[rank]
            index = next(i for i in range(max(len(interval), len(reference)) + 1)
                         if _at(interval, i) != _at(reference, i))
            found.add((rank, step, index, _at(interval, index), _at(reference, index)))
    return found


# Settings one call changes together: one cause, one finding (their names joined).
LINKED = {"requires_all_reduce": "requires_gradient_sync"}


def setting_divergence(trace: Trace) -> set[tuple]:
    """Rule 12: (rank, step, micro_step, unit, setting(s)) where a rank's value differs from
    the most common value among ranks with its units.

    Compared where some rank's setting changed (a row), at a point every compared rank
    recorded: a micro-step a rank ran but the pass it stopped in; in a backward it stopped in,
    the units whose post-backward it recorded (``backward_grads`` rows). Settings one call
    changes together are one finding, their names joined in the contract's order.
    """
    stops = stop_points(trace)
    ran = {(int(r), int(s), int(m)) for r, s, m in zip(
        trace.events["rank"], trace.events["step"], trace.events["micro_step"], strict=True)}
    ran -= {(r, p[1], p[2]) for r, p in stops.items() if p[0] == "pass"}
    grads = trace.backward_grads
    reached = {(int(r), int(s), int(m), str(u)) for r, s, m, u in zip(
        grads["rank"], grads["step"], grads["micro_step"], grads["unit"], strict=True)
        if stops.get(int(r)) == ("pass", int(s), int(m), schema.BACKWARD)}
    rows = trace.settings
    changed = {(int(s), int(m), str(u), str(n)) for s, m, u, n in zip(
        rows["step"], rows["micro_step"], rows["unit"], rows["setting"], strict=True)}
    differ: dict[tuple, list[str]] = {}
    for step, micro, unit, setting in changed:
        values: dict[frozenset, dict[int, str]] = {}
        compared = {r for r, s, m in ran if (s, m) == (step, micro)}
        compared |= {r for r, s, m, u in reached if (s, m, u) == (step, micro, unit)}
        for rank in sorted(compared):
            value = _setting_at(trace, rank, step, micro, unit, setting)
            if value is not None:
                values.setdefault(unit_set(trace, rank), {})[rank] = value
        for by_rank in values.values():
            if len(by_rank) < 2:
                continue
            for rank in _references(by_rank):
                cause = LINKED.get(setting, setting)
                differ.setdefault((rank, step, micro, unit, cause), []).append(setting)
    return {(*key[:4], ", ".join(sorted(names, key=schema.SETTING_NAMES.index)))
            for key, names in differ.items()}


def as_frame(found: set[tuple], columns: list[str]) -> pd.DataFrame:
    """For failure messages: the spec's findings as a sorted frame."""
    return pd.DataFrame(sorted(found, key=str), columns=columns)
