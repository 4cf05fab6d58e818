"""Check 3, pending-all-gather: an all-gather issued and not consumed before optimizer.step()."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import PER_RANK, Check
from fsdptrace.checks.kernel.settings import value_at
from fsdptrace.reading import keys

if TYPE_CHECKING:
    from fsdptrace.checks.kernel.tables import RankTables

NAME = "pending-all-gather"
SEVERITY = findings.ERROR


def check(tables: RankTables) -> pd.DataFrame:
    """The boundary snapshots of pending all-gathers, outside steps the writer lost rows of."""
    if not tables.sizes["pending"]:
        return findings.empty()
    found = pending_findings(tables.frame("pending"), tables.frame("allgathers"),
                             eval_forwards=tables.frame("eval_forwards"),
                             settings=tables.frame("settings"))
    return tables.drop_lost(found, "pending", whole_steps=True)


def pending_findings(pending: pd.DataFrame, allgathers: pd.DataFrame | None = None, *,
                     eval_forwards: pd.DataFrame | None = None,
                     settings: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every pending all-gather the recorder saw right before an optimizer step, with what
    issued it and a fix that fits that cause."""
    if not len(pending):
        return findings.empty()
    rows = pending.assign(unit=pending["unit"].astype(str), target=pending["bucket"].astype(str))
    cause, fix = _causes(rows, allgathers, eval_forwards, settings)
    message = (rows["unit"] + ": " + rows["kind"].astype(str) + " " + rows["bucket"].astype(str)
               + " " + rows["state"].astype(str) + cause + " at the optimizer boundary: the next "
               + "forward will consume the pre-step gather and run on stale parameters; " + fix)
    return findings.make(NAME, SEVERITY, rows, message)


_GENERIC_FIX = ("fix what issued it, or let the last micro-step's backward be the last "
                "(set_is_last_backward)")
_EVAL_FIX = ("reshard after eval: call reshard() on the unit (or on every unit) after the "
             "eval forwards, or keep reshard_after_forward=True for it")
_BACKWARD_FIX = ("turn reshard_after_backward back on for the last micro-step "
                 "(set_reshard_after_backward(True) before its backward): False is meant for "
                 "the accumulation micro-steps only")


def _causes(rows: pd.DataFrame, allgathers: pd.DataFrame | None,
            eval_forwards: pd.DataFrame | None, settings: pd.DataFrame | None
            ) -> tuple[pd.Series, pd.Series]:
    """Per pending row: ' (issued by ...)' and the fix for that cause.

    Parameters left unsharded are explained by the settings first (an eval forward with
    ``reshard_after_forward`` false, ``reshard_after_backward`` false at the last backward);
    a gather still in flight by who issued it (``allgathers``).
    """
    issued = _issued_by(rows, allgathers)
    issuer, kind = issued["by"], issued["issuer_kind"]
    cause = issuer.where(issuer == "", " (issued by " + issuer + ")")
    fix = pd.Series(_GENERIC_FIX, index=rows.index, dtype=object)
    fix = fix.mask(kind == "prefetch", "remove " + rows["unit"] + " from the prefetch targets of "
                   + issued["issuer_unit"] + " where it does not run after it, or let the last "
                   "micro-step's backward be the last (set_is_last_backward)")
    fix = fix.mask(kind == "manual", "consume the gather before optimizer.step() (run "
                   + rows["unit"] + "'s forward) or call " + rows["unit"] + ".reshard() after "
                   "the manual unshard()")
    held = rows["state"].astype(str) == "unsharded-held"
    settings = settings if settings is not None else pd.DataFrame()
    after_forward = value_at(settings, rows, "reshard_after_forward") == "false"
    after_backward = value_at(settings, rows, "reshard_after_backward") == "false"
    evaled = held & after_forward & _evaluated(rows, eval_forwards)
    by_backward = held & after_backward & ~evaled
    cause = cause.mask(by_backward, " (left unsharded by reshard_after_backward=False at the "
                       "last backward)")
    fix = fix.mask(by_backward, _BACKWARD_FIX)
    cause = cause.mask(evaled, " (left unsharded by an eval forward, reshard_after_forward="
                       "False, in eval interval " + rows["step"].astype(str) + ")")
    fix = fix.mask(evaled, _EVAL_FIX)
    return cause, fix


def _evaluated(rows: pd.DataFrame, eval_forwards: pd.DataFrame | None) -> pd.Series:
    """Whether the unit ran an eval forward in the eval interval that ends at this boundary."""
    if eval_forwards is None or not len(eval_forwards):
        return pd.Series(False, index=rows.index)
    ran = pd.DataFrame({"rank": eval_forwards["rank"].astype("int64"),
                        "step": eval_forwards["step"].astype("int64"),
                        "unit": eval_forwards["unit"].astype(str)}).drop_duplicates()
    asked = pd.DataFrame({"rank": rows["rank"].astype("int64"),
                          "step": rows["step"].astype("int64"), "unit": rows["unit"]})
    return pd.Series(keys.isin(asked, ran, ["rank", "step", "unit"]), index=rows.index)


def _issued_by(rows: pd.DataFrame, allgathers: pd.DataFrame | None) -> pd.DataFrame:
    """Per row, the unit's last issue by then: ``by`` ('manual unshard() in step 0 micro-step
    1'), ``issuer_kind`` (``prefetch``, ``manual``, ...), ``issuer_unit``; empty texts where
    nothing was recorded."""
    columns = ["by", "issuer_kind", "issuer_unit"]
    none = pd.DataFrame({c: pd.Series("", index=rows.index, dtype=object) for c in columns})
    if allgathers is None or not len(allgathers):
        return none
    from fsdptrace.reading.allgathers import issuer_text, plain

    # Only the issues of the pending rows' units on their ranks can match: the rest of the
    # table never becomes text (it was 0.9 s of a 16-rank deep analysis).
    issues = plain(allgathers[((allgathers["event"] == "issue")
                               & allgathers["unit"].isin(rows["unit"].unique())
                               & allgathers["rank"].isin(rows["rank"].unique())).to_numpy()])
    issues = issues.sort_values(["step", "seq"])
    issues = issues.assign(by=issuer_text(issues) + " in step " + issues["step"].astype(str)
                           + " micro-step " + issues["micro_step"].astype(str))
    left = rows.assign(
        _row=range(len(rows)), rank=rows["rank"].astype("int64"),
        step=rows["step"].astype("int64"),
        group=rows["bucket"].astype(str).str.extract(r"group\[(\d+)\]")[0].fillna("-1")
        .astype("int64"),
    ).sort_values("step")
    joined = pd.merge_asof(left, issues[["rank", "unit", "group", "step", *columns]],
                           on="step", by=["rank", "unit", "group"], direction="backward")
    joined = joined.sort_values("_row")
    return pd.DataFrame({c: joined[c].fillna("").astype(str).to_numpy() for c in columns},
                        index=rows.index)


CHECK = Check(3, NAME, SEVERITY, PER_RANK, "all-gather still pending at the optimizer boundary",
              check, live=True)
