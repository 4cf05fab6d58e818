"""Gradient-accumulation settings for FSDP2 and HSDP model parts, recorded per micro-step.

Trainers switch gradient synchronisation and post-backward resharding off between the
micro-steps of one optimizer step and back on for the last. Getting that wrong is silent
(gradients never reduced, or reduced every micro-step at full cost), so these helpers also
write what they set into the active recorder: a post-mortem then shows, per micro-step,
whether gradient sync was on. Both work on anything with FSDP2's setters (``fully_shard``
modules, and HSDP cells, which expose the same names).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsdptrace.store import schema


def model_reshard(model_parts: Sequence[Any], *, reshard_after_backward: bool,
                  micro_step: int, num_micro_steps: int) -> None:
    """Keep parameters gathered between micro-steps when ``reshard_after_backward`` is off.

    With accumulation, the first micro-step turns resharding after backward off (the next
    forward then skips its all-gathers) and the last turns it back on, so nothing stays
    gathered across ``optimizer.step()``. With resharding on or one micro-step, nothing changes.
    """
    if reshard_after_backward or num_micro_steps <= 1:
        return
    if micro_step == 0:
        value = False
    elif micro_step == num_micro_steps - 1:
        value = True
    else:
        return
    for part in model_parts:
        part.set_reshard_after_backward(value)
    _note(model_parts, f"micro_step={micro_step} reshard_after_backward={value}")


def configure_gradient_sync(model_parts: Sequence[Any], *, requires_grad_sync: bool,
                            dp_shard_size: int, dp_replicate_size: int, micro_step: int,
                            num_micro_steps: int) -> None:
    """Reduce gradients only on the last micro-step unless ``requires_grad_sync`` asks always.

    Only when there is something to save (sharded over several ranks and several micro-steps).
    The last micro-step is also marked as the last backward, which lets FSDP drop stray
    prefetched all-gathers before the optimizer; with HSDP (``dp_replicate_size > 1``) the
    all-reduce across replicas runs only on the last micro-step too.
    """
    if dp_shard_size <= 1 or num_micro_steps <= 1:
        return
    is_last = micro_step == num_micro_steps - 1
    requires_sync = requires_grad_sync or is_last
    is_hsdp = dp_replicate_size > 1
    for part in model_parts:
        part.set_requires_gradient_sync(requires_sync)
        part.set_is_last_backward(is_last)
        if is_hsdp:
            part.set_requires_all_reduce(is_last)
    detail = (f"micro_step={micro_step} requires_gradient_sync={requires_sync} "
              f"is_last_backward={is_last}")
    if is_hsdp:
        detail += f" requires_all_reduce={is_last}"
    _note(model_parts, detail)


def _note(model_parts: Sequence[Any], detail: str) -> None:
    """One marker per recorder attached to these parts (none when nothing records)."""
    from fsdptrace.record.registry import recorder_of

    recorders = {id(r): r for r in (recorder_of(part) for part in model_parts) if r is not None}
    for recorder in recorders.values():
        recorder.note(schema.MARKER_GRAD_SYNC, detail)


__all__ = ["configure_gradient_sync", "model_reshard"]
