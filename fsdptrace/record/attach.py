"""``fsdptrace.attach``: the one line a training script adds."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn

from fsdptrace.errors import FsdptraceError
from fsdptrace.record.backends.base import Backend
from fsdptrace.record.recorder import Recorder
from fsdptrace.record.writer import DEFAULT_CLOSE_TIMEOUT_S, DEFAULT_FLUSH_INTERVAL_S
from fsdptrace.store.env import DEFAULT_RUNS_ROOT, OVERRIDES_ENV, RAISE_ENV, RUN_DIR_ENV, STEPS_ENV

# The `fsdptrace record` option that settles each attach() argument named in OVERRIDES_ENV.
_OPTION_OF = {"run_dir": "--run-dir", "steps": "--steps", "raise_on_violation": "--raise"}


def resolve_run_dir(run_dir: str | os.PathLike[str] | None) -> Path:
    """``run_dir``, else ``$FSDPTRACE_RUN_DIR``, else a new ``./fsdptrace_runs/<timestamp>``."""
    if run_dir is not None:
        return Path(run_dir)
    from_env = os.environ.get(RUN_DIR_ENV)
    if from_env:
        return Path(from_env)
    # torchrun sets TORCHELASTIC_RUN_ID for all ranks alike; use it so ranks share a folder.
    stamp = os.environ.get("TORCHELASTIC_RUN_ID") or time.strftime("%Y%m%d-%H%M%S")
    return Path(DEFAULT_RUNS_ROOT) / stamp


def command_line_wins(
    run_dir: str | os.PathLike[str] | None,
    raise_on_violation: bool | None,
    steps: str | None,
    *,
    rank: int,
) -> tuple[str | os.PathLike[str] | None, bool | None, str | None]:
    """The arguments attach() uses when ``fsdptrace record`` settled some of them.

    An argument the command line settled (``$FSDPTRACE_OVERRIDES``) is dropped, so the
    environment's value applies; where the script asked otherwise, rank 0 says so in one line.
    """
    settled = set(filter(None, os.environ.get(OVERRIDES_ENV, "").split(",")))
    if "run_dir" in settled and run_dir is not None:
        wanted = Path(os.environ.get(RUN_DIR_ENV, "."))
        _say_overridden("run_dir", run_dir, Path(run_dir).resolve() != wanted.resolve(), rank)
        run_dir = None
    if "raise_on_violation" in settled and raise_on_violation is not None:
        _say_overridden("raise_on_violation", raise_on_violation, not raise_on_violation, rank)
        raise_on_violation = None
    if "steps" in settled and steps is not None:
        _say_overridden("steps", steps, steps != os.environ.get(STEPS_ENV), rank)
        steps = None
    return run_dir, raise_on_violation, steps


def _say_overridden(name: str, value: object, differs: bool, rank: int) -> None:
    if differs and rank == 0:
        shown = os.fspath(value) if isinstance(value, os.PathLike) else value
        print(f"fsdptrace: `fsdptrace record {_OPTION_OF[name]}` overrides "
              f"attach({name}={shown!r}) in the script", file=sys.stderr, flush=True)


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = torch.distributed
    initialized = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialized else int(os.environ.get("RANK", 0))
    if world_size is None:
        world_size = dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", 1))
    return rank, world_size


def select_backend(parts: Sequence[nn.Module]) -> Backend:
    """HSDP when any module carries an ``hsdp_scheduler``, else torch FSDP2."""
    from fsdptrace.record.backends.hsdp import HSDPBackend, has_hsdp_units

    if has_hsdp_units(parts):
        return HSDPBackend()
    from fsdptrace.record.backends.fsdp2.units import FSDP2Backend, has_fsdp2_units

    if not has_fsdp2_units(parts):
        raise FsdptraceError(
            "no FSDP units found in the model parts: call fsdptrace.attach after fully_shard "
            "(or on modules that carry an hsdp_scheduler)"
        )
    return FSDP2Backend()


def attach(
    model_parts: nn.Module | Sequence[nn.Module],
    *,
    run_dir: str | os.PathLike[str] | None = None,
    optimizer: object | None = None,
    raise_on_violation: bool | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    steps: str | None = None,
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
    close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
) -> Recorder:
    """Start recording the FSDP units of ``model_parts`` on this rank.

    ``model_parts`` is the root module, or a list of them (pipeline stages on one rank).
    Given ``optimizer``, boundaries are found automatically (a micro-step begins at each root
    forward; the step ends in the optimizer's step pre-hook, or when the closure of
    ``step(closure)`` returns). A trainer's wrapper (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``) is unwrapped to the torch optimizer inside. Otherwise call
    ``begin_micro_step`` / ``before_optimizer_step`` yourself. ``steps`` limits recording to
    chosen optimizer steps (``"10:20"``, ``"::5"``). With ``raise_on_violation``, checks 1-3
    run before each optimizer step and raise ``fsdptrace.LifecycleError`` on an error.
    ``close_timeout_s`` bounds ``close()`` and interpreter exit whatever the filesystem does.
    """
    parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
    if not parts:
        raise FsdptraceError("attach needs at least one model part")
    rank, world_size = _rank_and_world(rank, world_size)
    run_dir, raise_on_violation, steps = command_line_wins(
        run_dir, raise_on_violation, steps, rank=rank)
    if raise_on_violation is None:
        raise_on_violation = os.environ.get(RAISE_ENV, "") not in ("", "0")
    if steps is None:
        steps = os.environ.get(STEPS_ENV) or None
    from fsdptrace.record import registry

    registry.forget(parts)
    run_dir = resolve_run_dir(run_dir)
    registry.refuse_shared_run_dir(run_dir, rank)
    recorder = Recorder(
        parts,
        select_backend(parts),
        run_dir=run_dir,
        rank=rank,
        world_size=world_size,
        optimizer=optimizer,
        raise_on_violation=raise_on_violation,
        steps=steps,
        flush_interval_s=flush_interval_s,
        close_timeout_s=close_timeout_s,
    )
    registry.remember(parts, recorder)
    return recorder
