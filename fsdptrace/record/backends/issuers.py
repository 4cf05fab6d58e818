"""Who issued an all-gather, read from the call stack of a framework's unshard: every backend's.

The stack, not flags we would have to keep in sync with the framework's control flow. A
backend describes its framework in ``Paths``: which of its functions call the unit's unshard
(the unit's own pre-forward or pre-backward, its prefetch, the user's manual ``unshard()``),
and which functions call that prefetch. A prefetch reached from a pre-forward while autograd
runs backward is activation-checkpoint recompute (``recompute``): the framework re-runs the
unit's pre-forward, its forward prefetch included, and docs/checks.md keeps recompute out of
forward findings.

Other tools wrap these methods too (memory trackers, profilers, test harnesses), on the class
or on the instance, before or after fsdptrace, so the caller of our wrapper may be theirs.
The walk skips frames whose code is not the framework's own, up to ``MAX_FOREIGN_FRAMES``; each
code object is classified once, and a call straight from the framework costs one dict lookup.
A gather whose stack holds no path ``Paths`` knows is ``other``, said in one warning per
recorder.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

ISSUER_KINDS = ("own", "prefetch", "implicit", "manual", "other", "recompute")
OWN, PREFETCH, IMPLICIT, MANUAL, OTHER, RECOMPUTE = range(6)
# A pass-through wrapper adds a frame (a functools.wraps closure) or two (with a context
# manager); two tools stacked, four. Deeper foreign code is the caller, not a wrapper.
MAX_FOREIGN_FRAMES = 4

# What a frame of the framework's own code says, besides OWN and MANUAL:
PREFETCH_FRAME = -1  # the framework's prefetch: the issuer is the next framework frame out
FORWARD_OWN = -2  # the unit's own pre-forward: recompute when it runs inside backward
FRAMEWORK_OTHER = -3  # the framework's code, not a path ``Paths`` knows
FOREIGN = -4  # not the framework's code: a wrapper (or the user's code); walk past it


@dataclass(frozen=True)
class Paths:
    """One framework's callers of its unit unshard, named by (file, function)."""

    framework: str  # for the warning: "FSDP2", "hyper_parallel"
    # Each caller of the unshard: OWN, MANUAL, FORWARD_OWN or PREFETCH_FRAME.
    callers: dict[tuple[str, str], int]
    # Each caller of a PREFETCH_FRAME, by function name: PREFETCH, IMPLICIT, or FORWARD_OWN
    # (a forward prefetch, recompute inside backward). Its ``self`` is the source unit's.
    prefetchers: dict[str, int]
    known: str  # the known paths in words, for the warning


class Issuers:
    """Attributes unshard calls for one recorder; warns once about one it cannot."""

    def __init__(self, paths: Paths, source_dir: str, *, unit_of: dict[int, int],
                 unit_names: list[str], rank: int) -> None:
        self.paths = paths
        self.source_dir = os.path.abspath(source_dir) + os.sep
        self.unit_of = unit_of  # id(a prefetcher's ``self``) -> unit index
        self.unit_names = unit_names
        self.rank = rank
        self._codes: dict[CodeType, int] = {}
        self._warned = False

    def of(self, frame: FrameType | None, unit: int, backward: bool) -> tuple[int, int]:
        """(issuer kind, issuer unit index or -1) for an unshard called from ``frame``."""
        # Most calls come straight from the framework: one lookup, no walk.
        kind = self._codes.get(frame.f_code, FOREIGN) if frame is not None else FOREIGN
        own_frame = frame
        if kind == FOREIGN:
            kind, own_frame = self.caller(frame)
        if kind == FORWARD_OWN:
            return (RECOMPUTE if backward else OWN), unit
        if kind in (OWN, MANUAL):
            return kind, (unit if kind == OWN else -1)
        outer = None
        if kind == PREFETCH_FRAME and own_frame is not None:
            _, outer = self.caller(own_frame.f_back)
        if outer is None:
            self._warn(own_frame or frame, unit)
            return OTHER, -1
        source_unit = self.unit_of.get(id(outer.f_locals.get("self")), -1)
        prefetcher = self.paths.prefetchers.get(outer.f_code.co_name)
        if prefetcher == FORWARD_OWN:
            return (RECOMPUTE if backward else PREFETCH), source_unit
        if prefetcher is not None:
            return prefetcher, source_unit
        self._warn(outer, unit)
        return OTHER, source_unit

    def caller(self, frame: FrameType | None) -> tuple[int, FrameType | None]:
        """The first frame from ``frame`` outward that runs the framework's code, and what it
        says; (``FOREIGN``, None) when none is found within ``MAX_FOREIGN_FRAMES`` frames."""
        codes = self._codes
        for _ in range(MAX_FOREIGN_FRAMES + 1):
            if frame is None:
                break
            code = frame.f_code
            kind = codes.get(code)
            if kind is None:
                kind = codes[code] = self._classify(code)
            if kind != FOREIGN:
                return kind, frame
            frame = frame.f_back
        return FOREIGN, None

    def _classify(self, code: CodeType) -> int:
        if not os.path.abspath(code.co_filename).startswith(self.source_dir):
            return FOREIGN
        return self.paths.callers.get((os.path.basename(code.co_filename), code.co_name),
                                      FRAMEWORK_OTHER)

    def _warn(self, where: FrameType | None, unit: int) -> None:
        """One warning per recorder: the first gather no known path issued, and where."""
        if self._warned:
            return
        self._warned = True
        origin = ("an unknown caller" if where is None else
                  f"{where.f_code.co_name} ({where.f_code.co_filename}:{where.f_lineno})")
        warnings.warn(
            f"fsdptrace: rank {self.rank}: an all-gather of {self.unit_names[unit]} came from "
            f"{origin}, not from a path of {self.paths.framework} that fsdptrace knows "
            f"({self.paths.known}) within {MAX_FOREIGN_FRAMES} wrapper frames; it and any like "
            "it are recorded with issuer 'other', which the prefetch checks (8, 9) do not judge",
            RuntimeWarning, stacklevel=2)


# One ``Issuers`` per recorder, shared by a backend's provenance and collectives: one code
# cache, and one warning per recorder about an unknown path, not one per reader of the stack.
_of_recorder: weakref.WeakKeyDictionary[Any, Issuers] = weakref.WeakKeyDictionary()


def for_recorder(rec: Any, build: Callable[[], Issuers | None]) -> Issuers | None:
    """The recorder's ``Issuers``, made by ``build`` the first time it makes one (None: no unit
    gathers parameters)."""
    found = _of_recorder.get(rec)
    if found is None:
        found = build()
        if found is not None:
            _of_recorder[rec] = found
    return found
