"""The in-process flight recorder: hooks on FSDP units, step bookkeeping, safe shutdown.

Design rules, each learned the hard way by flight recorders:
- the training thread only stores tuples into a memory-mapped journal (no syscall, no pandas,
  no lock but the markers'), so a row is in a file the kernel keeps once the hook returns;
- every entry is recorded *before* FSDP issues that unit's collectives, so a rank blocked in
  an all-gather still shows where it is;
- any exception inside a hook disables recording with one warning and never reaches training
  (live raising is the one deliberate exception).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdptrace.errors import LifecycleError
from fsdptrace.record import flight_recorder, guards, hooks, optimizer_boundary, snapshots
from fsdptrace.record.backends.base import Backend, PrefetchSeen, Unit
from fsdptrace.record.boundary_rows import BoundaryRows
from fsdptrace.record.journal import FixedTable
from fsdptrace.record.writer import (
    DEFAULT_CLOSE_TIMEOUT_S,
    DEFAULT_FLUSH_INTERVAL_S,
    ChunkWriter,
    WriterProcessError,
)
from fsdptrace.store import schema
from fsdptrace.store.steps import parse_steps
from fsdptrace.version import __version__

log = logging.getLogger("fsdptrace")


_PHASE_CODE = {schema.FORWARD: 0, schema.BACKWARD: 1}


class Recorder:
    """Records one rank's FSDP lifecycle to a run dir. Create it with ``fsdptrace.attach``."""

    def __init__(
        self,
        parts: Sequence[nn.Module],
        backend: Backend,
        *,
        run_dir: Path,
        rank: int,
        world_size: int,
        optimizer: object | None = None,
        raise_on_violation: bool = False,
        steps: str | None = None,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
    ) -> None:
        self.parts = list(parts)
        self.backend = backend
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.world_size = world_size
        self.raise_on_violation = raise_on_violation
        self.window = parse_steps(steps)
        self.close_timeout_s = close_timeout_s
        self.step = 0
        self.micro_step = 0
        self.enabled = True
        self._closed = False
        self._warned: set[str] = set()
        self._seq = 0
        self._micro_started = False
        # Open from a micro-step's first root forward until ``before_optimizer_step``: a close
        # while it is open is never clean.
        self._micro_open = False
        self._ending: str | None = None  # the first ending recorded wins
        self._stashed_error: BaseException | None = None  # seen unwinding a part root's forward
        self._manual_micro_steps = False
        self._parts_seen: set[int] = set()
        self.in_eval = False
        self.recording = self.window.contains(0)
        self.prefetch_seen = PrefetchSeen()
        self.units: list[Unit] = backend.discover_units(self.parts)
        self.unit_names = [u.name for u in self.units]
        self.writer = ChunkWriter(
            self.run_dir,
            rank=rank,
            version=__version__,
            writer_id=f"j{os.getpid()}_{time.time_ns() % 10**9:09d}",
            flush_interval_s=flush_interval_s,
            on_failure=self._on_writer_failure,
            on_notice=lambda kind, detail: self._mark(kind, 0, detail),
        )
        events = self.writer.buffer("events", {"phase": schema.PHASES, "unit": self.unit_names})
        assert isinstance(events, FixedTable)  # journal_format.FIXED_TABLES
        self.events = events
        self.markers = self.writer.buffer("markers")
        # Parameters are coded by their position in the units' lists, all units in a row.
        self.param_offsets = [0]
        for u in self.units:
            self.param_offsets.append(self.param_offsets[-1] + len(u.param_names))
        self.backward_grads = self.writer.buffer("backward_grads", {
            "unit": self.unit_names, "param": [p for u in self.units for p in u.param_names],
            "state": schema.GRAD_STATES, "via": schema.GRAD_VIAS})
        self.eval_forwards = self.writer.buffer("eval_forwards", {
            "unit": self.unit_names, "grad_mode": schema.GRAD_MODES})
        self.last_settings: list[tuple[object, ...] | None] = [None] * len(self.units)
        self.settings_key: object = None  # the backend's raw settings at the last check
        # (step, tokens per unit, positions of the units holding any) taken at the step's
        # first micro-step (``grads_written``).
        self.grad_baseline: tuple[int, list[list[object]], list[int]] | None = None
        self.live_events: list[tuple] | None = [] if raise_on_violation else None
        # The last boundary snapshot's rows (schema.GRADIENTS / schema.PENDING order), kept
        # for the live checks only; ``boundary_rows`` encodes the stored ones.
        self.boundary_rows = BoundaryRows(self.unit_names)
        self.boundary_gradients: list[tuple] = []
        self.boundary_pending: list[tuple] = []
        self.boundary_written: list[tuple] = []
        if self.writer.init_error is not None:
            self._on_writer_failure(self.writer.init_error)
        self._write_static_tables(steps)
        self.writer.start()
        self._handles = hooks.install(self)
        self._optimizer_handle = (
            optimizer_boundary.hook_optimizer(optimizer, self.before_optimizer_step)
            if optimizer is not None else None
        )
        guards.install(self)

    # ----------------------------------------------------------------- public API
    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        if isinstance(exc, LifecycleError):
            # Raised at a complete optimizer boundary with its findings on disk: nothing was
            # cut off, so the recording ends cleanly (the checks keep the last micro-step).
            self._micro_open = False
        elif exc is not None:
            self.end_with_exception(exc)
        self.close()

    def begin_micro_step(self, step: int, micro_step: int) -> None:
        """Mark a micro-step boundary yourself (trainers that number their own steps)."""
        self._manual_micro_steps = True
        if step != self.step:
            self.step = step
            self.recording = self.enabled and self.window.contains(step)
        self._start_micro_step(micro_step)

    def before_optimizer_step(self) -> None:
        """Snapshot gradients and pending all-gathers; run live checks if asked; close the step."""
        if self._closed:
            return
        if self.recording:
            self._guard("boundary snapshot", snapshots.record_boundary, self)
            if self.raise_on_violation:
                from fsdptrace.record.live import raise_if_unsafe

                raise_if_unsafe(self)
            # Unrecorded steps cost no byte: their boundaries are not marked either.
            self._mark(schema.MARKER_OPTIMIZER_STEP, 0, "")
        self._micro_open = False
        self._stashed_error = None
        self.step += 1
        self.micro_step = 0
        self._micro_started = False
        self._parts_seen.clear()
        if self.live_events is not None:
            self.live_events.clear()
        self.recording = self.enabled and self.window.contains(self.step)
        self.writer.request_flush()

    def closes_step_at_any_optimizer(self) -> bool:
        """Whether an optimizer step outside this recorder's own hook closes its step.

        Not when its own optimizer hook does, nor when the script numbers steps itself
        (``begin_micro_step`` then ``before_optimizer_step``), nor when no training forward ran
        since the last boundary: a second optimizer in the same step adds nothing.
        """
        return (self._optimizer_handle is None and not self._manual_micro_steps
                and self._micro_started)

    def note(self, kind: str, detail: str) -> None:
        """Add a marker from outside the hooks (trainer helpers), if this step is recorded."""
        if self.recording and not self._closed:
            self._mark(kind, 0, detail)

    def flush(self) -> None:
        """Every row is durable in the journal already; ask for full segments to be converted."""
        self.writer.request_flush()

    def close(self, *, error: str | None = None) -> None:
        """Remove hooks, write how the recording ended, convert the journal. Safe to call twice.

        Returns within ``close_timeout_s`` whatever the filesystem does: what the writer
        could not convert by then stays in the journal, which the reader folds in.

        ``error`` marks a crash ("Type: message"). Without one, the ending is clean only with
        no micro-step open; a signal or exception recorded earlier stays the ending.
        """
        if self._closed:
            return
        if error is not None:
            self._end(schema.MARKER_CRASH, error)
        elif self._stashed_error is not None:
            self.end_with_exception(self._stashed_error)
        elif self._micro_open:
            self._end(schema.MARKER_CLOSED_MID_STEP,
                      f"step {self.step}, micro-step {self.micro_step}")
        else:
            self._end(schema.MARKER_CLOSE, "")
        self._closed = True
        # Gradient hooks already on live tensors may still fire; they must not append
        # rows nobody will write.
        self.recording = False
        for handle in self._handles:
            handle.remove()
        if self._optimizer_handle is not None:
            self._optimizer_handle.remove()
        guards.remove(self)
        self.writer.close(self.close_timeout_s)
        # A closed recorder holds no reference to the model.
        self.parts, self.units, self._handles = [], [], []
        self._optimizer_handle = None
        self._stashed_error = None

    # ----------------------------------------------------------------- endings
    def _end(self, kind: str, detail: str) -> bool:
        """Record how the recording ended, once: the first ending wins."""
        if self._ending is not None or self._closed:
            return False
        self._ending = kind
        self._mark(kind, 0, detail[:2000])
        if kind != schema.MARKER_CLOSE:
            flight_recorder.save(self.run_dir, self.rank)
        return True

    def end_with_signal(self, name: str) -> bool:
        """*terminated* by a handled signal (from the signal watcher or the main thread)."""
        return self._end(schema.MARKER_TERMINATED, name)

    def end_with_exception(self, error: BaseException) -> bool:
        """*crashed*: an exception left the training code (a KeyboardInterrupt is SIGINT)."""
        if isinstance(error, KeyboardInterrupt):
            return self.end_with_signal("SIGINT")
        return self._end(schema.MARKER_CRASH, f"{type(error).__name__}: {error}")

    def stash_exception(self, error: BaseException) -> None:
        """An exception unwinding through a part root's forward; the close reports it unless
        training caught it and went on (the next forward or optimizer step forgets it)."""
        self._stashed_error = error

    def abort_micro_step(self) -> None:
        """``reset_iter_state()``: the open micro-step was abandoned, not run that way."""
        if self._micro_open and not self._closed:
            self._mark(schema.MARKER_ABORTED, 0, "reset_iter_state")
        self._micro_open = False

    def forked_off(self) -> None:
        """In a forked child: record nothing, write nothing, and leave no ending behind."""
        self._closed = True
        self.enabled = False
        self.recording = False
        self.writer.abandon()

    @property
    def bytes_written(self) -> int:
        return self.writer.bytes_written

    # ----------------------------------------------------------------- hot path helpers
    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def record_unit(self, unit_index: int, phase_code: int) -> None:
        # The hot path: next_seq inlined (one call less per unit entry).
        self._seq = seq = self._seq + 1
        t_ns = time.monotonic_ns()
        self.events.append_event(seq, t_ns, self.step, self.micro_step, phase_code, unit_index)
        if self.live_events is not None:
            self.live_events.append((seq, t_ns, self.step, self.micro_step, phase_code,
                                     unit_index))

    def record_eval(self, unit_index: int) -> None:
        """A unit forward with gradients disabled: its own table, never a micro-step's order."""
        self._seq = seq = self._seq + 1
        mode = 1 if torch.is_inference_mode_enabled() else 0
        self.eval_forwards.append((seq, time.monotonic_ns(), self.step, unit_index, mode))

    def record_backward_grads(self, unit_index: int, first: int, states: list[int],
                              via: int) -> None:
        """One unit post-backward's parameter states (``schema.BACKWARD_GRADS``), written
        before the backend calls through to the reduce-scatter; settings too if changed."""
        offset = self.param_offsets[unit_index]
        limit = self.param_offsets[unit_index + 1]
        step, micro_step, append = self.step, self.micro_step, self.backward_grads.append
        t_ns = time.monotonic_ns()
        seq = self._seq
        for position, state in enumerate(states, offset + first):
            seq += 1
            append((seq, t_ns, step, micro_step, unit_index,
                    position if position < limit else -1, state, via))
        self._seq = seq
        snapshots.record_unit_settings_if_changed(self, self.units[unit_index])

    def on_part_forward(self, part: int) -> bool:
        """Called first at each part root forward; returns False for eval forwards."""
        if not torch.is_grad_enabled():
            self.in_eval = True
            return False
        self.in_eval = False
        self._stashed_error = None
        if not self._manual_micro_steps:
            if not self._micro_started:
                self._start_micro_step(0)
            elif part in self._parts_seen:
                self._start_micro_step(self.micro_step + 1)
        self._parts_seen.add(part)
        return True

    @property
    def active(self) -> bool:
        return self.recording and not self.in_eval

    # ----------------------------------------------------------------- internals
    def _start_micro_step(self, micro_step: int) -> None:
        self.micro_step = micro_step
        self._micro_started = True
        self._micro_open = True
        self._parts_seen.clear()
        if self.recording:
            self._mark(schema.MARKER_MICRO_STEP, 0, "")
            self._guard("prefetch edges", snapshots.record_prefetch_if_changed, self)
            self._guard("settings", snapshots.record_settings_if_changed, self)
            if self.grad_baseline is None or self.grad_baseline[0] != self.step:
                self._guard("gradient baseline", snapshots.take_grad_baseline, self)

    def _mark(self, kind: str, count: int, detail: str) -> None:
        self.markers.append(
            (self.next_seq(), time.monotonic_ns(), self.step, self.micro_step, kind, count, detail)
        )

    def _guard(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as error:  # recording must never break training
            self.disable(f"{what} failed: {type(error).__name__}: {error}")
            return None

    def disable(self, reason: str) -> None:
        """Stop recording (hooks become no-ops) after one warning; training goes on."""
        if not self.enabled:
            return
        self.enabled = False
        self.recording = False
        warnings.warn(f"fsdptrace: recording disabled on rank {self.rank}: {reason}",
                      RuntimeWarning, stacklevel=2)
        self._mark(schema.MARKER_DISABLED, 0, reason)

    def _on_writer_failure(self, error: BaseException) -> None:
        what = error if isinstance(error, WriterProcessError) else (
            f"{type(error).__name__}: {error}")
        self.disable(f"cannot write to {self.run_dir}: {what}")

    def _write_static_tables(self, steps: str | None) -> None:
        self.writer.buffer("meta").append(
            (self.world_size, socket.gethostname(), os.getpid(), self.backend.name,
             torch.__version__, __version__, schema.SCHEMA_VERSION, time.time_ns(),
             time.monotonic_ns(), len(self.parts), steps or "", self.raise_on_violation)
        )
        units = self.writer.buffer("units")
        for u in self.units:
            units.append((u.name, u.part, u.fqn, u.module_type, u.is_root, len(u.param_names),
                          u.num_param_elements, list(u.param_names)))


def phase_code(phase: str) -> int:
    return _PHASE_CODE[phase]
