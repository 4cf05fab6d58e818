"""Which optimizer steps a long job records: a small spec language for volume control.

``"10:20"`` records steps 10..19, ``"::5"`` every fifth step, ``"0,3,100:"`` a mix; ``None``
records every step. Python slice rules apply, without negative numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class _Range:
    start: int
    stop: int | None
    every: int

    def contains(self, step: int) -> bool:
        if step < self.start or (self.stop is not None and step >= self.stop):
            return False
        return (step - self.start) % self.every == 0


@dataclass(frozen=True)
class StepWindow:
    """A parsed steps spec; ``contains(step)`` says whether a step is recorded."""

    spec: str | None
    ranges: tuple[_Range, ...]

    def contains(self, step: int) -> bool:
        if not self.ranges:
            return True
        return any(r.contains(step) for r in self.ranges)


def _parse_int(text: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"bad steps spec {spec!r}: {text!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"bad steps spec {spec!r}: steps are numbered from 0, got {value}")
    return value


def parse_steps(spec: str | None) -> StepWindow:
    """Parse a steps spec such as ``"10:20"``, ``"::5"`` or ``"0,3,100:"``."""
    if spec is None or not spec.strip():
        return StepWindow(None, ())
    ranges = []
    for item in spec.split(","):
        item = item.strip()
        if ":" not in item:
            step = _parse_int(item, spec)
            ranges.append(_Range(step, step + 1, 1))
            continue
        fields = item.split(":")
        if len(fields) > 3:
            raise ValueError(f"bad steps spec {spec!r}: {item!r} has more than two ':'")
        fields += [""] * (3 - len(fields))
        start = _parse_int(fields[0], spec) if fields[0] else 0
        stop = _parse_int(fields[1], spec) if fields[1] else None
        every = _parse_int(fields[2], spec) if fields[2] else 1
        if every == 0:
            raise ValueError(f"bad steps spec {spec!r}: a step of 0 records nothing")
        ranges.append(_Range(start, stop, every))
    return StepWindow(spec, tuple(ranges))
