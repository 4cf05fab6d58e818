"""What the recorder reads from the backend at boundaries (not per event).

Prefetch edges and settings are read at each micro-step begin and written only when they
changed (settings also at each unit post-backward); gradient tokens at a step's first
micro-step; gradient presence, what the step wrote, and pending all-gathers right before
``optimizer.step()``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from fsdptrace.record import boundary_rows
from fsdptrace.record.journal import FramedTable
from fsdptrace.store import schema

if TYPE_CHECKING:
    from fsdptrace.record.backends.base import GradientPresence, Unit
    from fsdptrace.record.backends.base import RecorderView as Recorder  # recorder.py imports us


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
    seen = rec.prefetch_seen
    if key is not None and key == seen.key:
        return
    seen.key = None if key is None else backend.freeze_prefetch_key(key)
    config = current_prefetch(rec)
    if config == seen.config:
        return
    seen.config = config
    rows = rec.writer.buffer("prefetch")
    for (unit, phase), targets in config.items():
        if not targets:
            rows.append((rec.step, rec.micro_step, unit, phase, None, None))
        for index, target in enumerate(targets):
            rows.append((rec.step, rec.micro_step, unit, phase, target, index))


def record_boundary(rec: Recorder) -> None:
    """Per unit: which managed parameters hold a gradient, and every pending all-gather.

    The ``gradients`` and ``grads_written`` rows are joined from encodings kept per answer
    (``boundary_rows``): building ~1,000 tuples a step and encoding them cost as much as the
    reads. With live checks on, the rows are also kept on the recorder as tuples
    (``boundary_gradients``/``_pending``/``_written``): the checks run on this very snapshot
    right after it is taken.
    """
    backend = rec.backend
    step, micro_step = rec.step, rec.micro_step
    baseline = rec.grad_baseline if rec.grad_baseline and rec.grad_baseline[0] == step else None
    presences = backend.all_gradients(rec.units)
    # By position, not over ``rec.units``: touching every ``Unit`` costs ~1 µs each after a
    # backward at 256 units; only units with something to write are looked at.
    pending: list[tuple] = []
    for index, found in enumerate(backend.all_pending_all_gathers(rec.units)):
        if found:
            head = (step, micro_step, rec.unit_names[index])
            pending.extend([head + p for p in found])
    gradient_tails, held, all_held = rec.boundary_rows.tails(presences)
    written: dict[int, list[bool]] = {}  # units whose baseline held a gradient: token compared
    written_payload = b"[]"  # no rows when the step's start was not recorded
    if baseline is not None:
        _, tokens, held_at_start = baseline
        for index in held_at_start:
            now = backend.grad_tokens(rec.units[index])
            written[index] = [b != n for b, n in zip(tokens[index], now, strict=False)]
        if written:
            names = rec.unit_names
            written_payload = boundary_rows.join_rows(step, micro_step, [
                t for index, presence in enumerate(presences) for t in (
                    boundary_rows.written_tails(names[index], presence, written[index])
                    if index in written else held[index])])
        else:
            written_payload = boundary_rows.rows_of(step, micro_step, all_held)
    _framed(rec, "gradients").extend_json(boundary_rows.rows_of(step, micro_step,
                                                                gradient_tails))
    rec.writer.buffer("pending").extend(pending)
    _framed(rec, "grads_written").extend_json(written_payload)
    if rec.raise_on_violation:
        _keep_rows(rec, presences, pending, written if baseline is not None else None)


def _framed(rec: Recorder, table: str) -> FramedTable:
    rows = rec.writer.buffer(table)
    assert isinstance(rows, FramedTable)  # not one of journal_format.FIXED_TABLES
    return rows


def _keep_rows(rec: Recorder, presences: list[list[GradientPresence]], pending: list[tuple],
               written: dict[int, list[bool]] | None) -> None:
    """The boundary's rows as tuples on the recorder, for the live checks."""
    gradients: list[tuple] = []
    rows_written: list[tuple] = []
    for unit, presence in zip(rec.units, presences, strict=True):
        head = (rec.step, rec.micro_step, unit.name)
        gradients.extend([head + g for g in presence])
        if written is None:
            continue
        flags = written.get(unit.index)
        rows_written.extend(
            [head + (g.param, True) for g in presence if g.has_grad] if flags is None else
            [head + (g.param, w) for g, w in zip(presence, flags, strict=False) if g.has_grad])
    rec.boundary_gradients, rec.boundary_pending = gradients, pending
    rec.boundary_written = rows_written


def take_grad_baseline(rec: Recorder) -> None:
    """Every managed parameter's gradient token, at the step's first micro-step begin: after
    the previous step's ``zero_grad``, before anything of this step can write a gradient."""
    tokens = rec.backend.all_grad_tokens(rec.units)
    # Which units hold a gradient, found while the lists are fresh: the boundary then looks
    # at those units only (usually none: ``zero_grad()`` drops every gradient).
    held = [index for index, unit_tokens in enumerate(tokens)
            if unit_tokens.count(None) != len(unit_tokens)]
    rec.grad_baseline = (rec.step, tokens, held)


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
