"""What a watcher saw while the run hung, as lines under the post-mortem's verdict.

``fsdptrace watch`` keeps a record of each hang it detected (``fsdptrace.store.watch_records``) and
every rank's stack at that moment (``fsdptrace.store.stack_dumps``). The later ``analyze`` says so
first: when the hang was detected, how long the ranks had been silent, what the watcher did,
and where each rank's training thread stood, so the 3 a.m. reader sees the live evidence
beside the offline verdict without opening the run dir.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdptrace.reading.untrusted import printable
from fsdptrace.store import stack_dumps, watch_records

# A rank's training thread named by its innermost frames: enough to tell a job's own sleep
# from FSDP's all-gather, short enough for one line.
FRAMES_SHOWN = 3


def watcher_lines(run_dir: Path) -> list[str]:
    """One line per hang a watcher recorded, then one per rank whose stack it captured."""
    lines = [_hang_line(record) for record in watch_records.read_hangs(run_dir)]
    if not lines:
        return []
    for rank, captures in sorted(stack_dumps.read_captures(run_dir).items()):
        last = captures[-1]
        frames = " < ".join(last.main_frames[:FRAMES_SHOWN]) or "(training thread not in dump)"
        partial = "" if last.complete else " (dump incomplete)"
        lines.append(f"  rank {rank} stack at {last.captured_at}{partial}: {frames} "
                     f"[{last.path}]")
    return [printable(line) for line in lines]


def _hang_line(record: dict[str, Any]) -> str:
    """When the watcher judged the run hung, why, and what it did."""
    done = []
    if record.get("terminated"):
        done.append("sent SIGTERM to rank(s) " + ", ".join(map(str, record["terminated"])))
    if record.get("hook_exit") is not None:
        done.append(f"ran the --on-hang command (exit {record['hook_exit']})")
    acted = "; ".join(done) or "reported it"
    return (f"watcher: hang detected at {record.get('detected_at', '?')}: "
            f"{record.get('reason', 'no reason recorded')}; it {acted} "
            f"[{record.get('path', '')}]")
