"""The live option: checks 1-3 on this rank's current step, raising before ``optimizer.step()``.

One source of truth: the step is turned into the code columns the offline analyzer's map
step reads from a run dir (``RankTables``) and handed to the same per-rank checks, so a live
finding and the post-mortem's finding are the same row with the same message. A clean step
costs numpy work on a few hundred rows; pandas builds frames only for findings. pandas is
imported here, on this path only: a job that records without raising never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsdptrace.errors import LifecycleError
from fsdptrace.record import snapshots
from fsdptrace.store import schema

if TYPE_CHECKING:
    import pandas as pd

    from fsdptrace.checks.kernel.tables import RankTables
    from fsdptrace.reading.trace import Trace
    from fsdptrace.record.backends.base import RecorderView as Recorder  # recorder.py imports us

_FIX = (
    "How to fix: configure FSDP prefetch from the model's actual forward/backward execution "
    "order (see `fsdptrace suggest`), run every FSDP unit through its own forward instead of "
    "reaching into its parameters, and do not carry an all-gather across optimizer.step()."
)


def raise_if_unsafe(rec: Recorder) -> None:
    """Run checks 1-3 on the step about to be applied; raise ``LifecycleError`` on errors.

    Called from the optimizer's step pre-hook, so raising here means the optimizer never
    touches a parameter. The findings are appended to the run dir's ``findings`` table and
    flushed first, so a post-mortem has them even if the job dies right after.
    """
    if not rec.enabled:
        return  # recording failed this step: there is nothing trustworthy to check
    found = step_findings(rec)
    if not len(found):
        return  # the clean step: no pandas operation at all
    errors = found[found["severity"] == "error"]
    if not len(errors):
        return
    _append_findings(rec, errors)
    rec.flush()
    raise LifecycleError(format_findings(errors, rank=rec.rank, step=rec.step,
                                         run_dir=str(rec.run_dir)), findings=errors)


def step_findings(rec: Recorder) -> pd.DataFrame:
    """Findings of the live checks on this rank's current optimizer step."""
    from fsdptrace.checks import LIVE_CHECKS, per_rank_findings

    return per_rank_findings(step_tables(rec), LIVE_CHECKS)


def step_tables(rec: Recorder) -> RankTables:
    """This rank's current step as code columns, straight from the recorder's tuples.

    The checks read these before every optimizer step, so nothing here builds a DataFrame:
    a clean step costs numpy work on a few hundred rows. The pandas ``step_trace`` is built
    only if a check has findings to spell out from a whole table.
    """
    import numpy as np

    from fsdptrace.checks.kernel.columns import Columns, Vocab
    from fsdptrace.checks.kernel.tables import CODED, RankTables

    vocab, rank = Vocab(), rec.rank
    events = np.array(rec.live_events or [], dtype=np.int64).reshape(-1, 6)
    unit_map = vocab.codes(list(rec.unit_names))
    phase_map = vocab.codes(list(schema.PHASES))
    event_columns = Columns({
        "rank": np.full(len(events), rank, dtype=np.int64), "seq": events[:, 0],
        "t_ns": events[:, 1], "step": events[:, 2], "micro_step": events[:, 3],
        "phase": phase_map[events[:, 4]], "unit": unit_map[events[:, 5]],
    }, {"phase", "unit"}, vocab, len(events))
    units = [(u.name, bool(u.is_root)) for u in rec.units]
    trace: list[Trace] = []

    def frame(table: str) -> pd.DataFrame:
        if not trace:
            trace.append(step_trace(rec))
        return getattr(trace[0], table)

    return RankTables(
        vocab=vocab, events=event_columns,
        prefetch=Columns.from_rows(_prefetch_rows(rec), schema.PREFETCH.names, vocab,
                                   CODED["prefetch"], rank),
        # Only the unit is coded; parameter labels and grad_source stay text (no lookup per
        # parameter: check 2 compares labels only for units that did not run forward).
        gradients=Columns.from_rows(rec.boundary_gradients, schema.GRADIENTS.names, vocab,
                                    ["unit"], rank),
        # Taken at this boundary from the step's first micro-step baseline, as the run dir's
        # rows are: live and offline agree. None when the step's start was not recorded.
        grads_written=Columns.from_rows(rec.boundary_written, schema.GRADS_WRITTEN.names,
                                        vocab, CODED["grads_written"], rank),
        units=Columns.from_rows(units, ["unit", "is_root"], vocab, ["unit"], rank),
        closed={rank}, frames=frame,
        sizes={"pending": len(rec.boundary_pending), "allgathers": 0})


