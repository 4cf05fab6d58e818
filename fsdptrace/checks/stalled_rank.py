"""Check 6, stalled-rank: ranks whose recording did not end clean, or is missing, root cause first.

After a hang this is what a person needs first: which rank caused it, where, and why. The
rank that waited is rarely the one that diverged, so the verdict looks for a cause first
(``CAUSE_FINDERS``: a divergence at or before the earliest stop, including inside the stopped
passes), then for the rank furthest behind, and only then says the ranks stopped at the same
place (a stall inside that unit's collective or below it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import ACROSS_RANKS, Check, Merged
from fsdptrace.checks.kernel import skipped_passes, stops
from fsdptrace.checks.kernel.collective_counts import collective_count_differences
from fsdptrace.checks.kernel.majority import (
    NO_MAJORITY,
    against_majority,
    compared_with,
    ranks_text,
)
from fsdptrace.checks.kernel.order import END, GROUP, UNIT_SEP, first_difference_of
from fsdptrace.reading import endings

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables

NAME = "stalled-rank"
SEVERITY = findings.ERROR
# The cross-rank checks whose errors are causes (docs/checks.md 6.1), by number.
CAUSE_CHECKS = (4, 5, 10, 11, 12)
_STOPPED = ["rank", "kind", "step", "micro_step", "phase", "position", "unit"]
_SEP = "\x1f"
_US = "\x1e"
# Summary rows that carry a pass's collectives (``_collective_sequences``), not a stop.
COLLECTIVES = "collectives"


@dataclass(frozen=True)
class Cause:
    """The first divergence a finder saw: its place (``keys.place_key``), the ranks outside
    the majority (every rank with a tie), and what they did, in words."""

    place: int
    ranks: tuple[int, ...]
    tied: bool
    what: str


def summarize(tables: RankTables) -> pd.DataFrame:
    """The passes (or eval interval) the rank stopped in, as recorded: what the verdict
    compares across ranks over the part every rank recorded."""
    stopped = stops.stopped(tables.stops, tables.closed)
    parts = []
    for stop in stopped.itertuples(index=False):
        if stop.kind == stops.PASS:
            parts.append(tables.orders_of_stopped(stop.rank, stop.step, stop.micro_step,
                                                  stop.phase).assign(kind=stops.PASS))
        elif stop.kind == stops.EVAL:
            evals = tables.frame("eval_forwards")
            mine = evals[(evals["rank"] == stop.rank) & (evals["step"] == stop.step)]
            mine = mine.sort_values("seq")
            parts.append(pd.DataFrame({"rank": stop.rank, "kind": stops.EVAL,
                                       "step": stop.step, "micro_step": None, "phase": None,
                                       "position": np.arange(len(mine)),
                                       "unit": mine["unit"].astype(str).to_numpy()}))
    counted = _collective_sequences(tables)
    if not parts:
        return counted if len(counted) else pd.DataFrame(columns=_STOPPED)
    out = pd.concat(parts, ignore_index=True)
    out = out.assign(rank=out["rank"].astype("int64"), unit=out["unit"].astype(str))[_STOPPED]
    return pd.concat([out, counted], ignore_index=True) if len(counted) else out


def _collective_sequences(tables: RankTables) -> pd.DataFrame:
    """One row per (pass, process group) of the rank's recorded collectives, ``kind``
    ``COLLECTIVES``, its calls joined in ``unit`` as "unit<US>kind" (what the reduce step needs
    to count them and name the one with no partner; eval collectives belong to eval intervals)."""
    if not tables.sizes.get("collectives"):
        return pd.DataFrame(columns=[*_STOPPED, "group"])
    rows = tables.frame("collectives")
    rows = rows[rows["phase"].astype(str).isin(["forward", "backward"])
                & rows["micro_step"].notna()].sort_values("seq")
    if not len(rows):
        return pd.DataFrame(columns=[*_STOPPED, "group"])
    calls = rows["unit"].astype(str) + _US + rows["kind"].astype(str)
    keyed = rows.assign(call=calls, group=rows["group"].astype(object).fillna("").astype(str),
                        rank=rows["rank"].astype("int64"), step=rows["step"].astype("int64"),
                        micro_step=rows["micro_step"].astype("int64"),
                        phase=rows["phase"].astype(str))
    out = keyed.groupby(["rank", "step", "micro_step", "phase", "group"], sort=True)["call"] \
        .agg(_SEP.join).rename("unit").reset_index()
    return out.assign(kind=COLLECTIVES, position=0)[[*_STOPPED, "group"]]


def check(merged: Merged) -> pd.DataFrame:
    """Every rank's ending (``fsdptrace.reading.endings``), where it stopped, and the verdict."""
    world_size = int(merged.meta["world_size"].max()) if len(merged.meta) else len(merged.ranks)
    missing = sorted(set(range(world_size)) - set(merged.ranks))
    if not missing and endings.clean_ranks(merged.ends, merged.ranks) >= set(merged.ranks):
        return findings.empty()  # every rank closed cleanly: the usual answer, without frames
    ends = endings.rank_endings(merged.ends, merged.ranks)[["rank", "ending", "detail"]]
    status = ends.merge(merged.last, on="rank", how="left")
    stalled = status[status["ending"] != endings.CLEAN].copy()
    rows = []
    if len(stalled):
        rows.append(_stalled(stalled, status, _cause(merged, stalled)))
    if missing:
        frame = pd.DataFrame({"rank": missing})
        message = ["rank " + str(r) + " of world size " + str(world_size) + " has no data on "
                   "disk: it never started recording, or its files were lost" for r in missing]
        rows.append(findings.make(NAME, SEVERITY, frame, message))
    return findings.combine(rows)


