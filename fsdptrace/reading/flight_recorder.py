"""Torch's Flight Recorder dumps in a run dir, joined to the FSDP collectives fsdptrace recorded.

The Flight Recorder knows which collective of which process group did not complete, but not
why it was issued; ``collectives`` knows which FSDP unit, phase and issuer each (process group,
sequence number) belongs to. The recorder saves a dump per rank at every ending that is not
clean (``record/flight_recorder.py``); here they are read back and joined. A collective is
*not completed* when the dump says it is neither ``completed`` nor retired (gloo in torch 2.13
leaves every entry ``scheduled`` and marks a finished one ``retired``; checked by experiment).

Dumps come from other people's jobs: only JSON is parsed, and a file that is not a dump is
skipped with a warning naming it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pandas as pd

from fsdptrace.errors import SkippedDumpWarning
from fsdptrace.reading import reader
from fsdptrace.store import fatal_signals

ENTRY_COLUMNS = ["rank", "group", "group_desc", "collective_seq", "op", "state", "retired",
                 "completed", "input_sizes"]
JOIN_KEY = ["rank", "group", "collective_seq"]
NAMED_COLUMNS = [*ENTRY_COLUMNS, "step", "micro_step", "phase", "unit", "kind", "issuer_kind",
                 "issuer_unit", "description"]


def read_dumps(run_dir: Path) -> pd.DataFrame:
    """Every rank's Flight Recorder entries (collectives only), one row per entry."""
    rows = []
    for rank in _dump_ranks(run_dir):
        folder = fatal_signals.dump_dir(run_dir, rank)
        for path in sorted(folder.glob(fatal_signals.FR_PATTERN)):
            rows.extend(_entries(path, rank))
    frame = pd.DataFrame(rows, columns=ENTRY_COLUMNS)
    return frame.astype({"rank": "int64", "collective_seq": "int64", "retired": bool,
                         "completed": bool})


def not_completed(entries: pd.DataFrame, collectives: pd.DataFrame) -> pd.DataFrame:
    """Each collective a dump shows as not completed, named by its FSDP unit, phase and issuer
    (empty ``unit`` where fsdptrace recorded no FSDP collective under that number)."""
    open_entries = entries[~entries["completed"]]
    if not len(collectives):
        named = open_entries.assign(**{c: None for c in NAMED_COLUMNS[len(ENTRY_COLUMNS):]})
        return named[NAMED_COLUMNS].reset_index(drop=True)
    ours = pd.DataFrame({
        "rank": collectives["rank"].astype("int64"),
        "group": collectives["group"].astype(object),
        "collective_seq": collectives["collective_seq"].astype("int64"),
        **{c: collectives[c].astype(object) for c in
           ("step", "micro_step", "phase", "unit", "kind", "issuer_kind", "issuer_unit")}})
    named = open_entries.merge(ours.drop_duplicates(JOIN_KEY, keep="last"), on=JOIN_KEY,
                               how="left")
    named["description"] = _describe(named)
    return named[NAMED_COLUMNS].reset_index(drop=True)


def _describe(named: pd.DataFrame) -> pd.Series:
    """"rank 0 never completed collective 61 of group 0 = the all-gather of layers.2, issued
    by layers.1's prefetch, forward of step 2, micro-step 0"."""
    head = ("rank " + named["rank"].astype(str) + " never completed collective "
            + named["collective_seq"].astype(str) + " of group " + named["group"].astype(str))
    kind = named["kind"].fillna("").astype(str).str.replace("_", "-")
    issuer = named["issuer_kind"].fillna("").astype(str)
    by = named["issuer_unit"].fillna("").astype(str)
    who = pd.Series(", issued by " + by + "'s " + issuer, index=named.index)
    who = who.mask(issuer.isin(["own", "post_backward"]), ", issued by its own " + issuer
                   .str.replace("own", "unshard").str.replace("_", "-"))
    who = who.mask(issuer == "", "")
    where = (", " + named["phase"].fillna("").astype(str) + " of step "
             + named["step"].astype("Int64").astype(str) + ", micro-step "
             + named["micro_step"].astype("Int64").astype(str))
    text = head + " = the " + kind + " of " + named["unit"].fillna("").astype(str) + who + where
    unknown = head + " (" + named["op"].astype(str) + "): not an FSDP collective fsdptrace recorded"
    return text.where(named["unit"].notna(), unknown)


def _dump_ranks(run_dir: Path) -> list[int]:
    return sorted(reader.rank_dirs(run_dir, fatal_signals.DUMPS_DIR))


def _entries(path: Path, rank: int) -> list[tuple]:
    try:
        dump = json.loads(path.read_bytes())
        entries = dump["entries"]
        return [_entry(rank, e) for e in entries if not e.get("is_p2p", False)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"{path}: not a Flight Recorder dump ({type(error).__name__}: {error}); "
                      "skipped", SkippedDumpWarning, stacklevel=3)
        return []


def _entry(rank: int, entry: dict) -> tuple:
    group = entry.get("process_group") or ["", ""]
    state = str(entry.get("state", ""))
    retired = bool(entry.get("retired", False))
    return (rank, str(group[0]), str(group[1]) if len(group) > 1 else "",
            int(entry["collective_seq_id"]), str(entry.get("profiling_name", "")), state,
            retired, retired or state == "completed", json.dumps(entry.get("input_sizes")))
