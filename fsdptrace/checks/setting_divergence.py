"""Check 12, setting-divergence: ranks with the same units run a micro-step with other settings.

One rank skipping gradient sync, keeping parameters unsharded or using another mesh shape
issues other collectives than its peers. Reads ``settings`` (a row per change): the value in
effect at a micro-step is the last row at or before it. Ranks are compared where some rank's
setting changed: between changes every rank's values stay as they were compared last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from fsdptrace import schema
from fsdptrace.checks import findings, incomplete
from fsdptrace.checks.columns import fold
from fsdptrace.checks.contract import ACROSS_RANKS, Check, Merged
from fsdptrace.checks.keys import step_key
from fsdptrace.checks.order import outside_majority

if TYPE_CHECKING:
    from fsdptrace.checks.tables import RankTables

NAME = "setting-divergence"
SEVERITY = findings.ERROR
_SUMMARY = ["rank", "step", "micro_step", "unit", "setting", "value"]
_SLOT = ["step", "micro_step", "unit", "setting"]


def summarize(tables: RankTables) -> pd.DataFrame:
    """The rank's settings rows (the last of each micro-step), plus one row per micro-step it
    ran (null ``unit``/``setting``): where its values can be compared."""
    if not tables.sizes["settings"]:
        return pd.DataFrame(columns=_SUMMARY)
    raw = tables.frame("settings")
    rows = pd.DataFrame({"rank": raw["rank"].astype("int64"), "step": raw["step"].astype("int64"),
                         "micro_step": raw["micro_step"].astype("int64"),
                         "unit": raw["unit"].astype(str), "setting": raw["setting"].astype(str),
                         "value": raw["value"].astype(object)})
    # Of several rows in one micro-step (a change between forward and backward), the last is
    # what the micro-step's collectives used.
    rows = rows.drop_duplicates(["rank", "step", "micro_step", "unit", "setting"], keep="last")
    seen = _micro_steps(tables)
    return pd.concat([rows, seen.assign(unit=None, setting=None, value=None)],
                     ignore_index=True)[_SUMMARY]


def _micro_steps(tables: RankTables) -> pd.DataFrame:
    """(rank, step, micro_step) the rank ran, outside aborted or lost micro-steps; a stalled
    rank's last micro-step only if its forward was complete (the settings are read at its
    begin, so its cut-off backward does not make them any less what the rank was about to do)."""
    events = tables.events
    (key,) = fold([[events[c]] for c in ("rank", "step", "micro_step")])
    _, first = np.unique(key, return_index=True)
    seen = pd.DataFrame({c: events[c][first].astype(np.int64)
                         for c in ("rank", "step", "micro_step")})
    cut = incomplete.cut_off_micro_steps(tables)
    cut = cut[cut["phase"] == schema.FORWARD]
    return incomplete.outside(seen, cut, "settings", tables.incomplete)


def check(merged: Merged) -> pd.DataFrame:
    """Ranks outside the most common value of a unit's setting, where some rank changed it."""
    return compare(merged.summaries.get(NAME, pd.DataFrame(columns=_SUMMARY)), merged.unit_sets)


def in_effect(summary: pd.DataFrame) -> pd.DataFrame:
    """Each rank's value of every (unit, setting) some rank changed at a micro-step it ran."""
    has_row = summary["setting"].notna()
    rows, seen = summary[has_row], summary[~has_row][["rank", "step", "micro_step"]]
    changed = rows[_SLOT].drop_duplicates()
    grid = seen.merge(changed, on=["step", "micro_step"])
    if not len(grid):
        return grid.assign(value=None)
    grid = grid.assign(key=step_key(grid["step"], grid["micro_step"])).sort_values("key")
    own = rows.assign(key=step_key(rows["step"], rows["micro_step"]))[
        ["rank", "unit", "setting", "key", "value"]].sort_values("key")
    joined = pd.merge_asof(grid, own, on="key", by=["rank", "unit", "setting"],
                           direction="backward")
    return joined.dropna(subset=["value"]).drop(columns="key")


def compare(summary: pd.DataFrame, unit_sets: pd.DataFrame) -> pd.DataFrame:
    """``summary``: every rank's ``summarize``; ``unit_sets``: ``order.unit_sets``."""
    if not len(summary) or not len(unit_sets):
        return findings.empty()
    values = in_effect(summary)
    if not len(values):
        return findings.empty()
    group = ["unit_set", *_SLOT]
    values = values.merge(unit_sets.assign(rank=unit_sets["rank"].astype("int64")), on="rank")
    differs = outside_majority(values, group, "value")
    if not len(differs):
        return findings.empty()
    return _report(differs.sort_values(["step", "micro_step", "rank", "unit", "setting"])
                   .reset_index(drop=True))


def _report(rows: pd.DataFrame) -> pd.DataFrame:
    located = rows.assign(target=rows["setting"])
    message = ("rank " + rows["rank"].astype(str) + " ran step " + rows["step"].astype(str)
               + ", micro-step " + rows["micro_step"].astype(str) + " with " + rows["unit"]
               + "'s " + rows["setting"] + " = " + rows["value"].astype(str) + ", where "
               + rows["num_agree"].astype(str) + " rank(s), e.g. rank "
               + rows["reference_rank"].astype(str) + ", had " + rows["reference"].astype(str)
               + ": the ranks then issue different collectives for " + rows["unit"]
               + " (one reduces or gathers while another does not, or over another mesh) and "
               + "hang or exchange the wrong tensors; set " + rows["setting"] + " the same way "
               + "on every rank (decide it from values every rank shares, not from the rank)")
    return findings.make(NAME, SEVERITY, located, message)


CHECK = Check(12, NAME, SEVERITY, ACROSS_RANKS,
              "ranks ran a micro-step with different FSDP settings", check,
              summarize=summarize)
