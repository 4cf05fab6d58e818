"""How each rank's recording ended: the one place that reads it from the markers.

docs/checks.md's *ending*: clean (training finished, the recorder closed with no micro-step open),
crashed (an exception, with its type and message), terminated (a handled signal), closed
mid-step (a close with a micro-step open), died by a fatal signal (SIGABRT, SIGSEGV, SIGBUS,
SIGFPE, SIGILL: read from the rank's faulthandler dump, ``fatal_signals``), or killed or hung
(no ending recorded: SIGKILL, the OOM killer, a hang, or still running). Every ending but
clean makes the rank's last pass a cut-off pass.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from fsdptrace.store import schema

CLEAN = "clean"
CRASHED = "crashed"
TERMINATED = "terminated"
CLOSED_MID_STEP = "closed mid-step"
KILLED_OR_HUNG = "killed or hung"
FATAL_SIGNAL = "died by a fatal signal"

_BY_KIND = {schema.MARKER_CLOSE: CLEAN, schema.MARKER_CRASH: CRASHED,
            schema.MARKER_TERMINATED: TERMINATED, schema.MARKER_CLOSED_MID_STEP: CLOSED_MID_STEP,
            schema.MARKER_FATAL_SIGNAL: FATAL_SIGNAL}
COLUMNS = ["rank", "ending", "detail", "step", "micro_step"]


def ending_markers(markers: pd.DataFrame) -> pd.DataFrame:
    """The markers that say how a rank ended (what the map step hands to the reduce)."""
    if not len(markers) or "kind" not in markers:
        return markers.iloc[0:0]
    kind = markers["kind"]
    if isinstance(kind.dtype, pd.CategoricalDtype):  # on codes: the words are a few categories
        ending = np.flatnonzero(kind.cat.categories.isin(schema.ENDING_MARKERS))
        return markers[np.isin(kind.cat.codes.to_numpy(), ending)]
    return markers[kind.astype(object).isin(schema.ENDING_MARKERS)]


def ending_markers_arrow(markers: pa.Table) -> pd.DataFrame:
    """``ending_markers`` of Arrow markers: only the few ending rows become pandas."""
    if not markers.num_rows:
        return pd.DataFrame(columns=["rank", "seq", "kind", "detail", "step", "micro_step"])
    kind = pc.cast(markers.column("kind"), pa.string())
    return markers.filter(pc.is_in(kind, pa.array(schema.ENDING_MARKERS))).to_pandas()


def rank_endings(markers: pd.DataFrame, ranks: Iterable[int]) -> pd.DataFrame:
    """Per rank of ``ranks``: ending, detail (exception, signal), and the step it was in.

    A rank recorded twice in one run dir (attached again after a close) ends as its last
    recorder ended. In plain Python over the ending markers (one or two a rank): every
    analysis asks this of each rank, where pandas' merges cost milliseconds for a few rows.
    """
    last = _last_endings(markers)
    present = sorted({int(r) for r in ranks})
    found = [last.get(rank, (KILLED_OR_HUNG, None, None, None)) for rank in present]
    return pd.DataFrame({
        "rank": pd.Series(present, dtype="int64"),
        "ending": pd.Series([ending for ending, _, _, _ in found], dtype=object),
        "detail": pd.Series(["" if pd.isna(detail) else detail for _, detail, _, _ in found],
                            dtype=object).astype(str),
        "step": pd.array([step for _, _, step, _ in found], dtype="Int64"),
        "micro_step": pd.array([micro_step for _, _, _, micro_step in found], dtype="Int64"),
    }, columns=COLUMNS)


def clean_ranks(markers: pd.DataFrame, ranks: Iterable[int] | None = None) -> set[int]:
    """Ranks whose recording ended clean (of ``ranks``, else of every rank in ``markers``)."""
    if ranks is None:
        ranks = markers["rank"].unique() if len(markers) and "rank" in markers else []
    last = _last_endings(markers)
    return {int(r) for r in ranks if last.get(int(r), (KILLED_OR_HUNG,))[0] == CLEAN}


def _last_endings(markers: pd.DataFrame) -> dict[int, tuple[str, object, object, object]]:
    """Per rank with an ending marker, its last: (ending, detail, step, micro_step)."""
    ends = ending_markers(markers)
    last: dict[int, tuple[str, object, object, object]] = {}
    if len(ends):
        order = [c for c in ("t_ns", "seq") if c in ends]
        ends = ends.sort_values(order) if order else ends
        for rank, kind, detail, step, micro_step in zip(
                ends["rank"].tolist(), ends["kind"].astype(object).tolist(),
                ends["detail"].tolist(), ends["step"].tolist(), ends["micro_step"].tolist(),
                strict=True):
            last[int(rank)] = (_BY_KIND.get(kind, KILLED_OR_HUNG), detail, step, micro_step)
    return last


def describe(endings: pd.DataFrame) -> pd.Series:
    """Each ending in words, for messages: "terminated by SIGTERM", "crashed (KeyError: 'x')"."""
    detail = endings["detail"].astype(str).str.slice(0, 300)
    text = pd.Series("ended without a recorded ending (killed, hung, or still running)",
                     index=endings.index, dtype=object)
    ending = endings["ending"]
    text = text.mask(ending == CRASHED, "crashed (" + detail + ")")
    text = text.mask(ending == TERMINATED, "was terminated by " + detail)
    # Not cut to 300 characters: the innermost frames are what a person reads first.
    text = text.mask(ending == FATAL_SIGNAL, "died by " + endings["detail"].astype(str))
    text = text.mask(ending == CLOSED_MID_STEP, "closed the recorder mid-step (" + detail + ")")
    return text.mask(ending == CLEAN, "closed cleanly")