def step_trace(rec: Recorder) -> Trace:
    """This rank's current step as a one-rank ``Trace`` (the tables the run dir would hold)."""
    import pandas as pd

    from fsdptrace.reading.trace import Trace

    rank = rec.rank
    names = rec.unit_names
    events = rec.live_events or []
    # Units and phases are stored as codes on the hot path; decode them as the writer does.
    event_frame = pd.DataFrame({
        "seq": [e[0] for e in events],
        "t_ns": [e[1] for e in events],
        "step": [e[2] for e in events],
        "micro_step": [e[3] for e in events],
        "phase": [schema.PHASES[e[4]] for e in events],
        "unit": [names[e[5]] for e in events],
    })
    return Trace(
        run_dir=rec.run_dir,
        meta=pd.DataFrame(),
        units=_frame(rank, ["unit", "part", "fqn", "module_type", "is_root", "num_params",
                            "num_param_elements", "param_names"],
                     [(u.name, u.part, u.fqn, u.module_type, u.is_root, len(u.param_names),
                       u.num_param_elements, list(u.param_names)) for u in rec.units]),
        events=event_frame.assign(rank=rank),
        # The step is complete at the boundary: a close marker tells the checks that nothing
        # at the end was cut off by a stalled recording.
        markers=_frame(rank, schema.MARKERS.names,
                       [(0, 0, rec.step, rec.micro_step, schema.MARKER_CLOSE, 0, "")]),
        prefetch=_frame(rank, schema.PREFETCH.names, _prefetch_rows(rec)),
        gradients=_frame(rank, schema.GRADIENTS.names, rec.boundary_gradients),
        grads_written=_frame(rank, schema.GRADS_WRITTEN.names, rec.boundary_written),
        pending=_frame(rank, schema.PENDING.names, rec.boundary_pending),
        settings=_frame(rank, schema.SETTINGS.names, _settings_rows(rec)),
    )


def _settings_rows(rec: Recorder) -> list[tuple]:
    """Every unit's settings as last read, in effect now (what check 3 names as a cause).

    Eval forwards are not kept on the recorder: live, a gather left by one is named by its
    settings only; the run dir's analysis names the eval forward too.
    """
    return [(rec.step, rec.micro_step, unit.name, name, snapshots.setting_text(value))
            for unit, row in zip(rec.units, rec.last_settings, strict=True) if row is not None
            for name, value in zip(schema.SETTING_NAMES, row, strict=True)]


def _prefetch_rows(rec: Recorder) -> list[tuple]:
    """The edges in effect this step, as one snapshot taking effect at its first micro-step.

    The recorder re-reads the edges at every micro-step begin; the last snapshot it took is
    the configuration the step ran with (the current one if it never took one).
    """
    config = rec.prefetch_seen.config or snapshots.current_prefetch(rec)
    rows: list[tuple] = []
    for (unit, phase), targets in config.items():
        if not targets:
            rows.append((rec.step, 0, unit, phase, None, None))
        rows.extend((rec.step, 0, unit, phase, target, index)
                    for index, target in enumerate(targets))
    return rows


def _frame(rank: int, columns: list[str], rows: list[tuple]) -> pd.DataFrame:
    import pandas as pd

    frame = pd.DataFrame.from_records(rows, columns=columns) if rows else pd.DataFrame(
        {c: pd.Series([], dtype=object) for c in columns})
    return frame.assign(rank=rank)


def _append_findings(rec: Recorder, found: pd.DataFrame) -> None:
    """Findings rows in ``schema.FINDINGS`` order (the rank is the partition, not a column)."""
    rows = rec.writer.buffer("findings")
    for f in found.itertuples(index=False):
        rows.append((f.check, f.severity, _int(f.step), _int(f.micro_step), _str(f.phase),
                     _str(f.unit), _str(f.target), f.message))


def format_findings(found: pd.DataFrame, *, rank: int, step: int, run_dir: str) -> str:
    """Every finding, grouped by check in docs/checks.md order, then the fix."""
    from fsdptrace.checks import CHECKS

    lines = [f"fsdptrace: unsafe FSDP lifecycle on rank {rank} before optimizer step {step}; "
             "the optimizer was not executed."]
    for name, info in CHECKS.items():
        group = found[found["check"] == name]
        if not len(group):
            continue
        lines.append(f"{name} ({info.summary}):")
        for f in group.itertuples(index=False):
            lines.append(f"  - {_where(f)}: {f.message}")
    lines.append(_FIX)
    lines.append(f"These findings are recorded in {run_dir}/findings.")
    return "\n".join(lines)


def _where(f: Any) -> str:
    where = f"step={_int(f.step)} micro_step={_int(f.micro_step)}"
    phase = _str(f.phase)
    return f"{where} phase={phase}" if phase else where


def _int(value: Any) -> int | None:
    return None if _missing(value) else int(value)


def _str(value: Any) -> str | None:
    return None if _missing(value) else str(value)


def _missing(value: Any) -> bool:
    import pandas as pd

    return value is None or bool(pd.isna(value))
