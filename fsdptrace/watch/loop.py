"""``fsdptrace watch``: poll a live run's files, and on a hang give the verdict while the ranks
are alive, keep what the watcher saw, capture the stacks and act (``--on-hang``).

The loop only reads files (``probe``) until the rule (``rule.judge``) says hung; then it runs
the stalled-rank analysis on the same data the post-mortem reads (``verdict``), writes the
watcher's record into the run dir (``fsdptrace.store.watch_records``), asks every rank of this host
for its stack (``watch.stacks``) and does what ``--on-hang`` says. ``record --watch`` runs the
same loop on a thread of the launching process.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from fsdptrace.errors import FsdptraceError
from fsdptrace.reading import reader
from fsdptrace.reading.untrusted import printable
from fsdptrace.store import schema, watch_records
from fsdptrace.watch import actions, rule, stacks
from fsdptrace.watch.claim import claim
from fsdptrace.watch.probe import Probe, RankState
from fsdptrace.watch.verdict import stalled_verdict

DEFAULT_POLL_S = 1.0
STACK_TIMEOUT_S = 10.0
# Quiet this long, the endings are read from the markers whole (not only the newest segments),
# then again at twice the silence, and so on.
ENDINGS_AFTER_S = 1.0


@dataclass(frozen=True)
class WatchSettings:
    """``--hang-after`` (None: ``rule.hang_time``'s default), ``--idle-after``, ``--poll``,
    ``--on-hang``."""

    hang_after: float | None = None
    idle_after: float = rule.DEFAULT_IDLE_S
    poll_s: float = DEFAULT_POLL_S
    on_hang: actions.OnHang = field(default_factory=actions.OnHang)
    stack_timeout_s: float = STACK_TIMEOUT_S


@dataclass
class Hang:
    """What the watcher did about a hang (``acted``: this watcher claimed it; the others of a
    multi-node job only capture their own node's stacks and end their own ranks)."""

    detected_at: str
    reason: str
    quiet_s: float
    limit_s: float
    acted: bool
    verdict_text: str = ""
    verdict: dict[str, Any] | None = None
    ranks: dict[str, dict[str, Any]] = field(default_factory=dict)
    stacks: dict[str, str] = field(default_factory=dict)
    stacks_note: str = ""
    record: str = ""
    terminated: list[int] = field(default_factory=list)
    hook_exit: int | None = None
    # ``time.monotonic_ns()`` when the rule said hung and when the verdict was printed: the
    # ranks' ``t_ns`` use the same clock on this host, so a test measures the latency.
    detected_mono_ns: int = 0
    printed_mono_ns: int = 0


def watch(run_dir: Path, settings: WatchSettings, *, out: TextIO, log: TextIO,
          stop: Callable[[], bool] = lambda: False) -> Hang | None:
    """Watch ``run_dir`` until a hang (returned, handled), every rank ended, or ``stop()``.

    The verdict goes to ``out``, one-line notes (stragglers, what was done) to ``log``.
    """
    probe = Probe(run_dir)
    probe.poll()  # what is there already is no progress: the silence is timed from now
    last_progress = time.monotonic()
    log.write(f"fsdptrace: watching {printable(str(run_dir))} (hang after "
              f"{settings.hang_after or 'the default'} s, idle after {settings.idle_after} s, "
              f"poll {settings.poll_s} s, on hang: {settings.on_hang.action})\n")
    log.flush()
    warned: set[int] = set()
    offsets: dict[int, int] | None = None
    endings_at = ENDINGS_AFTER_S
    while not stop():
        time.sleep(settings.poll_s)
        polled = probe.poll()
        now = time.monotonic()
        if polled.progressed:
            last_progress, endings_at = now, ENDINGS_AFTER_S
        judged = rule.judge(polled.ranks, now - last_progress,
                            hang_after=settings.hang_after, idle_after=settings.idle_after,
                            mirrored=polled.mirrored)
        if judged.hung or now - last_progress >= endings_at:
            # A rank's last markers may be in a segment its writer already turned into
            # Parquet: before calling a hang, and 1, 2, 4... s into a silence (a job that
            # ended), read the endings whole.
            _read_endings(run_dir, polled.ranks)
            endings_at = 2 * max(endings_at, now - last_progress)
            judged = rule.judge(polled.ranks, now - last_progress,
                                hang_after=settings.hang_after,
                                idle_after=settings.idle_after, mirrored=polled.mirrored)
        if judged.hung:
            return _on_hang(run_dir, settings, judged, polled.ranks, out=out, log=log)
        if (judged.reason == "every rank ended" and polled.ranks
                and _world_ended(run_dir, polled.ranks)):
            return None
        if polled.progressed and len(polled.ranks) > 1:
            if offsets is None and any(len(r.micro_steps) >= 3 for r in polled.ranks.values()):
                offsets = _clock_offsets(run_dir, list(polled.ranks))
            _warn_stragglers(rule.stragglers(polled.ranks, offsets), warned, log)
    return None


def _read_endings(run_dir: Path, ranks: dict[int, RankState]) -> None:
    """Each running rank's ending, from its markers as the analysis reads them (ranks whose
    rows are all in Parquet already, with no journal segment left, included)."""
    try:
        for rank in reader.discover_ranks(run_dir):
            ranks.setdefault(rank, RankState(rank))
    except (FsdptraceError, OSError):
        pass
    for rank, state in ranks.items():
        if state.ending is not None:
            continue
        try:
            markers = reader.read_rank(run_dir, "markers", rank, gaps=False)
        except (FsdptraceError, OSError):
            continue
        kinds = [str(k) for k in markers.column("kind").to_pylist()]
        ended = [k for k in kinds if k in schema.ENDING_MARKERS]
        if ended:
            state.ending = ended[-1]


def _world_ended(run_dir: Path, ranks: dict[int, RankState]) -> bool:
    """Every rank of the world has ended (not only those that have a journal yet)."""
    world = max((int(r.get("world_size") or 0) for r in _meta(run_dir, list(ranks))),
                default=0)
    return len(ranks) >= world


def _warn_stragglers(found: list[rule.Straggler], warned: set[int], log: TextIO) -> None:
    for straggler in found:
        if straggler.rank in warned:
            continue
        warned.add(straggler.rank)
        log.write(f"fsdptrace: warning: rank {straggler.rank} straggles: it began the last "
                  f"{straggler.num_micro_steps} micro-steps {straggler.late_s:.2f} s after the "
                  f"median rank (micro-steps every {straggler.period_s:.2f} s); not a hang\n")
        log.flush()


def _on_hang(run_dir: Path, settings: WatchSettings, judged: rule.Verdict,
             ranks: dict[int, RankState], *, out: TextIO, log: TextIO) -> Hang:
    """The stacks, the verdict, the record, then ``--on-hang``."""
    hang = Hang(detected_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                reason=judged.reason, quiet_s=round(judged.quiet_s, 3),
                limit_s=round(judged.limit_s, 3), acted=claim(run_dir),
                ranks={str(r): {"where": s.where(), "ending": s.ending}
                       for r, s in sorted(ranks.items())},
                detected_mono_ns=time.monotonic_ns())
    # Stacks first: the capture also saves each rank's Flight Recorder dump (where it is on),
    # which is what lets the verdict name the collective a rank never completed.
    hang.stacks, hang.stacks_note = _capture_stacks(run_dir, settings.stack_timeout_s)
    if hang.acted:
        found = stalled_verdict(run_dir)
        hang.verdict_text, hang.verdict = found.text, found.document
        out.write(f"fsdptrace: hang detected at {hang.detected_at}: {hang.reason}\n")
        out.write(found.text)
        out.flush()
        hang.printed_mono_ns = time.monotonic_ns()
    else:
        log.write(f"fsdptrace: a hang, reported by another watcher ({run_dir / 'watch'})\n")
    action = settings.on_hang
    if action.action == actions.TERMINATE:
        hang.terminated = actions.terminate(actions.local_rank_pids(_meta(run_dir,
                                                                          list(ranks))))
        log.write(f"fsdptrace: sent SIGTERM to rank(s) "
                  f"{', '.join(map(str, hang.terminated)) or 'none'} on this host\n")
    elif action.action == actions.EXEC and hang.acted:
        hang.hook_exit = actions.run_hook(action.command, _record(hang, settings))
        log.write(f"fsdptrace: --on-hang exec {printable(action.command)} exited "
                  f"{hang.hook_exit}\n")
    if hang.acted:
        hang.record = str(watch_records.write_hang(run_dir, _record(hang, settings)))
        log.write(f"fsdptrace: watcher's record: {hang.record}"
                  + (f"; stacks: {len(hang.stacks)} rank(s)" if hang.stacks else
                     f"; {hang.stacks_note}") + "\n")
    log.flush()
    return hang


def _record(hang: Hang, settings: WatchSettings) -> dict[str, Any]:
    """What the run dir keeps of the hang, and what ``exec`` gets on stdin."""
    return {**asdict(hang), "host": socket.gethostname(),
            "settings": {"hang_after": settings.hang_after, "idle_after": settings.idle_after,
                         "poll_s": settings.poll_s, "on_hang": settings.on_hang.action}}


def _capture_stacks(run_dir: Path, timeout_s: float) -> tuple[dict[str, str], str]:
    """Each rank of this host asked for its stack (``watch.stacks``); a failure is a note."""
    try:
        found = stacks.capture_stacks(run_dir, timeout_s=timeout_s)
    except (FsdptraceError, OSError) as error:
        return {}, f"stacks not captured: {error}"
    return {str(rank): str(path) for rank, path in sorted(found.items())}, ""


def _meta(run_dir: Path, ranks: list[int]) -> list[dict[str, Any]]:
    try:
        return list(reader.read_ranks(run_dir, "meta", sorted(ranks)).to_pylist())
    except (FsdptraceError, OSError):
        return []


def _clock_offsets(run_dir: Path, ranks: list[int]) -> dict[int, int]:
    """Per rank, monotonic to wall clock (ranks of different hosts compare by wall time)."""
    return {int(row["rank"]): int(row["wall_anchor_ns"]) - int(row["mono_anchor_ns"])
            for row in _meta(run_dir, ranks)
            if row.get("wall_anchor_ns") and row.get("mono_anchor_ns")}
