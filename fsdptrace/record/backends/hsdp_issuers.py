"""Who issued an HSDP all-gather: hyper_parallel's callers of ``hsdp_state.unshard``.

The stack is read by ``backends.issuers`` (shared with FSDP2); this module says what
hyper_parallel 0.1's paths are: the scheduler's ``_hsdp_forward_pre_hook`` (the unit's own
gather, ``recompute`` when it runs inside backward) and ``_hsdp_backward_pre_hook`` (its own,
with ``reshard_after_forward``); ``hsdp_state.prefetch`` called from either of those on the
source unit's scheduler (``prefetch``, the source read from that frame's ``self``); and
``HSDPModule.unshard`` (``manual``).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from fsdptrace.record.backends import issuers as shared
from fsdptrace.record.backends.issuers import MANUAL, OWN, PREFETCH, Issuers

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder

PATHS = shared.Paths(
    framework="hyper_parallel",
    callers={
        ("hsdp_scheduler.py", "_hsdp_forward_pre_hook"): shared.FORWARD_OWN,
        ("hsdp_scheduler.py", "_hsdp_backward_pre_hook"): OWN,
        ("hsdp_state.py", "prefetch"): shared.PREFETCH_FRAME,
        ("api.py", "unshard"): MANUAL,  # HSDPModule.unshard
    },
    prefetchers={"_hsdp_forward_pre_hook": shared.FORWARD_OWN,
                 "_hsdp_backward_pre_hook": PREFETCH},
    known="the scheduler's pre-forward and pre-backward, hsdp_state.prefetch, "
          "HSDPModule.unshard")


def package_dir(state: Any) -> str:
    """hyper_parallel's top folder: its callers live in ``core/`` and ``platform/<name>/``."""
    package = sys.modules.get(type(state).__module__.split(".", 1)[0])
    return os.path.dirname(os.path.abspath(getattr(package, "__file__", None) or ""))


def for_recorder(rec: Recorder) -> Issuers | None:
    """The recorder's ``Issuers``, shared by ``hsdp_provenance`` and ``hsdp_collectives``
    (None when no unit has an ``hsdp_state``)."""
    return shared.for_recorder(rec, lambda: _build(rec))


def _build(rec: Recorder) -> Issuers | None:
    states = [state for unit in rec.units
              if (state := getattr(unit.handle, "hsdp_state", None)) is not None]
    if not states:
        return None
    unit_of = {id(unit.handle): unit.index for unit in rec.units}  # id(scheduler) -> unit
    return Issuers(PATHS, package_dir(states[0]), unit_of=unit_of, unit_names=rec.unit_names,
                   rank=rec.rank)
