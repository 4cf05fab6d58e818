"""What the recorder reads from the backend at boundaries (not per event).

Prefetch edges are read at each micro-step begin and written only when they changed; gradient
presence and pending all-gathers are read right before ``optimizer.step()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdptrace import schema

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder


def current_prefetch(rec: Recorder) -> dict[tuple[str, str], tuple[str, ...]]:
    return {
        (unit.name, phase): tuple(rec.backend.prefetch_targets(unit, phase))
        for unit in rec.units
        for phase in schema.PHASES
    }


def record_prefetch_if_changed(rec: Recorder) -> None:
    """Append a complete snapshot of the edges when they differ from the last one written."""
    config = current_prefetch(rec)
    if config == rec._last_prefetch:
        return
    rec._last_prefetch = config
    rows = rec.writer.buffer("prefetch")
    for (unit, phase), targets in config.items():
        if not targets:
            rows.append((rec.step, rec.micro_step, unit, phase, None, None))
        for index, target in enumerate(targets):
            rows.append((rec.step, rec.micro_step, unit, phase, target, index))


def record_boundary(rec: Recorder) -> None:
    """Per unit: which managed parameters hold a gradient, and every pending all-gather.

    The rows are also kept on the recorder (``boundary_gradients``/``boundary_pending``)
    for the live checks, which run on this very snapshot right after it is taken.
    """
    rec.boundary_gradients, rec.boundary_pending = [], []
    gradient_rows, pending_rows = rec.boundary_gradients, rec.boundary_pending
    for unit in rec.units:
        for g in rec.backend.gradients(unit):
            gradient_rows.append(
                (rec.step, rec.micro_step, unit.name, g.param, g.has_grad, g.source))
        for p in rec.backend.pending_all_gathers(unit):
            pending_rows.append((rec.step, rec.micro_step, unit.name, p.kind, p.bucket, p.state))
    rec.writer.buffer("gradients").extend(gradient_rows)
    rec.writer.buffer("pending").extend(pending_rows)
