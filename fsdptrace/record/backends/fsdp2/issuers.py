"""Who issued an FSDP2 all-gather: FSDP2's callers of ``FSDPParamGroup.unshard``.

The stack is read by ``backends.issuers`` (shared with HSDP); this module says what FSDP2's
paths are. ``pre_forward``/``pre_backward`` of the group itself is ``own``,
``FSDPParamGroup._prefetch_unshard`` called from a state's ``_pre_forward``/``_pre_backward`` is
an explicit ``prefetch`` (the source is that state), called from a group's
``_backward_prefetch`` it is FSDP2's ``implicit`` reverse-post-forward prefetch, and
``FSDPModule.unshard`` is ``manual``. FSDP2 re-runs a unit's pre-forward in activation-checkpoint
recompute, so a gather reached through the forward path while autograd runs backward is
``recompute``.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from fsdptrace.record.backends import issuers as shared
from fsdptrace.record.backends.fsdp2.state import param_groups
from fsdptrace.record.backends.issuers import (  # noqa: F401  (FSDP2's readers import them here)
    IMPLICIT,
    ISSUER_KINDS,
    MANUAL,
    MAX_FOREIGN_FRAMES,
    OTHER,
    OWN,
    PREFETCH,
    RECOMPUTE,
    Issuers,
)

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder

PATHS = shared.Paths(
    framework="FSDP2",
    callers={
        ("_fsdp_param_group.py", "pre_forward"): shared.FORWARD_OWN,
        ("_fsdp_param_group.py", "pre_backward"): OWN,
        ("_fsdp_state.py", "_pre_forward"): shared.FORWARD_OWN,  # recompute re-gathers its own
        ("_fsdp_param_group.py", "_prefetch_unshard"): shared.PREFETCH_FRAME,
        ("_fully_shard.py", "unshard"): MANUAL,
    },
    prefetchers={"_backward_prefetch": IMPLICIT, "_pre_forward": shared.FORWARD_OWN,
                 "_pre_backward": PREFETCH},
    known="pre-forward, pre-backward, prefetch, FSDPModule.unshard")


def fsdp2_dir(group: Any) -> str:
    """The folder of FSDP2's sources (``_fully_shard/``; ``_composable/fsdp/`` before 2.6).

    Read from the module that defines the group's class: the methods themselves may be
    someone's wrappers by now.
    """
    module = sys.modules.get(type(group).__module__)
    return os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or ""))


def for_recorder(rec: Recorder) -> Issuers | None:
    """The recorder's ``Issuers``, shared by ``provenance`` and ``collectives`` (None when no
    unit has a parameter group)."""
    return shared.for_recorder(rec, lambda: _build(rec))


def _build(rec: Recorder) -> Issuers | None:
    unit_of: dict[int, int] = {}  # id(state) or id(group) -> unit index
    first = None
    for unit in rec.units:
        unit_of[id(unit.handle)] = unit.index
        for group in param_groups(unit.handle):
            unit_of[id(group)] = unit.index
            first = group if first is None else first
    if first is None:
        return None
    return Issuers(PATHS, fsdp2_dir(first), unit_of=unit_of, unit_names=rec.unit_names,
                   rank=rec.rank)