def _cause(merged: Merged, stalled: pd.DataFrame) -> Cause | None:
    """The earliest cause any finder sees at or before the earliest stop point."""
    known = stalled.dropna(subset=["kind"])
    if not len(known):
        return None
    earliest = int(known["place"].min())
    found = [c for finder in CAUSE_FINDERS for c in [finder(merged, known)] if c is not None]
    found = [c for c in found if c.place <= earliest]
    return min(found, key=lambda c: c.place) if found else None


def _from_divergence_checks(merged: Merged, stalled: pd.DataFrame) -> Cause | None:
    """docs/checks.md 6.1: an error of checks 4, 5, 10, 11 or 12 (their findings, placed)."""
    found = merged.divergences if merged.divergences is not None else _run_cause_checks(merged)
    if not len(found):
        return None
    located = found.assign(
        kind=np.where(found["check"] == "eval-divergence", stops.EVAL, stops.PASS),
        phase=found["phase"].astype(object).where(
            found["phase"].notna(),
            np.where(found["check"] == "gradient-divergence", "backward", "forward")))
    located = located.assign(place=stops.place(located)).sort_values(["place", "rank"])
    first = located[located["place"] == located["place"].iloc[0]]
    first = first[first["check"] == first["check"].iloc[0]]
    ranks = tuple(sorted({int(r) for r in first["rank"]}))
    tied = bool(first["message"].str.contains(NO_MAJORITY, regex=False).any())
    return Cause(int(first["place"].iloc[0]), ranks, tied,
                 f"{first['check'].iloc[0]}: {first['message'].iloc[0]}")


def _run_cause_checks(merged: Merged) -> pd.DataFrame:
    """The cause checks' findings, when the reduce step did not hand them over."""
    # The cause checks' own modules, not the registry (which lists this check: a circle).
    from fsdptrace.checks import (
        eval_divergence,
        gradient_divergence,
        prefetch_config_divergence,
        rank_divergence,
        setting_divergence,
    )

    causes = (rank_divergence.CHECK, prefetch_config_divergence.CHECK,
              gradient_divergence.CHECK, eval_divergence.CHECK, setting_divergence.CHECK)
    return findings.combine(c.run_across_ranks(merged) for c in causes
                            if c.number in CAUSE_CHECKS
                            and (c.summarize is None or c.name in merged.summaries))


def _from_stopped_passes(merged: Merged, stalled: pd.DataFrame) -> Cause | None:
    """docs/checks.md 6.1: the stopped passes (and eval intervals) compared over the part every
    rank recorded: a stopped order is known up to its stop, a complete one to its end."""
    mine = merged.summaries.get(NAME, pd.DataFrame(columns=_STOPPED))
    mine = mine[mine["kind"] != COLLECTIVES]
    causes = []
    for (kind, step, micro, phase), part in mine.groupby(
            ["kind", "step", "micro_step", "phase"], dropna=False, sort=True):
        others = _complete_orders(merged, kind, step, micro, phase, set(part["rank"]))
        cause = _compare_prefix(part, others, kind, step, micro, phase, merged.unit_sets)
        if cause is not None:
            causes.append(cause)
    return min(causes, key=lambda c: c.place) if causes else None


