"""All-gather provenance in numbers: how often each unit is gathered, and what is held when.

Answers the questions the ``allgathers`` table exists for before any check fires: does a unit
get gathered more often per optimizer step than its calls need (a wasted or repeated
prefetch), and how many bytes of gathered-but-unconsumed parameters a rank holds over time.
Pure functions over the table, so a notebook and ``fsdptrace summary`` share them, and the
row helpers (``plain``, ``ended_issues``, ``call_occurrences``, ``issuer_text``,
``call_label``) that checks 3, 8 and 9 read the table through: facts of the table, not of any
one check.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from fsdptrace.reading.keys import group_ids, seq_ordered

ISSUER_KINDS = ("own", "prefetch", "implicit", "manual", "recompute", "other")
_PER_STEP = ["rank", "step", "unit"]
_PER_STEP_COLUMNS = [*_PER_STEP, "all_gathers", "num_bytes", *ISSUER_KINDS, "noops"]
_HELD_COLUMNS = ["rank", "seq", "t_ns", "step", "micro_step", "phase", "unit", "event",
                 "held_bytes", "rank_held_bytes"]
_ORDINALS = {1: "first", 2: "second", 3: "third", 4: "fourth", 5: "fifth"}


def per_step(allgathers: pd.DataFrame) -> pd.DataFrame:
    """One row per (rank, optimizer step, unit): all-gathers issued, their bytes, by issuer.

    ``all_gathers`` counts real collectives (``issue`` rows); ``noops`` counts ``unshard()``
    calls that found the unit already gathered or pending.
    """
    if not len(allgathers):
        return pd.DataFrame(columns=_PER_STEP_COLUMNS)
    return _per_step(plain(allgathers))


def _per_step(rows: pd.DataFrame) -> pd.DataFrame:
    """``per_step`` of rows ``plain`` made already."""
    issues = rows[rows["event"] == "issue"]
    counts = (issues.groupby([*_PER_STEP, "issuer_kind"]).size()
              .unstack("issuer_kind", fill_value=0)
              .reindex(columns=list(ISSUER_KINDS), fill_value=0))
    totals = issues.groupby(_PER_STEP).agg(all_gathers=("seq", "size"),
                                           num_bytes=("num_bytes", "sum"))
    noops = rows[rows["event"] == "noop"].groupby(_PER_STEP).size().rename("noops")
    out = totals.join(counts, how="outer").join(noops, how="outer").fillna(0)
    return out.astype("int64").reset_index()[_PER_STEP_COLUMNS]


def bytes_held(allgathers: pd.DataFrame) -> pd.DataFrame:
    """After every issue, consume or drop: bytes gathered and not yet consumed, per unit and rank.

    ``held_bytes`` is that unit's, ``rank_held_bytes`` the whole rank's at that moment.
    """
    if not len(allgathers):
        return pd.DataFrame(columns=_HELD_COLUMNS)
    return _held_sums(_ledger(plain(allgathers)))


def _ledger(rows: pd.DataFrame) -> pd.DataFrame:
    """The issues, consumes and drops of rows ``plain`` made, in order per rank."""
    return rows[rows["event"].isin(["issue", "consume", "drop"])].sort_values(["rank", "seq"])


def _held_sums(rows: pd.DataFrame) -> pd.DataFrame:
    """``bytes_held`` of the ``_ledger`` rows."""
    sign = rows["event"].map({"issue": 1, "consume": -1, "drop": -1}).astype("int64")
    delta = sign * rows["num_bytes"]
    rows = rows.assign(
        held_bytes=delta.groupby([rows["rank"], rows["unit"], rows["group"]]).cumsum(),
        rank_held_bytes=delta.groupby(rows["rank"]).cumsum(),
    )
    return rows[_HELD_COLUMNS].reset_index(drop=True)


def overview(allgathers: pd.DataFrame) -> dict[str, int]:
    """The table in a few numbers: issues by issuer, no-op prefetches, peak bytes held."""
    if not len(allgathers):
        return {}
    rows = plain(allgathers)  # once: on a large run, seconds per call
    steps = _per_step(rows)
    noop_prefetches = int(((rows["event"] == "noop") & (rows["issuer_kind"] == "prefetch")).sum())
    ledger = _ledger(rows)
    del rows  # alive while the ledger is summed, it made the peak 0.35 GB higher at 256 ranks
    held = _held_sums(ledger)
    numbers = {"issued": int(steps["all_gathers"].sum())}
    numbers.update({kind: int(steps[kind].sum()) for kind in ISSUER_KINDS if steps[kind].any()})
    numbers["noop_prefetches"] = noop_prefetches
    numbers["peak_held_bytes"] = int(held["rank_held_bytes"].max()) if len(held) else 0
    return numbers


def combined(parts: Iterable[dict[str, int]]) -> dict[str, int]:
    """``overview`` of the rows of several batches of whole ranks, from each batch's: the
    counts add up, and the peak held is one rank's (``rank_held_bytes``)."""
    found = [p for p in parts if p]
    if not found:
        return {}
    numbers = {"issued": sum(p["issued"] for p in found)}
    totals = {kind: sum(p.get(kind, 0) for p in found) for kind in ISSUER_KINDS}
    numbers.update({kind: total for kind, total in totals.items() if total})
    numbers["noop_prefetches"] = sum(p["noop_prefetches"] for p in found)
    numbers["peak_held_bytes"] = max(p["peak_held_bytes"] for p in found)
    return numbers


