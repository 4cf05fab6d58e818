"""Check 5, prefetch-config-divergence: ranks with the same units but different edges."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import ACROSS_RANKS, Check, Merged
from fsdptrace.checks.kernel.columns import first_mask, fold
from fsdptrace.checks.kernel.majority import against_majority, compared_with
from fsdptrace.reading import keys
from fsdptrace.reading.keys import step_key

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables

NAME = "prefetch-config-divergence"
SEVERITY = findings.ERROR
_SNAPSHOT = ["rank", "step", "micro_step"]


def config_signatures(tables: RankTables) -> pd.DataFrame:
    """One hash per recorded snapshot of a rank's edges: (rank, step, micro_step, signature).

    Each distinct edge's text is hashed once; a snapshot sums its edges' hashes.
    """
    prefetch = tables.prefetch
    if not len(prefetch):
        return pd.DataFrame(columns=_SNAPSHOT + ["signature"])
    (snapshot,) = fold([[prefetch[c]] for c in _SNAPSHOT])
    snap_codes, _ = pd.factorize(snapshot)  # first-appearance order, like drop_duplicates
    first = np.flatnonzero(first_mask(snap_codes))
    edges = np.flatnonzero(prefetch["target"] >= 0)
    hashed = _edge_hashes(tables, edges)
    sums = np.zeros(len(first), dtype=np.uint64)
    np.add.at(sums, snap_codes[edges], hashed.astype(np.uint64))
    return pd.DataFrame({"rank": prefetch["rank"][first].astype(np.int64),
                         "step": prefetch["step"][first].astype(np.int32),
                         "micro_step": prefetch["micro_step"][first].astype(np.int32),
                         "signature": sums})


def _edge_hashes(tables: RankTables, edges: np.ndarray) -> np.ndarray:
    """``hash_array`` of each edge's "unit, phase, target, index" text, per distinct edge."""
    prefetch, names = tables.prefetch, tables.vocab.names
    if not len(edges):
        return np.zeros(0, dtype=np.uint64)
    index_codes, index_values = pd.factorize(prefetch["target_index"][edges])
    columns = [prefetch[c][edges] for c in ("unit", "phase", "target")] + [index_codes]
    (key,) = fold([[c] for c in columns])
    edge_codes, _ = pd.factorize(key)
    distinct = np.flatnonzero(first_mask(edge_codes))
    index_text = np.asarray(index_values).astype(str)
    text = np.array(["\x1f".join((names[u], names[p], names[t], index_text[i])) for u, p, t, i
                     in zip(*(c[distinct].tolist() for c in columns), strict=True)],
                    dtype=object)
    return pd.util.hash_array(text)[edge_codes]


def effective(signatures: pd.DataFrame) -> pd.DataFrame:
    """Each rank's configuration at every (step, micro_step) where any rank took a snapshot.

    Adds ``snap_step``/``snap_micro``: the rank's own snapshot in effect then.
    """
    keys = signatures[["step", "micro_step"]].drop_duplicates()
    ranks = signatures[["rank"]].drop_duplicates()
    grid = ranks.merge(keys, how="cross")
    grid["key"] = step_key(grid["step"], grid["micro_step"])
    own = signatures.rename(columns={"step": "snap_step", "micro_step": "snap_micro"})
    own = own.assign(key=step_key(own["snap_step"], own["snap_micro"]))
    merged = pd.merge_asof(grid.sort_values("key"), own.sort_values("key"), on="key", by="rank",
                           direction="backward")
    return merged.dropna(subset=["snap_step"]).drop(columns="key")


def _target_lists(prefetch: pd.DataFrame) -> pd.DataFrame:
    """Per snapshot and (unit, phase): the configured targets as ``[a, b]`` text."""
    ordered = prefetch.sort_values(["unit", "phase", "target_index"])
    lists = ordered.groupby(_SNAPSHOT + ["unit", "phase"], sort=True)["target"].agg(
        lambda t: "[" + ", ".join(map(str, t)) + "]")
    return lists.rename("targets").reset_index()