def _complete_orders(merged: Merged, kind: str, step: int, micro: object, phase: object,
                     stopped: set[int]) -> dict[int, list[str]]:
    """Every other rank's complete order of the same pass (or eval interval)."""
    if kind == stops.EVAL:
        intervals = merged.summaries.get("eval-divergence", pd.DataFrame(
            columns=["rank", "step", "interval"]))
        rows = intervals[intervals["step"] == step]
        return {int(r): (t.split(_SEP) if t else []) for r, t in zip(
            rows["rank"], rows["interval"], strict=True) if int(r) not in stopped}
    others = [r for r in merged.ranks if r not in stopped]
    if not others:
        return {}
    wanted = pd.DataFrame({"rank": others, "step": step, "micro_step": int(micro),  # type: ignore[call-overload]
                           "phase": phase})
    orders = merged.fetch_orders(others, wanted[GROUP])
    if not len(orders):
        return {}
    orders = orders.sort_values(["rank", "position"])
    return {int(r): list(g["unit"].astype(str)) for r, g in orders.groupby("rank")}


def _compare_prefix(part: pd.DataFrame, others: dict[int, list[str]], kind: str, step: int,
                    micro: object, phase: object, unit_sets: pd.DataFrame) -> Cause | None:
    stopped = {int(r): list(g.sort_values("position")["unit"]) for r, g in part.groupby("rank")}
    length = min(len(o) for o in stopped.values())
    # A complete order ended where a stopped one went on: that end is a fact, so pad it.
    orders = {r: tuple((o + [END] * length)[:length]) for r, o in {**others, **stopped}.items()}
    rows = pd.DataFrame({"rank": list(orders), "order": [_SEP.join(o) for o in orders.values()]})
    rows = rows.merge(unit_sets.assign(rank=unit_sets["rank"].astype("int64")), on="rank") \
        if len(unit_sets) else rows.assign(unit_set=0)
    differs = against_majority(rows, ["unit_set"], "order")
    if not len(differs):
        return None
    firsts = [first_difference_of(orders[int(r)], ref.split(_SEP))
              for r, ref in zip(differs["rank"], differs["reference"], strict=True)]
    at = min(range(len(firsts)), key=lambda i: (firsts[i][0], int(differs["rank"].iloc[i])))
    index, mine, theirs = firsts[at]
    where = (f"eval interval {step}" if kind == stops.EVAL
             else f"step {step}, micro-step {int(micro)}, {phase}")  # type: ignore[call-overload]
    what = (f"inside the stopped {'eval interval' if kind == stops.EVAL else 'pass'} ({where}, "
            f"compared over the {length} call(s) every rank recorded): rank "
            f"{int(differs['rank'].iloc[at])} ran {mine} at index {index} where "
            f"{compared_with(differs.iloc[[at]]).iloc[0]} ran {theirs}")
    place = stops.place(pd.DataFrame({"kind": [kind], "step": [step], "micro_step": [micro],
                                      "phase": [phase], "position": [index]})).iloc[0]
    tied = bool(differs["tied"].astype(bool).any())
    return Cause(int(place), tuple(sorted(int(r) for r in differs["rank"])), tied, what)


def _from_collective_counts(merged: Merged, stalled: pd.DataFrame) -> Cause | None:
    """docs/checks.md 6.1: a rank that issued a different number of collectives in the same pass.

    Counted over the passes no compared rank stopped in (a stopped pass is short by design)
    and before the earliest stop; a run dir recorded without the ``collectives`` table has
    nothing to count.
    """
    mine = merged.summaries.get(NAME, pd.DataFrame(columns=_STOPPED))
    if "group" not in mine.columns:
        return None
    counted = mine[mine["kind"] == COLLECTIVES]
    if not len(counted):
        return None
    cut = {(int(s), int(m), str(p)) for s, m, p in zip(
        stalled["step"], stalled["micro_step"].fillna(-1), stalled["phase"], strict=True)
        if pd.notna(s)}
    calls = []
    for row in counted.itertuples(index=False):
        if (int(row.step), int(row.micro_step), str(row.phase)) in cut:
            continue
        for index, call in enumerate(str(row.unit).split(_SEP)):
            unit, _, kind = call.partition(_US)
            calls.append((int(row.rank), index, int(row.step), int(row.micro_step),
                          str(row.phase), str(row.group), unit, kind))
    if not calls:
        return None
    table = pd.DataFrame(calls, columns=["rank", "seq", "step", "micro_step", "phase", "group",
                                         "unit", "kind"])
    differs = collective_count_differences(table)
    if not len(differs):
        return None
    # Placed at the end of its pass: an order divergence in the same pass names both sides'
    # units and comes first; a count that differs in an earlier pass still wins.
    located = differs.assign(place=stops.place(differs.assign(kind=stops.PASS,
                                                             position=1 << 30)))
    located = located.sort_values(["place", "rank"])
    first = located[located["place"] == located["place"].iloc[0]]
    first = first[first["group"] == first["group"].iloc[0]]
    ranks = tuple(sorted(int(r) for r in first["rank"]))
    compared = table[(table["step"] == first["step"].iloc[0])
                     & (table["micro_step"] == first["micro_step"].iloc[0])
                     & (table["phase"] == first["phase"].iloc[0])]["rank"].nunique()
    tied = len(ranks) == compared
    row = first.iloc[0]
    what = (f"collective count: in step {int(row['step'])}, micro-step "
            f"{int(row['micro_step'])}, {row['phase']}, rank {int(row['rank'])} issued "
            f"{int(row['count'])} FSDP collective(s) on process group {row['group'] or '?'} "
            f"where {row['others']}; the first without a partner is the {row['kind']} of "
            f"{row['unit']} (call {int(row['index'])} of the pass)")
    return Cause(int(row["place"]), ranks, tied, what)


