"""Who issued an FSDP2 all-gather, read from the call stack of ``FSDPParamGroup.unshard``.

The stack, not flags we would have to keep in sync with FSDP's control flow:
``pre_forward``/``pre_backward`` of the group itself is ``own``,
``FSDPParamGroup._prefetch_unshard`` called from a state's ``_pre_forward``/``_pre_backward`` is
an explicit ``prefetch`` (the source is that state), called from a group's
``_backward_prefetch`` it is FSDP2's ``implicit`` reverse-post-forward prefetch, and
``FSDPModule.unshard`` is ``manual``. A gather reached through the forward path while autograd
runs backward is activation-checkpoint recompute (``recompute``): FSDP2 re-runs the unit's
pre-forward, forward prefetch included, and CHECKS.md keeps recompute out of forward findings.

Other tools wrap these methods too (memory trackers, profilers, test harnesses), on the class
or on the instance, before or after fsdptrace, so the caller of our wrapper may be theirs.
The walk skips frames whose code is not FSDP2's own, up to ``MAX_FOREIGN_FRAMES``; each code
object is classified once, and a call straight from FSDP2 costs one dict lookup. A gather
whose stack holds no FSDP2 path known here is ``other``, said in one warning per recorder.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import CodeType, FrameType
from typing import Any

ISSUER_KINDS = ("own", "prefetch", "implicit", "manual", "other", "recompute")
OWN, PREFETCH, IMPLICIT, MANUAL, OTHER, RECOMPUTE = range(6)
# A pass-through wrapper adds a frame (a functools.wraps closure) or two (with a context
# manager); two tools stacked, four. Deeper foreign code is the caller, not a wrapper.
MAX_FOREIGN_FRAMES = 4

_PREFETCH_FRAME = -1  # ``_prefetch_unshard``: the issuer is the next FSDP2 frame further out
_FORWARD_OWN = -2  # the unit's own pre-forward: recompute when it runs inside backward
_FSDP2_OTHER = -3  # FSDP2 code not in ``_CALLERS``: a path this module does not know
_FOREIGN = -4  # not FSDP2's code: a wrapper (or the user's code); walk past it

# (file, function) of FSDP2's callers of ``FSDPParamGroup.unshard``.
_CALLERS: dict[tuple[str, str], int] = {
    ("_fsdp_param_group.py", "pre_forward"): _FORWARD_OWN,
    ("_fsdp_param_group.py", "pre_backward"): OWN,
    ("_fsdp_state.py", "_pre_forward"): _FORWARD_OWN,  # recompute re-gathers its own
    ("_fsdp_param_group.py", "_prefetch_unshard"): _PREFETCH_FRAME,
    ("_fully_shard.py", "unshard"): MANUAL,
}


def fsdp2_dir(group: Any) -> str:
    """The folder of FSDP2's sources (``_fully_shard/``; ``_composable/fsdp/`` before 2.6).

    Read from the module that defines the group's class: the methods themselves may be
    someone's wrappers by now.
    """
    module = sys.modules.get(type(group).__module__)
    return os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or ""))


def classify(code: CodeType, fsdp2_dir: str) -> int:
    """What a frame running ``code`` says about the issuer (see ``_CALLERS``)."""
    if os.path.dirname(os.path.abspath(code.co_filename)) != fsdp2_dir:
        return _FOREIGN
    return _CALLERS.get((os.path.basename(code.co_filename), code.co_name), _FSDP2_OTHER)


class Issuers:
    """Attributes ``unshard`` calls for one recorder; warns once about one it cannot."""

    def __init__(self, fsdp2_dir: str, *, unit_of: dict[int, int], unit_names: list[str],
                 rank: int) -> None:
        self.fsdp2_dir = fsdp2_dir
        self.unit_of = unit_of  # id(state) or id(group) -> unit index
        self.unit_names = unit_names
        self.rank = rank
        self._codes: dict[CodeType, int] = {}
        self._warned = False

    def of(self, frame: FrameType | None, unit: int, backward: bool) -> tuple[int, int]:
        """(issuer kind, issuer unit index or -1) for an ``unshard`` called from ``frame``."""
        # Most calls come straight from FSDP2: one lookup, no walk.
        kind = self._codes.get(frame.f_code, _FOREIGN) if frame is not None else _FOREIGN
        fsdp_frame = frame
        if kind == _FOREIGN:
            kind, fsdp_frame = self.fsdp2_caller(frame)
        if kind == _FORWARD_OWN:
            return (RECOMPUTE if backward else OWN), unit
        if kind in (OWN, MANUAL):
            return kind, (unit if kind == OWN else -1)
        outer = None
        if kind == _PREFETCH_FRAME and fsdp_frame is not None:
            _, outer = self.fsdp2_caller(fsdp_frame.f_back)
        if outer is None:
            self._warn(frame, fsdp_frame, unit)
            return OTHER, -1
        source_unit = self.unit_of.get(id(outer.f_locals.get("self")), -1)
        name = outer.f_code.co_name
        if name == "_backward_prefetch":
            return IMPLICIT, source_unit
        if name == "_pre_forward":
            return (RECOMPUTE if backward else PREFETCH), source_unit
        if name == "_pre_backward":
            return PREFETCH, source_unit
        self._warn(frame, outer, unit)
        return OTHER, source_unit

    def fsdp2_caller(self, frame: FrameType | None) -> tuple[int, FrameType | None]:
        """The first frame from ``frame`` outward that runs FSDP2's code, and its class.

        (``_FOREIGN``, None) when none is found within ``MAX_FOREIGN_FRAMES`` frames.
        """
        codes = self._codes
        for _ in range(MAX_FOREIGN_FRAMES + 1):
            if frame is None:
                break
            code = frame.f_code
            kind = codes.get(code)
            if kind is None:
                kind = codes[code] = classify(code, self.fsdp2_dir)
            if kind != _FOREIGN:
                return kind, frame
            frame = frame.f_back
        return _FOREIGN, None

    def _warn(self, frame: FrameType | None, fsdp_frame: FrameType | None, unit: int) -> None:
        """One warning per recorder: the first gather no known FSDP2 path issued, and where."""
        if self._warned:
            return
        self._warned = True
        where = fsdp_frame or frame
        origin = ("an unknown caller" if where is None else
                  f"{where.f_code.co_name} ({where.f_code.co_filename}:{where.f_lineno})")
        warnings.warn(
            f"fsdptrace: rank {self.rank}: an all-gather of {self.unit_names[unit]} came from "
            f"{origin}, not from a path of FSDP2 that fsdptrace knows (pre-forward, "
            f"pre-backward, prefetch, FSDPModule.unshard) within {MAX_FOREIGN_FRAMES} wrapper "
            "frames; it and any like it are recorded with issuer 'other', which the prefetch "
            "checks (8, 9) do not judge",
            RuntimeWarning, stacklevel=2)
