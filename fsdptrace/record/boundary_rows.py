"""The optimizer boundary's ``gradients`` and ``grads_written`` rows, encoded once per answer.

A boundary stores a ``gradients`` row per managed parameter and a ``grads_written`` row per
gradient held: ~1,000 of each at 256 units of 4 parameters. Built as tuples and encoded with
``json.dumps`` every step they cost ~1.2 ms, as much as reading the gradients
(``benchmarks/boundary_cost.py --breakdown``). A row is ``[step,micro_step`` followed by a tail
(unit, parameter, answer) that changes only when the parameter's answer does, so the tails of
each unit's last answers are kept, encoded, and a boundary joins them under one head: the
same JSON list ``FramedTable.extend`` writes, so the journal and its readers are unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

# A ``backends.base.GradientPresence`` (param, has_grad, source), typed as the tuple it is:
# ``backends.base`` types the recorder's ``boundary_rows`` with this module's class.
Answer = tuple[str, bool, str]

_COMPACT = (",", ":")  # FramedTable.extend's separators: the same bytes as a row list


def _tail(*values: object) -> bytes:
    """``,<values>]``: a row's JSON after its ``[step,micro_step`` head."""
    return b"," + json.dumps(list(values), separators=_COMPACT).encode()[1:]


def join_rows(step: int, micro_step: int, tails: Sequence[bytes]) -> bytes:
    """The JSON list of rows ``[step, micro_step, ...tail]``, one per tail."""
    return rows_of(step, micro_step, _SEPARATOR.join(tails))


def rows_of(step: int, micro_step: int, body: bytes) -> bytes:
    """``join_rows`` of tails joined once (``_SEPARATOR``), kept between boundaries: one
    ``replace`` over contiguous bytes instead of a join over a thousand objects."""
    if not body:
        return b"[]"
    head = b"[%d,%d" % (step, micro_step)
    return b"[" + head + body.replace(_SEPARATOR, b"," + head) + b"]"


# Never in JSON text (``json.dumps`` escapes control characters), so it can only be a separator.
_SEPARATOR = b"\0"


class BoundaryRows:
    """Each unit's last gradient answers and the encoded row tails they give."""

    def __init__(self, unit_names: Sequence[str]) -> None:
        self._unit_names = list(unit_names)
        # Compared with ``==`` to the next boundary's answers: a backend that hands back the
        # same answer objects (FSDP2 keeps one per parameter and answer) compares by identity.
        self._seen: Sequence[Sequence[Answer]] | None = None
        self._gradients = b""  # every unit's ``gradients`` tails, in order (``rows_of``)
        self._held: list[list[bytes]] = []  # per unit: ``written=true`` tails of those held
        self._all_held = b""

    def tails(self, presences: Sequence[Sequence[Answer]]
              ) -> tuple[bytes, list[list[bytes]], bytes]:
        """The ``gradients`` rows of every unit as a ``rows_of`` body; per unit the
        ``grads_written`` tails of its parameters holding a gradient, each ``written`` (for a
        baseline without any gradient); and those of every unit as a body."""
        if presences != self._seen:
            self._encode(presences)
        return self._gradients, self._held, self._all_held

    def _encode(self, presences: Sequence[Sequence[Answer]]) -> None:
        gradients: list[bytes] = []
        held: list[list[bytes]] = []
        for name, presence in zip(self._unit_names, presences, strict=True):
            gradients.extend([_tail(name, *g) for g in presence])
            held.append([_tail(name, param, True) for param, has_grad, _ in presence
                         if has_grad])
        self._seen = list(presences)  # the backend's lists, never changed (``all_gradients``)
        self._gradients = _SEPARATOR.join(gradients)
        self._held = held
        self._all_held = _SEPARATOR.join(t for unit_tails in held for t in unit_tails)


def written_tails(unit_name: str, presence: Sequence[Answer],
                  written: Sequence[bool]) -> list[bytes]:
    """``grads_written`` tails of one unit whose baseline held gradients (token compared)."""
    return [_tail(unit_name, param, w)
            for (param, has_grad, _), w in zip(presence, written, strict=False) if has_grad]