def overview_line(numbers: dict[str, int]) -> str:
    """``overview``'s numbers as one line for ``fsdptrace summary``: 'not recorded' when the
    run has no provenance."""
    if not numbers:
        return "not recorded"
    return ", ".join(f"{key.replace('_', ' ')} {value:,}" for key, value in numbers.items())


def plain(allgathers: pd.DataFrame) -> pd.DataFrame:
    """Categoricals as plain strings and ints as int64, so joins never trip on categories."""
    out = allgathers.copy()
    for column in ("phase", "unit", "event", "issuer_kind", "issuer_unit", "detail"):
        if column in out:
            out[column] = out[column].astype(object).astype(str)
    for column in ("rank", "step", "micro_step", "group", "seq", "t_ns", "num_bytes"):
        if column in out:
            out[column] = out[column].astype("int64")
    return out


def call_occurrences(events: pd.DataFrame, rank: np.ndarray, step: np.ndarray,
                     micro_step: np.ndarray, phase: np.ndarray, issuer_unit: np.ndarray,
                     seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows issued in a pass (rank, step, micro-step, phase) by ``issuer_unit`` at ``seq``:
    which call of the issuer issued each (1-based) and how many calls it made in the pass, as
    int64 arrays, both 0 where no entry of the issuer came before the row (or it has none).

    The recorder writes a unit's entry before FSDP's pre-forward/pre-backward runs, so the
    issuing call is the issuer's latest entry with a smaller seq in the same pass: its number
    is how many of the issuer's entries in the pass come up to the row. On sorted codes and
    ``searchsorted``: a check pays for its few reported rows, not for pandas joins.
    """
    n = len(seq)
    if not n:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    missing = pd.isna(issuer_unit)
    issuer = np.where(missing, "", issuer_unit.astype(object)).astype(object)
    # Only the issuers' entries on the rows' ranks can match: the rest are never looked at.
    sources = pd.unique(issuer[~missing].astype(str))
    events = events[events["unit"].isin(sources) & events["rank"].isin(pd.unique(rank))]
    theirs = {"rank": events["rank"], "step": events["step"],
              "micro_step": events["micro_step"], "phase": events["phase"].astype(str),
              "issuer_unit": events["unit"].astype(str)}
    mine = {"rank": rank, "step": step, "micro_step": micro_step,
            "phase": np.asarray(phase).astype(str).astype(object),
            "issuer_unit": issuer.astype(str).astype(object)}
    # One code per (rank, pass, issuer), shared by the rows and the entries.
    codes = []
    for column, values in mine.items():
        kind = object if column in ("phase", "issuer_unit") else np.int64
        codes.append(pd.factorize(np.concatenate(
            [np.asarray(values, dtype=kind), theirs[column].to_numpy(dtype=kind)]))[0])
    key = np.unique(np.stack(codes), axis=1, return_inverse=True)[1].reshape(-1)
    seqs = np.concatenate([np.asarray(seq, dtype=np.int64),
                           events["seq"].to_numpy(dtype=np.int64)])
    # (key, seq) as one number that sorts the same: seq replaced by its rank among all seqs.
    seq_rank = np.unique(seqs, return_inverse=True)[1].reshape(-1)
    keyed_seq = key * (int(seq_rank.max()) + 1) + seq_rank
    entry_keys, entry_keyed_seqs = np.sort(key[n:]), np.sort(keyed_seq[n:])
    first = np.searchsorted(entry_keys, key[:n], side="left")
    calls = np.searchsorted(entry_keys, key[:n], side="right") - first
    upto = (np.searchsorted(entry_keyed_seqs, keyed_seq[:n], side="right") - first)
    return upto.astype(np.int64), np.where(upto > 0, calls, 0).astype(np.int64)


def call_label(call: int, num_calls: int, unit: str, phase: str) -> str:
    """'second call of tok_embeddings in forward' ('a call of ...' when ``call`` is 0:
    unknown), and just 'layers.2 in forward' for a unit that ran once in the pass."""
    if repeated_call(call, num_calls):
        unit = f"{_ORDINALS.get(call, f'{call}th') if call else 'a'} call of {unit}"
    return f"{unit} in {phase}"


def repeated_call(call: int, num_calls: int) -> bool:
    """Whether the issuing unit ran more than once in the pass (unknown counts as yes)."""
    return not call or num_calls > 1


def ended_issues(allgathers: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Each issue that a consume or drop ended, as row positions: ``(issues, ends)``.

    An all-gather's life is the rows of its (rank, unit, group) in ``seq`` order; the row after
    an issue ends it when it is a consume or a drop (a re-issue before either ends nothing).
    Positions are in the (rank, seq) order of the ends (``lives_order`` orders them as the
    checks report them). On arrays, so a check turns only the rows it reports into text: each
    life row's previous row of its life is one hashed shift, not a sort of every row.
    """
    event = allgathers["event"]
    is_issue = (event == "issue").to_numpy()
    is_end = event.isin(["consume", "drop"]).to_numpy()
    life = np.flatnonzero(is_issue | is_end)
    rank, seq = allgathers["rank"].to_numpy()[life], allgathers["seq"].to_numpy()[life]
    if not seq_ordered(rank, seq):
        life = life[np.lexsort((seq, rank))]  # rows not as written: (rank, seq) order first
    lives = group_ids(allgathers, ["rank", "unit", "group"])[life]
    before = pd.Series(life).groupby(lives).shift(1, fill_value=-1).to_numpy(dtype=np.int64)
    ended = is_end[life] & (before >= 0)
    ended[ended] = is_issue[before[ended]]
    return before[ended], life[ended]


def lives_order(allgathers: pd.DataFrame, issue: np.ndarray) -> np.ndarray:
    """The order of the issue rows ``issue`` by seq, then rank, unit name, group and row: the
    order their findings are reported in."""
    return np.lexsort((issue, allgathers["group"].to_numpy()[issue],
                       text_codes(allgathers["unit"].iloc[issue]),
                       allgathers["rank"].to_numpy()[issue], allgathers["seq"].to_numpy()[issue]))


def row_codes(column: pd.Series) -> np.ndarray:
    """Values to compare or group rows by (equal exactly where the column's values are): a
    categorical's codes, integers as they are, else text codes."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        return column.cat.codes.to_numpy().astype(np.int64)
    if pd.api.types.is_integer_dtype(column.dtype):
        return column.to_numpy(dtype=np.int64)
    return text_codes(column)


def text_codes(column: pd.Series) -> np.ndarray:
    """Integer codes ordered as the column's text sorts (categorical or not; null is -1 in a
    categorical)."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        order = np.argsort(np.asarray(column.cat.categories.astype(str)), kind="stable")
        rank_of = np.empty(len(order), dtype=np.int64)
        rank_of[order] = np.arange(len(order))
        codes = column.cat.codes.to_numpy()
        return np.where(codes >= 0, rank_of[codes], -1)
    return pd.factorize(column.astype(str), sort=True)[0]


def issuer_text(rows: pd.DataFrame) -> pd.Series:
    """Who issued an all-gather, in words ('manual unshard()', 'prefetch from layers.0')."""
    source = rows["issuer_unit"].fillna("?").astype(str)
    kind = rows["issuer_kind"].astype(str)
    return pd.Series([issuer_words(k, s) for k, s in zip(kind, source, strict=True)],
                     index=rows.index, dtype=object)


def issuer_words(kind: str, source: str) -> str:
    """One issuer in words: ``kind`` as the table spells it, ``source`` the issuing unit."""
    return ("its own pre-forward/pre-backward" if kind == "own"
            else "manual unshard()" if kind == "manual"
            else f"prefetch from {source}" if kind == "prefetch"
            else f"FSDP2's implicit backward prefetch from {source}" if kind == "implicit"
            else f"checkpoint recompute of {source}" if kind == "recompute"
            else "an unknown caller")
