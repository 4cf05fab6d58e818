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
    """Append a complete snapshot of the edges when they differ from the last one written.

    Runs at every micro-step's first root forward. Resolving every unit's targets to names
    costs ~5 µs per unit, so a backend that can hand over its raw target lists
    (``prefetch_key``) is asked first, and names are resolved only when those lists changed.
    """
    backend = rec.backend
    key = backend.prefetch_key(rec.units)
    if key is not None and key == rec._prefetch_key:
        return
    rec._prefetch_key = None if key is None else backend.freeze_prefetch_key(key)
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
    for the live checks, which run on this very snapshot right after it is taken. The
    backend's answers are tuples: a stored row is the (step, micro_step, unit) head plus one.
    """
    gradients_of, pending_of = rec.backend.gradients, rec.backend.pending_all_gathers
    gradients: list[tuple] = []
    pending: list[tuple] = []
    step, micro_step = rec.step, rec.micro_step
    for unit in rec.units:
        head = (step, micro_step, unit.name)
        gradients.extend([head + g for g in gradients_of(unit)])
        pending.extend([head + p for p in pending_of(unit)])
    rec.boundary_gradients, rec.boundary_pending = gradients, pending
    rec.writer.buffer("gradients").extend(gradients)
    rec.writer.buffer("pending").extend(pending)