def _from_skipped_passes(merged: Merged, stalled: pd.DataFrame) -> Cause | None:
    """docs/checks.md 6.1: a pass some ranks ran and others went past, or ended cleanly
    before, without recording any of it (``kernel.skipped_passes``): a backward left out, a
    micro-step more or fewer, a rank that stopped training early."""
    inside = stalled[stalled["kind"] == stops.PASS][["rank", "step", "micro_step", "phase"]]
    ended = endings.clean_ranks(merged.ends, merged.ranks)
    found = skipped_passes.first_skipped(merged.signatures, merged.unit_sets, merged.last,
                                         merged.incomplete, inside, ended,
                                         until=int(stalled["place"].min()))
    if found is None:
        return None
    ran, skipped = found.ran, found.skipped
    where = f"step {found.step}, micro-step {found.micro_step}, {found.phase}"
    total = len(ran) + len(skipped)
    last = merged.last[merged.last["rank"].astype("int64") == skipped[0]]
    left = ("ended its recording cleanly before it" if skipped[0] in ended
            and int(last["place"].iloc[0]) < found.place else "went on past it")
    left += f" (rank {skipped[0]}'s last record: {stops.describe(last).iloc[0]})"
    if len(skipped) < len(ran):
        culprits, tied = skipped, False
        what = (f"{ranks_text(skipped)} recorded nothing of {where} and {left} where "
                f"{len(ran)} of {total} ranks (e.g. rank {ran[0]}) ran it")
    elif len(ran) < len(skipped):
        culprits, tied = ran, False
        what = (f"{ranks_text(ran)} ran {where} where {len(skipped)} of {total} ranks (e.g. "
                f"rank {skipped[0]}) recorded nothing of it and {left}")
    else:
        culprits, tied = sorted(ran + skipped), True
        what = (f"{ranks_text(ran)} ran {where}; {ranks_text(skipped)} recorded nothing of it "
                f"and {left} ({NO_MAJORITY}: the {total} ranks disagree; neither side is the "
                "outlier by its rank number)")
    return Cause(found.place, tuple(culprits), tied, "a pass skipped: " + what)


def _from_wrapping(merged: Merged, stalled: pd.DataFrame) -> Cause | None:
    """docs/checks.md 6.1: ranks that hold the model's parameters in other FSDP units than the
    others (a wrapping policy that differed between ranks): from the first step on, their
    collectives are other collectives. Ranks of one model hold the same parameter names
    (``order.param_sets``), so pipeline stages, which hold different ones, are not compared."""
    sets = merged.param_sets
    if not len(sets) or merged.unit_sets["unit_set"].nunique() < 2:  # one unit set: the usual
        return None
    rows = sets[sets["param_set"] != 0].merge(
        merged.unit_sets.assign(rank=merged.unit_sets["rank"].astype("int64")), on="rank")
    differs = against_majority(rows, ["param_set"], "unit_set")
    if not len(differs):
        return None
    first = differs.sort_values("rank").iloc[[0]]
    units = dict(zip(sets["rank"].astype("int64"), sets["units"].astype(str), strict=True))
    mine = set(units[int(first["rank"].iloc[0])].split(UNIT_SEP))
    theirs = set(units[int(first["reference_rank"].iloc[0])].split(UNIT_SEP))
    told = [f"no unit {', '.join(sorted(theirs - mine)[:5])}" if theirs - mine else "",
            f"unit{'s' if len(mine - theirs) > 1 else ''} "
            f"{', '.join(sorted(mine - theirs)[:5])} the others lack" if mine - theirs else ""]
    what = (f"FSDP units wrapped differently: rank {int(first['rank'].iloc[0])} holds the same "
            f"parameters as {compared_with(first).iloc[0]} in other units ("
            + "; ".join(t for t in told if t) + f": {len(mine)} units against {len(theirs)})")
    tied = bool(differs["tied"].astype(bool).any())
    # Place 0, before every stop point: the units differed before anything ran.
    return Cause(0, tuple(sorted(int(r) for r in differs["rank"])), tied, what)


