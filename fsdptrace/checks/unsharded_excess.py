"""Check 13, unsharded-excess (warning): a pass held more gathered parameters than it needs.

Beyond the contract's twelve checks (``docs/checks.md``): it answers "which unit is holding my
memory?" from the unsharded-memory ledger (``fsdptrace.reading.unsharded``). Per rank and optimizer
step, the pass whose peak of unsharded parameter bytes most exceeds its floor (the unit that
needs most plus what it prefetched there; a root that FSDP2 keeps unsharded from forward into
backward is part of it) is reported when the excess is at least ``MIN_EXCESS_BYTES`` and
``MIN_EXCESS_SHARE`` of the floor. The units held from an earlier pass are named, with the
setting that keeps them when the ``settings`` table says so. Parameter memory as FSDP holds it,
not the allocator's view.
"""

from __future__ import annotations

import pandas as pd

from fsdptrace.checks import findings
from fsdptrace.checks.contract import PER_RANK, Check
from fsdptrace.checks.kernel.tables import RankTables
from fsdptrace.reading import unsharded
from fsdptrace.reading.sizes import human_bytes

NAME = "unsharded-excess"
SEVERITY = findings.WARNING
MIN_EXCESS_BYTES = 1 << 20
MIN_EXCESS_SHARE = 0.25


def check(tables: RankTables) -> pd.DataFrame:
    """The worst pass of each (rank, step) whose excess passes both thresholds."""
    if not tables.sizes["allgathers"]:
        return findings.empty()
    units = tables.frame("units")
    roots = frozenset(units.loc[units["is_root"].astype(bool), "unit"].astype(str))
    allgathers = tables.frame("allgathers")
    # Per rank, all ranks at once; only the passes whose excess may pass the threshold.
    peaks = unsharded.peaks(allgathers, by_design=roots, min_excess=MIN_EXCESS_BYTES)
    big = peaks[(peaks["excess_bytes"] >= MIN_EXCESS_BYTES)
                & (peaks["excess_bytes"] >= MIN_EXCESS_SHARE * peaks["floor_bytes"])]
    if not len(big):
        return findings.empty()
    worst = big.sort_values("excess_bytes", kind="stable").groupby(["rank", "step"]).tail(1)
    found = worst.sort_values(["rank", "step"], kind="stable")
    found = found.assign(unit=found["largest_earlier_unit"], bytes=found["excess_bytes"])
    return tables.drop_lost(findings.make(NAME, SEVERITY, found,
                                          _messages(found, _kept_unsharded(tables))),
                            "allgathers")


def _kept_unsharded(tables: RankTables) -> set[tuple[int, str]]:
    """(rank, unit) whose last recorded ``reshard_after_forward`` is false."""
    settings = tables.frame("settings")
    if not len(settings):
        return set()
    rows = settings[settings["setting"].astype(str) == "reshard_after_forward"]
    last = (rows.sort_values(["step", "micro_step"], kind="stable")
            .groupby(["rank", "unit"], observed=True).tail(1))
    kept = last[last["value"].astype(str) == "false"]
    return set(zip(kept["rank"].astype(int), kept["unit"].astype(str), strict=True))


def _messages(rows: pd.DataFrame, kept: set[tuple[int, str]]) -> list[str]:
    out = []
    for row in rows.itertuples(index=False):
        cause = ""
        if row.largest_earlier_unit is not None:
            unit = str(row.largest_earlier_unit)
            cause = ("; held from an earlier pass: " + str(row.held_from_earlier)
                     + (f" ({unit} has reshard_after_forward=False: reshard it after forward, "
                        "or accept the memory for skipping its backward all-gather)"
                        if (int(row.rank), unit) in kept
                        else " (a prefetch consumed a phase later, or parameters kept unsharded:"
                        " prefetch them only from the unit that runs right before them)"))
        out.append(
            f"rank {int(row.rank)} held {_mib(row.peak_bytes)} of unsharded parameters in "
            f"step {int(row.step)}, micro-step {int(row.micro_step)}, {row.phase} (units "
            f"{row.peak_units}); its configuration needs {_mib(row.floor_bytes)}: "
            f"{_mib(row.excess_bytes)} more{cause}. Parameter memory as FSDP holds it, not the "
            "allocator's view")
    return out


def _mib(num_bytes: object) -> str:
    return human_bytes(num_bytes)  # KiB for small models: "0.00 MiB" said nothing


CHECK = Check(13, NAME, SEVERITY, PER_RANK,
              "a pass held more unsharded parameters than its configuration needs", check)