def _compared(plain: pd.DataFrame, odd: pd.DataFrame) -> pd.DataFrame:
    """Only the snapshots the differences are spelled out from: each odd rank's and its
    reference's (every rank's edges at every snapshot would be listed for nothing)."""
    own = odd[["rank", "snap_step", "snap_micro"]]
    ref = odd[["reference_rank", "ref_snap_step", "ref_snap_micro"]]
    needed = pd.concat([own.set_axis(_SNAPSHOT, axis=1), ref.set_axis(_SNAPSHOT, axis=1)])
    needed = needed.dropna().astype("int64")
    return plain[keys.isin(plain.assign(step=plain["step"].astype("int64"),
                                        micro_step=plain["micro_step"].astype("int64")),
                           needed, _SNAPSHOT)]


def _differences(odd: pd.DataFrame, lists: pd.DataFrame) -> pd.Series:
    """For each odd row, the edges that differ from its reference rank, as one text."""
    left = odd[["rank", "snap_step", "snap_micro", "reference_rank", "ref_snap_step",
                "ref_snap_micro"]].merge(
        lists.rename(columns={"step": "snap_step", "micro_step": "snap_micro"}),
        on=["rank", "snap_step", "snap_micro"], how="left")
    right = lists.rename(columns={"rank": "reference_rank", "step": "ref_snap_step",
                                  "micro_step": "ref_snap_micro", "targets": "ref_targets"})
    keys = ["reference_rank", "ref_snap_step", "ref_snap_micro"]
    pairs = odd[["rank", "snap_step", "snap_micro"] + keys].merge(right, on=keys, how="left")
    both = left.merge(pairs, on=["rank", "snap_step", "snap_micro"] + keys + ["unit", "phase"],
                      how="outer")
    both = both[both["targets"].fillna("[]") != both["ref_targets"].fillna("[]")]
    both["line"] = (both["unit"] + " " + both["phase"] + " -> " + both["targets"].fillna("[]")
                    + " (rank " + both["reference_rank"].astype(str) + ": "
                    + both["ref_targets"].fillna("[]") + ")")
    lines = both.groupby("rank", sort=False)["line"].agg(lambda ls: "; ".join(ls))
    return odd["rank"].map(lines).fillna("edges differ")


def check(merged: Merged) -> pd.DataFrame:
    """Configuration signatures compared; edges re-read only when some differ."""
    config = merged.config_signatures
    if len(set(config.get("signature", []))) <= 1:
        return findings.empty()
    return compare(config, merged.unit_sets, merged.fetch_prefetch)


def compare(signatures: pd.DataFrame, unit_sets: pd.DataFrame,
            fetch_prefetch: Callable[[list[int]], pd.DataFrame]) -> pd.DataFrame:
    """Compare the snapshots ranks recorded at the same (step, micro_step).

    ``fetch_prefetch(ranks)``: the edges of those ranks, asked only for the odd ranks and
    their references (re-reading every rank's edges would cost a whole run's worth of reads).
    """
    if not len(signatures):
        return findings.empty()
    sigs = effective(signatures).merge(
        unit_sets.assign(rank=unit_sets["rank"].astype("int64")), on="rank")
    slot = ["unit_set", "step", "micro_step"]
    odd = against_majority(sigs, slot, "signature")
    # One finding per rank and distinct configuration, at the first step it was seen.
    odd = odd.sort_values(["rank", "step", "micro_step"]).drop_duplicates(["rank", "signature"])
    if not len(odd):
        return findings.empty()
    reference = effective(signatures)[["rank", "step", "micro_step", "snap_step", "snap_micro"]]
    reference = reference.rename(columns={"rank": "reference_rank", "snap_step": "ref_snap_step",
                                          "snap_micro": "ref_snap_micro"})
    odd = odd.merge(reference, on=["reference_rank", "step", "micro_step"], how="left")
    needed = pd.concat([odd["rank"], odd["reference_rank"]]).dropna()
    prefetch = fetch_prefetch(sorted({int(r) for r in needed}))
    plain = prefetch.dropna(subset=["target"]).assign(
        rank=lambda f: f["rank"].astype("int64"), unit=lambda f: f["unit"].astype(str),
        phase=lambda f: f["phase"].astype(str), target=lambda f: f["target"].astype(str))
    odd["diff"] = _differences(odd, _target_lists(_compared(plain, odd))).to_numpy()
    message = ("rank " + odd["rank"].astype(str) + " prefetch edges (from step "
               + odd["step"].astype(str) + ") differ from " + compared_with(odd) + ": "
               + odd["diff"]
               + "; configure prefetch identically on every rank")
    return findings.make(NAME, SEVERITY, odd, message)


CHECK = Check(5, NAME, SEVERITY, ACROSS_RANKS, "ranks configured different prefetch edges",
              check)