CAUSE_FINDERS: tuple[Callable[[Merged, pd.DataFrame], Cause | None], ...] = (
    _from_divergence_checks,
    _from_stopped_passes,
    _from_collective_counts,
    _from_skipped_passes,
    _from_wrapping,
)


def _stalled(stalled: pd.DataFrame, status: pd.DataFrame, cause: Cause | None) -> pd.DataFrame:
    where = stops.describe(stalled)
    how = "ended without a clean close: " + endings.describe(stalled)
    head = "rank " + stalled["rank"].astype(str) + " " + how + "; stopped at " + where + "; "
    if cause is not None:
        return findings.make(NAME, SEVERITY, stalled, head + _caused(stalled, cause))
    same = _same_stop(stalled)
    if same is not None and (stalled["kind"] != stops.PASS).all():
        message = (head + "every rank that did not end cleanly stopped here, outside any FSDP "
                   "unit's pass: no rank diverged before the stop, so the stall (or the kill) "
                   "came between FSDP's collectives (the optimizer step, a checkpoint, data "
                   "loading, or a collective of the job's own)")
        return findings.make(NAME, SEVERITY, stalled, message)
    if same is not None:
        message = (head + "every rank that did not end cleanly stopped here: no rank diverged "
                   f"before the stop, so the stall is inside {same}'s collective (its "
                   "all-gather, or its reduce-scatter in backward) or below it (device, "
                   "network, a slow host)")
        return findings.make(NAME, SEVERITY, stalled, message)
    return findings.make(NAME, SEVERITY, stalled, head + _behind(stalled, status))


def _caused(stalled: pd.DataFrame, cause: Cause) -> pd.Series:
    ranks = ", ".join(map(str, cause.ranks))
    if cause.tied:
        lead = (f"root cause: the ranks diverged before the stop with no majority (ranks "
                f"{ranks} each differ from another side), first {cause.what}")
        tail = ("; every stop follows from it (the ranks waited for, or were aborted by, "
                "collectives that no longer matched)")
        return pd.Series(lead + tail, index=stalled.index)
    culprit = ("rank " if len(cause.ranks) == 1 else "ranks ") + ranks
    own = (f"root cause: this rank diverged before the stop (likely culprit), first "
           f"{cause.what}; the other ranks' stops follow from it (they waited for, or were "
           "aborted by, collectives that no longer matched)")
    other = (f"root cause: {culprit} diverged before the stop (likely culprit), first "
             f"{cause.what}; this rank's stop follows from it (it waited for, or was aborted "
             "by, collectives that no longer matched)")
    return pd.Series([own if int(r) in cause.ranks else other for r in stalled["rank"]],
                     index=stalled.index, dtype=object)


def _behind(stalled: pd.DataFrame, status: pd.DataFrame) -> pd.Series:
    """docs/checks.md 6.2: no divergence, different stop points: the rank(s) furthest behind."""
    place = stalled["place"].fillna(-1)
    behind = sorted(int(r) for r in stalled.loc[place == place.min(), "rank"])
    known = status.dropna(subset=["kind"])
    ahead = ""
    if len(known):
        furthest = known.loc[known["place"].astype("int64").idxmax()]
        ahead = (f"; the furthest rank ({int(furthest['rank'])}) reached "
                 + stops.describe(known.loc[[furthest.name]]).iloc[0])
    text = ("rank " if len(behind) == 1 else "ranks ") + ", ".join(map(str, behind))
    return pd.Series(
        ["no rank diverged before the stop; it is furthest behind (likely culprit of a hang)"
         + ahead if int(r) in behind else "no rank diverged before the stop; " + text
         + (" is" if len(behind) == 1 else " are") + " further behind (likely culprit)" + ahead
         for r in stalled["rank"]], index=stalled.index, dtype=object)


def _same_stop(stalled: pd.DataFrame) -> str | None:
    """The unit where every stalled rank stopped, when they all stopped at one place there
    (same pass, unit, position and call)."""
    if len(stalled) < 2 or stalled["kind"].isna().any():
        return None
    where = stalled[["kind", "step", "micro_step", "phase", "unit", "position", "call"]]
    where = where.astype(str).drop_duplicates()
    return str(where["unit"].iloc[0]) if len(where) == 1 else None


CHECK = Check(6, NAME, SEVERITY, ACROSS_RANKS, "rank stopped without a clean close, or missing",
              check, summarize=summarize)
