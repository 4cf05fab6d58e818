"""One cause, told once: the findings that one mistake produces, grouped under it.

One wrong prefetch line gives a prefetch-order error per pass, and the gather it issued also
shows as a wasted prefetch (held into backward), which in turn makes the backward edge between
the same two units a no-op (redundant-prefetch): three checks, one fix. A rank that diverges
(order, prefetch configuration, gradients, eval forwards, settings) makes the collectives stop
matching, and every stalled-rank finding after it follows from that divergence (docs/checks.md check
6 names the first divergence as the root cause). Grouping reads the findings' own fields
(check, rank, step, unit, target), never their messages, so rewording a check changes nothing
here.

Each finding gets a ``group`` number (1, 2, ... in the order causes are told: errors first,
then first appearance); ``causes`` describes each group. A group holding one check is that
check's findings as before; only groups of several checks are told as one cause.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from fsdptrace.checks.findings import ERROR, SEVERITY_ORDER

# Checks whose findings are about one configured edge, (unit -> target): the edge is the cause.
# prefetch-order first: when present, it is what the fix is about.
EDGE_CHECKS = ("prefetch-order", "wasted-prefetch", "redundant-prefetch")
# Cross-rank divergences (docs/checks.md checks 4, 5, 10, 11, 12): each check's findings are one
# cause (one rank doing something else, seen at every pass it did it).
DIVERGENCE_CHECKS = ("rank-divergence", "prefetch-config-divergence", "gradient-divergence",
                     "eval-divergence", "setting-divergence")
STALLED = "stalled-rank"
EDGE, DIVERGENCE, CHECK = "edge", "divergence", "check"


@dataclass(frozen=True)
class Cause:
    """One group of findings: what they share and how many there are.

    ``kind``: ``edge`` (``unit -> target``, every phase), ``divergence`` (``checks[0]``, with
    the stalls it caused) or ``check`` (one check's findings). ``checks``: the checks in the
    group, the one the fix is about first.
    """

    group: int
    kind: str
    severity: str
    checks: tuple[str, ...]
    num_findings: int
    unit: str | None = None
    target: str | None = None

    @property
    def is_shared(self) -> bool:
        """Whether several checks tell this cause (it is then told once, under the cause)."""
        return len(self.checks) > 1


def group(findings: pd.DataFrame) -> tuple[pd.Series, list[Cause]]:
    """The group of every finding (a Series on ``findings``' index) and the causes in order:
    the worst severity first, then the cause seen first. In plain Python over the findings'
    keys (a few dozen findings, where a groupby and a scan per cause cost milliseconds)."""
    if not len(findings):
        return pd.Series([], index=findings.index, dtype="Int64"), []
    keys = _keys(findings).tolist()
    checks = findings["check"].astype(str).tolist()
    severities = findings["severity"].astype(str).tolist()
    members: dict[tuple, list[int]] = {}
    for position, key in enumerate(keys):
        members.setdefault(key, []).append(position)
    told = sorted(members, key=lambda key: (
        min(_severity_rank(severities[p]) for p in members[key]), members[key][0]))
    numbers = {key: n for n, key in enumerate(told, start=1)}
    groups = pd.Series([numbers[key] for key in keys], index=findings.index, dtype="Int64")
    causes = [_cause(numbers[key], key, [checks[p] for p in members[key]],
                     [severities[p] for p in members[key]]) for key in told]
    return groups, causes


def _severity_rank(severity: str) -> int:
    return SEVERITY_ORDER.get(severity, 9)


def _keys(findings: pd.DataFrame) -> pd.Series:
    """A hashable key per finding: the cause it belongs to."""
    check = findings["check"].astype(str)
    unit = findings["unit"].astype(object).where(findings["unit"].notna(), None)
    target = findings["target"].astype(object).where(findings["target"].notna(), None)
    keys = pd.Series([(CHECK, c, None, None) for c in check], index=findings.index,
                     dtype=object)
    edge = check.isin(EDGE_CHECKS) & unit.notna() & target.notna()
    keys[edge] = [(EDGE, None, u, t) for u, t in zip(unit[edge], target[edge], strict=True)]
    divergent = check.isin(DIVERGENCE_CHECKS)
    keys[divergent] = [(DIVERGENCE, c, None, None) for c in check[divergent]]
    root = _first_divergence(findings[divergent & (findings["severity"] == ERROR)])
    if root is not None:
        stalled = check == STALLED
        keys[stalled] = [(DIVERGENCE, root, None, None)] * int(stalled.sum())
    return keys


def _first_divergence(divergences: pd.DataFrame) -> str | None:
    """The check of the earliest divergence (by step; contract order breaks ties): the root
    cause check 6 names. A divergence cannot come after a stop (a stopped rank records
    nothing more, and cut-off passes are not compared), so no step test is needed."""
    if not len(divergences):
        return None
    contract = divergences["check"].astype(str).map(DIVERGENCE_CHECKS.index)
    ranked = divergences.assign(_contract=contract).sort_values(
        ["step", "_contract"], na_position="last", kind="stable")
    return str(ranked["check"].iloc[0])


def _cause(number: int, key: tuple, checks: list[str], severities: list[str]) -> Cause:
    """The cause ``key`` told as ``number``, from its findings' checks and severities."""
    kind, check, unit, target = key
    present = list(dict.fromkeys(checks))
    first = {EDGE: [c for c in EDGE_CHECKS if c in present],
             DIVERGENCE: [check] if check in present else [],
             CHECK: [check]}[kind]
    told = (*first, *[c for c in present if c not in first])
    return Cause(group=number, kind=kind, severity=min(severities, key=_severity_rank),
                 checks=told, num_findings=len(checks), unit=unit, target=target)


__all__ = ["CHECK", "DIVERGENCE", "DIVERGENCE_CHECKS", "EDGE", "EDGE_CHECKS", "Cause", "group"]
