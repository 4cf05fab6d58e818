"""What the recorder reads from the backend at boundaries (not per event).

Prefetch edges and settings are read at each micro-step begin and written only when they
changed (settings also at each unit post-backward); gradient tokens at a step's first
micro-step; gradient presence, what the step wrote, and pending all-gathers right before
``optimizer.step()``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from fsdptrace.store import schema

if TYPE_CHECKING:
    from fsdptrace.record.backends.base import RecorderView as Recorder  # recorder.py imports us
    from fsdptrace.record.backends.base import Unit


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

    The rows are also kept on the recorder (``boundary_gradients``/``_pending``/``_written``)
    for the live checks, which run on this very snapshot right after it is taken. The
    backend's answers are tuples: a stored row is the (step, micro_step, unit) head plus one.
    """
    pending_of = rec.backend.pending_all_gathers
    gradients: list[tuple] = []
    pending: list[tuple] = []
    written: list[tuple] = []
    step, micro_step = rec.step, rec.micro_step
    baseline = rec.grad_baseline[1] if rec.grad_baseline and rec.grad_baseline[0] == step else None
    for unit, presence in zip(rec.units, rec.backend.all_gradients(rec.units), strict=True):
        head = (step, micro_step, unit.name)
        gradients.extend([head + g for g in presence])
        pending.extend([head + p for p in pending_of(unit)])
        if baseline is not None:
            written.extend(_written(rec, unit, head, presence, baseline[unit.index]))
    rec.boundary_gradients, rec.boundary_pending = gradients, pending
    rec.boundary_written = written
    rec.writer.buffer("gradients").extend(gradients)
    rec.writer.buffer("pending").extend(pending)
    rec.writer.buffer("grads_written").extend(written)


def _written(rec: Recorder, unit: Unit, head: tuple, presence: list, before: list[object]
             ) -> list[tuple]:
    """``grads_written`` rows of one unit: was each gradient held now written in this step?

    A parameter with no gradient at the baseline (token None) holds one now only if the step
    wrote it, so its presence answers and no token is read: after ``zero_grad()`` (to None,
    the default) that is every parameter, and the boundary reads each gradient once.
    """
    if before.count(None) == len(before):
        return [head + (g.param, True) for g in presence if g.has_grad]
    now = rec.backend.grad_tokens(unit)
    return [head + (g.param, b != n) for g, b, n in zip(presence, before, now, strict=False)
            if g.has_grad]


def take_grad_baseline(rec: Recorder) -> None:
    """Every managed parameter's gradient token, at the step's first micro-step begin: after
    the previous step's ``zero_grad``, before anything of this step can write a gradient."""
    rec.grad_baseline = (rec.step, rec.backend.all_grad_tokens(rec.units))


def setting_text(value: object) -> str | None:
    """A setting as the ``settings.value`` column holds it (JSON); None when unreadable."""
    if value is None:
        return None
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return json.dumps(str(value))


def record_settings_if_changed(rec: Recorder) -> None:
    """At each micro-step begin: rows for every unit setting that changed since last written.

    The backend's raw key is compared first, as for prefetch edges: most micro-steps change
    nothing, and then no unit's row is built.
    """
    key = rec.backend.settings_key(rec.units)
    if key is not None and key == rec.settings_key:
        return
    for unit in rec.units:
        record_unit_settings_if_changed(rec, unit)
    rec.settings_key = key


def record_unit_settings_if_changed(rec: Recorder, unit: Unit) -> None:
    row = rec.backend.settings_row(unit)
    last = rec.last_settings[unit.index]
    if row == last:
        return
    rec.last_settings[unit.index] = row
    rec.settings_key = None  # changed outside a micro-step begin: compare rows next time
    rows = [(rec.step, rec.micro_step, unit.name, name, setting_text(value))
            for i, (name, value) in enumerate(zip(schema.SETTING_NAMES, row, strict=True))
            if last is None or last[i] != value]
    rec.writer.buffer("settings").extend(rows)
