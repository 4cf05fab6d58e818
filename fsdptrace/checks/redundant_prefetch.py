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

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import PER_RANK, Check
from fsdptrace.checks.kernel.settings import value_at
from fsdptrace.reading.allgathers import (
    issuer_text,
    plain,
    row_codes,
    text_codes,
    with_occurrence,
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
    tried_rows = plain(allgathers.iloc[tried[dead]])
    noops = tried_rows[noop[dead] & ~design[dead]]
    num_by_design = pd.Series(design[dead], index=tried_rows.index).groupby(
        [tried_rows[c] for c in _EDGE]).sum().rename("num_by_design")
    units = text_codes(allgathers["unit"])
    rows = plain(allgathers[((event == "issue").to_numpy()
                             & np.isin(units, units[tried[dead]]))])
    noops = with_occurrence(_with_gatherer(noops, rows), events)
    gatherer = noops[["gatherer_kind", "gatherer_unit"]].set_axis(
        ["issuer_kind", "issuer_unit"], axis=1)
    noops = noops.assign(by=issuer_text(gatherer), calls=noops["micro_step"].astype(str) + ":"
                         + noops["occurrence"].astype(str))
    edges = noops.sort_values("seq").groupby(_EDGE, sort=False).agg(
        micro_step=("micro_step", "first"), detail=("detail", "first"),
        num_calls=("calls", "nunique"), num_micro_steps=("micro_step", "nunique"),
        by=("by", lambda b: ", ".join(dict.fromkeys(b)))).reset_index()
    edges = edges.merge(num_by_design.reset_index(), on=_EDGE, how="left")
    design_text = pd.Series(
        [f"; at {int(n)} other call(s) {target} stayed unsharded by design (neither work nor "
         "proof)" if n else "" for n, target in zip(edges["num_by_design"].fillna(0),
                                                    edges["unit"], strict=True)],
        index=edges.index, dtype=object)
    message = (edges["issuer_unit"] + "'s " + edges["phase"] + " prefetch of " + edges["unit"]
               + " did nothing in step " + edges["step"].astype(str) + ": at "
               + edges["num_calls"].astype(str) + " call(s) of " + edges["issuer_unit"]
               + " in " + edges["num_micro_steps"].astype(str) + " micro-step(s), "
               + edges["detail"].map(_STATES) + " (gathered by " + edges["by"]
               + "), so its unshard returned at once (a no-op)" + design_text
               + "; it did its work at no call: dead configuration; remove " + edges["unit"]
               + " from " + edges["issuer_unit"] + "'s " + edges["phase"]
               + " prefetch targets, or fix the edge that gathers it")
    located = edges.assign(target=edges["unit"], unit=edges["issuer_unit"])
    return findings.make(NAME, SEVERITY, located, message)


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


def _with_gatherer(noops: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
    """Who issued the all-gather that made this prefetch redundant (the latest issue before)."""
    issues = rows[rows["event"] == "issue"][["rank", "unit", "group", "seq", "issuer_kind",
                                             "issuer_unit"]]
    issues = issues.rename(columns={"seq": "gather_seq", "issuer_kind": "gatherer_kind",
                                    "issuer_unit": "gatherer_unit"}).sort_values("gather_seq")
    merged = pd.merge_asof(noops.sort_values("seq"), issues, left_on="seq",
                           right_on="gather_seq", by=["rank", "unit", "group"],
                           direction="backward")
    return merged.drop(columns="gather_seq")


CHECK = Check(9, NAME, SEVERITY, PER_RANK,
              "prefetch edge that was a no-op for a whole optimizer step", check)
