"""Check 12, setting-divergence: ranks with the same units run a micro-step with other settings.

One rank skipping gradient sync, keeping parameters unsharded or using another mesh shape
issues other collectives than its peers. Reads ``settings`` (a row per change): the value in
effect at a micro-step is the last row at or before it. Ranks are compared where some rank's
setting changed (between changes every rank's values stay as they were compared last), and
only at a point each compared rank recorded: a rank that stopped mid-backward is compared for
the units whose post-backward it reached, never with a value another rank recorded later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import ACROSS_RANKS, Check, Merged
from fsdptrace.checks.kernel import rank_runs
from fsdptrace.checks.kernel.columns import fold
from fsdptrace.checks.kernel.majority import against_majority, compared_with
from fsdptrace.checks.kernel.stops import cut_off_passes
from fsdptrace.reading import incomplete
from fsdptrace.reading.keys import step_key
from fsdptrace.store import schema

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables

NAME = "setting-divergence"
SEVERITY = findings.ERROR
_SUMMARY = ["rank", "step", "micro_step", "unit", "setting", "value"]
_SLOT = ["step", "micro_step", "unit", "setting"]
# What the map step keeps until the reduce: names and values as category codes (a few distinct
# texts, each held once), int32 keys. As text and object columns, 2,048 ranks kept ~37 MiB.
_DTYPES = {"rank": "int32", "step": "int32", "micro_step": "int32", "unit": "category",
           "setting": "category", "value": "category"}
# Settings one call changes together (``set_requires_gradient_sync`` flips
# ``requires_all_reduce`` too): one cause, reported as one finding under the first name.
_CAUSE = {"requires_all_reduce": "requires_gradient_sync"}


def summarize(tables: RankTables) -> pd.DataFrame:
    """The rank's settings rows (the last of each micro-step) and the points where its values
    can be compared (null ``setting``): a micro-step whose backward it completed (null
    ``unit``: every unit's backward), and in the pass it stopped in, each unit whose
    post-backward it recorded (the settings are read there). Kept as runs of ranks
    (``rank_runs``): every rank completes the same micro-steps and holds the same values."""
    if not tables.sizes["settings"]:
        return _empty()
    raw = tables.frame("settings")
    rows = pd.DataFrame({"rank": raw["rank"].astype("int64"), "step": raw["step"].astype("int64"),
                         "micro_step": raw["micro_step"].astype("int64"),
                         "unit": raw["unit"].astype(str), "setting": raw["setting"].astype(str),
                         "value": raw["value"].astype(object)})
    # Of several rows in one micro-step (a change between forward and backward), the last is
    # what the micro-step's collectives used.
    rows = rows.drop_duplicates(["rank", "step", "micro_step", "unit", "setting"], keep="last")
    points = [_completed_micro_steps(tables).assign(unit=None), _stopped_backwards(tables)]
    summary = pd.concat([rows, *(p.assign(setting=None, value=None) for p in points)],
                        ignore_index=True)[_SUMMARY].astype(_DTYPES)
    return rank_runs.code(summary, tables.unit_sets, _SLOT, ["value"])


def _empty() -> pd.DataFrame:
    return rank_runs.no_runs(_DTYPES, _SLOT, ["value"])


def _completed_micro_steps(tables: RankTables) -> pd.DataFrame:
    """(rank, step, micro_step) the rank ran, but the one it stopped in and aborted or lost
    micro-steps: its settings there are the values its collectives used."""
    events = tables.events
    (key,) = fold([[events[c]] for c in ("rank", "step", "micro_step")])
    _, first = np.unique(key, return_index=True)
    seen = pd.DataFrame({c: events[c][first].astype(np.int64)
                         for c in ("rank", "step", "micro_step")})
    return incomplete.outside(seen, cut_off_passes(tables), "settings", tables.incomplete)


def _stopped_backwards(tables: RankTables) -> pd.DataFrame:
    """(rank, step, micro_step, unit): units whose post-backward a rank recorded in the
    backward it stopped in; ``backward_grads`` rows are written right there."""
    cut = cut_off_passes(tables)
    cut = cut[cut["phase"] == schema.BACKWARD]
    if not len(cut) or not tables.sizes["backward_grads"]:
        return pd.DataFrame(columns=["rank", "step", "micro_step", "unit"])
    grads = tables.frame("backward_grads")
    done = pd.DataFrame({"rank": grads["rank"].astype("int64"),
                         "step": grads["step"].astype("int64"),
                         "micro_step": grads["micro_step"].astype("int64"),
                         "unit": grads["unit"].astype(str)}).drop_duplicates()
    return done.merge(cut[["rank", "step", "micro_step"]], on=["rank", "step", "micro_step"])


def check(merged: Merged) -> pd.DataFrame:
    """Ranks outside the most common value of a unit's setting, where some rank changed it."""
    summary = merged.summaries.get(NAME)
    return compare(_empty() if summary is None else summary, merged.unit_sets)


def in_effect(summary: pd.DataFrame) -> pd.DataFrame:
    """Each rank's value of every (unit, setting) some rank changed, at each point it
    recorded there (a micro-step it completed, or a unit's backward where it stopped)."""
    has_row = summary["setting"].notna()
    rows, points = summary[has_row], summary[~has_row]
    changed = rows[_SLOT].drop_duplicates()
    whole = points[points["unit"].isna()][["rank", "step", "micro_step"]]
    units = points[points["unit"].notna()][["rank", "step", "micro_step", "unit"]]
    grid = pd.concat([whole.merge(changed, on=["step", "micro_step"]),
                      units.merge(changed, on=["step", "micro_step", "unit"])],
                     ignore_index=True)
    if not len(grid):
        return grid.assign(value=None)
    grid = grid.assign(key=step_key(grid["step"], grid["micro_step"])).sort_values("key")
    own = rows.assign(key=step_key(rows["step"], rows["micro_step"]))[
        ["rank", "unit", "setting", "key", "value"]].sort_values("key")
    joined = pd.merge_asof(grid, own, on="key", by=["rank", "unit", "setting"],
                           direction="backward")
    return joined.dropna(subset=["value"]).drop(columns="key")


def compare(summary: pd.DataFrame, unit_sets: pd.DataFrame) -> pd.DataFrame:
    """``summary``: every rank's ``summarize`` (runs of ranks); ``unit_sets``:
    ``order.unit_sets``.

    Names and values stay category codes (one vocabulary: ``analysis.concat``) through the
    comparison; only the rows reported become text.
    """
    if not len(summary) or not len(unit_sets):
        return findings.empty()
    values = in_effect(rank_runs.expand(_with_several_values(summary), unit_sets))
    if not len(values):
        return findings.empty()
    group = ["unit_set", *_SLOT]
    values = values.merge(unit_sets.assign(rank=unit_sets["rank"].astype("int64")), on="rank")
    differs = against_majority(values, group, "value")
    if not len(differs):
        return findings.empty()
    return _report(_one_per_cause(differs))


def _with_several_values(summary: pd.DataFrame) -> pd.DataFrame:
    """``summary`` without the settings rows of the (unit, setting) pairs that hold one value
    in every row of every rank: that value is what each rank has in effect wherever it has one,
    so no rank differs there. Nearly every pair is such a pair, and ``in_effect`` builds a row
    per rank, point and pair (at 1,024 ranks x 48 units, most of this check's memory).
    """
    has_row = summary["setting"].notna()
    rows = summary[has_row]
    distinct = rows.drop_duplicates(["unit", "setting", "value"])
    several = distinct.loc[distinct.duplicated(["unit", "setting"], keep=False),
                           ["unit", "setting"]].drop_duplicates()
    if len(several) == len(distinct[["unit", "setting"]].drop_duplicates()):
        return summary
    keep = ~has_row.to_numpy()
    keep[np.flatnonzero(has_row.to_numpy())] = pd.MultiIndex.from_frame(
        rows[["unit", "setting"]]).isin(pd.MultiIndex.from_frame(several))
    return summary[keep]


def _one_per_cause(differs: pd.DataFrame) -> pd.DataFrame:
    """Settings one call changed together become one row: their names and values joined."""
    # As text: a categorical sorts by code, and codes follow the order batches were read in.
    differs = differs.astype({"unit": object, "setting": object})
    differs = differs.assign(cause=differs["setting"].map(_CAUSE).fillna(differs["setting"]),
                             value=differs["value"].astype(str),
                             reference=differs["reference"].astype(str))
    differs = differs.sort_values(["step", "micro_step", "rank", "unit", "cause", "setting"],
                                  key=lambda c: c.map(_setting_order) if c.name == "setting"
                                  else c)
    slot = ["step", "micro_step", "rank", "unit", "cause"]
    joined = differs.groupby(slot, sort=False).agg(
        setting=("setting", ", ".join), value=("value", ", ".join),
        reference=("reference", ", ".join)).reset_index()
    first = differs.drop_duplicates(slot).drop(columns=["setting", "value", "reference"])
    return first.merge(joined, on=slot).reset_index(drop=True)


def _setting_order(name: str) -> int:
    return schema.SETTING_NAMES.index(name) if name in schema.SETTING_NAMES else 99


def _report(rows: pd.DataFrame) -> pd.DataFrame:
    located = rows.assign(target=rows["setting"])
    message = ("rank " + rows["rank"].astype(str) + " ran step " + rows["step"].astype(str)
               + ", micro-step " + rows["micro_step"].astype(str) + " with " + rows["unit"]
               + "'s " + rows["setting"] + " = " + rows["value"] + ", where "
               + compared_with(rows) + " had " + rows["reference"]
               + ": the ranks then issue different collectives for " + rows["unit"]
               + " (one reduces or gathers while another does not, or over another mesh) and "
               + "hang or exchange the wrong tensors; set " + rows["setting"] + " the same way "
               + "on every rank (decide it from values every rank shares, not from the rank)")
    return findings.make(NAME, SEVERITY, located, message)


CHECK = Check(12, NAME, SEVERITY, ACROSS_RANKS,
              "ranks ran a micro-step with different FSDP settings", check,
              summarize=summarize)
