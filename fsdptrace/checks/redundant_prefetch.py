"""Check 9, redundant-prefetch: a configured prefetch that did nothing for a whole step.

FSDP2's ``unshard()`` returns early when the group is unsharded or its all-gather is pending,
so such an edge costs nothing but does nothing either. An edge that did its work at no call of
its source in an optimizer step, and was a no-op because something else had gathered its
target at one or more, is dead configuration that hides which edge really gathers the target;
one that did its work in some micro-step is not. A no-op of a target that stays unsharded by
design (``reshard_after_forward=False``, ``reshard_after_backward=False`` during accumulation,
from ``settings``) is neither work nor proof.
Only configured edges count (``issuer_kind == 'prefetch'``); FSDP2's implicit prefetch is not
configuration. Needs the ``allgathers`` table.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import PER_RANK, Check
from fsdptrace.checks.kernel.settings import value_at
from fsdptrace.reading.allgathers import (
    call_occurrences,
    issuer_words,
    plain,
    row_codes,
    text_codes,
)

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables

NAME = "redundant-prefetch"
SEVERITY = findings.WARNING
_STATES = {"pending": "its all-gather was already pending", "unsharded": "it was already unsharded"}


def check(tables: RankTables) -> pd.DataFrame:
    """Dead edges, outside optimizer steps the writer lost all-gather rows of."""
    if not tables.sizes["allgathers"]:
        return findings.empty()
    found = redundant(tables.frame("allgathers"), tables.frame("events"),
                      settings=tables.frame("settings"))
    return tables.drop_lost(found, "allgathers", whole_steps=True)


_EDGE = ["rank", "step", "phase", "issuer_unit", "unit"]


def redundant(allgathers: pd.DataFrame, events: pd.DataFrame, *,
              settings: pd.DataFrame | None = None) -> pd.DataFrame:
    """One finding per (rank, step, edge) that did no work in the step and was a no-op FSDP2
    made of a target gathered by something else at one call or more."""
    if not len(allgathers) or not ((allgathers["issuer_kind"] == "prefetch")
                                   & (allgathers["event"] == "noop")).any():
        return findings.empty()  # no prefetch was a no-op: no edge is dead
    # The edges on arrays; only the rows of dead edges become text.
    event = allgathers["event"]
    tried = np.flatnonzero(((allgathers["issuer_kind"] == "prefetch")
                            & event.isin(["issue", "noop"])).to_numpy())
    noop = ((event == "noop") & allgathers["detail"].isin(list(_STATES))).to_numpy()[tried]
    design = np.zeros(len(tried), dtype=bool)
    maybe = noop & (allgathers["detail"] == "unsharded").to_numpy()[tried]
    if maybe.any() and settings is not None:
        design[maybe] = _by_design(plain(allgathers.iloc[tried[maybe]]), settings).to_numpy()
    # A by-design no-op is neither work nor proof: the edge is dead when it did no work at
    # any call of the step and was a no-op for another reason at one or more.
    _, edge = np.unique(np.stack([row_codes(allgathers[c])[tried] for c in _EDGE]), axis=1,
                        return_inverse=True)
    edge = edge.reshape(-1)
    worked = np.bincount(edge, weights=~noop) > 0
    proof = np.bincount(edge, weights=noop & ~design) > 0
    dead = (~worked & proof)[edge]
    if not (dead & noop & ~design).any():
        return findings.empty()
    return _dead_edges(allgathers, events, tried[dead], noop[dead] & ~design[dead],
                       design[dead])


def _dead_edges(allgathers: pd.DataFrame, events: pd.DataFrame, tried: np.ndarray,
                proof: np.ndarray, by_design: np.ndarray) -> pd.DataFrame:
    """One finding per dead edge, from the positions of its tried rows (``tried``): which of
    them are no-ops that prove it dead (``proof``), which no-ops by design (``by_design``).

    In plain Python over the reported rows only (a handful in a run), where each pandas join
    or group-by would cost milliseconds.
    """
    rows = {c: allgathers[c].to_numpy()[tried].tolist()
            for c in ("rank", "step", "micro_step", "phase", "issuer_unit", "unit", "group",
                      "seq", "detail")}
    for c in ("phase", "issuer_unit", "unit", "detail"):
        rows[c] = [str(v) for v in rows[c]]
    edge_of = list(zip(*(rows[c] for c in _EDGE), strict=True))
    designed = dict.fromkeys(edge_of, 0)
    for key, design in zip(edge_of, by_design.tolist(), strict=True):
        designed[key] += design
    at = np.flatnonzero(proof)
    at = at[np.argsort(np.asarray(rows["seq"])[at], kind="stable")].tolist()
    occurrence, _ = call_occurrences(
        events, *(np.asarray([rows[c][i] for i in at], dtype=object if c in
                             ("phase", "issuer_unit") else np.int64)
                  for c in ("rank", "step", "micro_step", "phase", "issuer_unit", "seq")))
    gathered_by = _gatherers(allgathers, tried)
    edges: dict[tuple, dict] = {}
    for i, call in zip(at, occurrence.tolist(), strict=True):
        micro = rows["micro_step"][i]
        edge = edges.setdefault(edge_of[i], {"micro_step": micro, "detail": rows["detail"][i],
                                             "calls": set(), "micro_steps": set(), "by": {}})
        edge["calls"].add((micro, call))
        edge["micro_steps"].add(micro)
        edge["by"][gathered_by(rows["rank"][i], rows["unit"][i], rows["group"][i],
                               rows["seq"][i])] = None
    located = [{"rank": rank, "step": step, "micro_step": edge["micro_step"], "phase": phase,
                "unit": issuer, "target": target}
               for (rank, step, phase, issuer, target), edge in edges.items()]
    return findings.make(NAME, SEVERITY, pd.DataFrame(located, columns=list(located[0])),
                         [_message(key, edge, designed[key]) for key, edge in edges.items()])


def _message(key: tuple, edge: dict, num_by_design: int) -> str:
    _, step, phase, issuer, target = key
    design = (f"; at {num_by_design} other call(s) {target} stayed unsharded by design "
              "(neither work nor proof)" if num_by_design else "")
    return (f"{issuer}'s {phase} prefetch of {target} did nothing in step {step}: at "
            f"{len(edge['calls'])} call(s) of {issuer} in {len(edge['micro_steps'])} "
            f"micro-step(s), {_STATES[edge['detail']]} (gathered by {', '.join(edge['by'])}), "
            f"so its unshard returned at once (a no-op){design}; it did its work at no call: "
            f"dead configuration; remove {target} from {issuer}'s {phase} prefetch targets, "
            "or fix the edge that gathers it")


def _gatherers(allgathers: pd.DataFrame, tried: np.ndarray) -> Callable[..., str]:
    """Who issued the all-gather that made a no-op of a prefetch: the latest issue of its
    (rank, unit, group) at or before the no-op's seq, in words."""
    units = text_codes(allgathers["unit"])
    issued = np.flatnonzero((allgathers["event"] == "issue").to_numpy()
                            & np.isin(units, units[tried]))
    columns = [allgathers[c].to_numpy()[issued].tolist()
               for c in ("rank", "unit", "group", "seq", "issuer_kind", "issuer_unit")]
    gathers: dict[tuple, list[tuple[int, str]]] = {}
    for rank, unit, group, seq, kind, source in zip(*columns, strict=True):
        gathers.setdefault((rank, str(unit), group), []).append(
            (seq, issuer_words(str(kind), str(source))))
    # Per (rank, unit, group): its issues' seqs in order, and who issued each, in words.
    issues = {key: tuple(zip(*sorted(found), strict=True)) for key, found in gathers.items()}

    def gathered_by(rank: int, unit: str, group: int, seq: int) -> str:
        seqs, words = issues.get((rank, unit, group), ((), ()))
        at = bisect.bisect_right(seqs, seq)
        return words[at - 1] if at else issuer_words("nan", "?")

    return gathered_by


def _by_design(tried: pd.DataFrame, settings: pd.DataFrame) -> pd.Series:
    """No-ops of a target left unsharded on purpose: ``reshard_after_forward`` false (its
    backward prefetch), ``reshard_after_backward`` false (the next micro-step's prefetches)."""
    unsharded = tried["detail"] == "unsharded"
    if not len(settings) or not unsharded.any():
        return pd.Series(False, index=tried.index)
    after_forward = value_at(settings, tried, "reshard_after_forward") == "false"
    earlier = tried.assign(micro_step=(tried["micro_step"] - 1).clip(lower=0))
    after_backward = ((value_at(settings, tried, "reshard_after_backward") == "false")
                      | ((value_at(settings, earlier, "reshard_after_backward") == "false")
                         & (tried["micro_step"] > 0)))
    return unsharded & (after_forward | after_backward)


CHECK = Check(9, NAME, SEVERITY, PER_RANK,
              "prefetch edge that was a no-op for a whole optimizer step", check)
