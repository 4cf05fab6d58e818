"""Where a command's CPU goes, by kind of process: run it and sample every process on the box.

The test suite runs about 1,300 processes (xdist workers, the ranks its fork servers fork, the
writer process of each rank, fresh interpreters for jobs that must start as users start them,
torchrun, the command line, chromium), and most of them are no child the suite waits for, so
``time`` and ``getrusage`` miss them. This samples ``/proc`` every ``--interval`` seconds while
the command runs and keeps each process's last CPU time and command line; it prints the CPU
seconds of each kind, and the whole box's busy CPU-seconds over the run from ``/proc/stat``.
On a box this command has to itself, busy CPU-seconds / cores is the shortest the command could
take: how far a run is from it says how much a better schedule could still give.

    python benchmarks/suite_cpu.py -- make test
    python benchmarks/suite_cpu.py --json out.json -- .venv/bin/python -m pytest -q -n 3

A process that lives shorter than an interval may be missed, and the last interval of each
one's CPU: the kinds' sum is a little under the box's busy time (which also counts the kernel's
own threads and anything else running).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
XDIST_WORKER = "exec(eval(sys.stdin.readline()))"  # how execnet starts an xdist worker
# Fresh interpreters named by the script they run (tests' job scripts, examples, benchmarks).
SCRIPT = re.compile(r"(tests/jobs_scripts/\S+\.py|examples/\S+\.py|benchmarks/\S+\.py)")


@dataclass
class Seen:
    """One process (a pid and its start time): its parent, command lines and CPU seconds."""

    ppid: int
    commands: list[str] = field(default_factory=list)
    cpu_s: float = 0.0


def sample(seen: dict[tuple[int, int], Seen], skip: set[int]) -> None:
    """Every process's CPU so far and command line, into ``seen`` (gone ones are skipped)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            fields = stat[stat.rindex(b")") + 2:].split()
            key = (int(entry), int(fields[19]))  # a pid is reused; with its start time it is not
            process = seen.setdefault(key, Seen(ppid=int(fields[1])))
            process.cpu_s = (int(fields[11]) + int(fields[12])) / TICKS
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError, IndexError):
            continue
        text = command.decode(errors="replace").strip()[:300]
        if text and (not process.commands or process.commands[-1] != text):
            process.commands.append(text)


def kind(process: Seen, parent: Seen | None) -> str:
    """What a process was, from its last command line (and its parent's, for forks)."""
    command = process.commands[-1] if process.commands else ""
    parent_command = parent.commands[-1] if parent and parent.commands else ""
    if not command:
        return "kernel threads (and processes never seen running)"
    if "fsdptrace.record.writer_process" in command:
        return "writer processes"
    if XDIST_WORKER in command:
        return ("forks of a test worker (hostile corpus cases, their pool workers)"
                if XDIST_WORKER in parent_command else "pytest workers")
    if "-m tests.forkserver" in command:
        return ("ranks forked by the test fork servers"
                if "-m tests.forkserver" in parent_command else "test fork servers")
    if "multiprocessing.spawn" in command:
        return "multiprocessing spawn children"
    if "torchrun" in command:
        return "torchrun"
    if "chrom" in command:
        return "chromium"
    if re.search(r"(bin/fsdptrace |-m fsdptrace_cli)", command):
        return "fsdptrace command lines"
    found = SCRIPT.search(command)
    if found:
        return f"fresh interpreters: {found.group(1)}"
    if "pytest" in command:
        return "pytest (controller)"
    return "other"


def busy_ticks() -> int:
    """The box's busy CPU ticks so far (``/proc/stat``: all but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(values) - values[3] - values[4]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("--json", type=Path, help="also write every process seen here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    before: dict[tuple[int, int], Seen] = {}
    sample(before, {os.getpid()})  # what the processes already running had used before
    seen: dict[tuple[int, int], Seen] = {}
    start_busy, start = busy_ticks(), time.monotonic()
    child = subprocess.Popen(command)
    while child.poll() is None:
        sample(seen, {os.getpid()})
        time.sleep(args.interval)
    wall = time.monotonic() - start
    busy = (busy_ticks() - start_busy) / TICKS
    by_pid = {pid: process for (pid, _), process in seen.items()}
    cpu: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for key, process in seen.items():
        if key in before:
            process.cpu_s -= before[key].cpu_s
        name = kind(process, by_pid.get(process.ppid))
        cpu[name] += process.cpu_s
        count[name] += 1
    cores = len(os.sched_getaffinity(0))
    print(f"exit {child.returncode}, {wall:.1f} s, {len(seen):,} processes; the box busy "
          f"{busy:,.1f} CPU-s of {wall * cores:,.1f} ({cores} cores): at least "
          f"{busy / cores:.1f} s on them\n")
    print("| CPU-s | share | processes | kind |\n|---|---|---|---|")
    for name, seconds in cpu.most_common():
        print(f"| {seconds:,.1f} | {seconds / max(busy, 1e-9):.0%} | {count[name]:,} | {name} |")
    if args.json:
        args.json.write_text(json.dumps([{"pid": pid, "ppid": p.ppid, "cpu_s": p.cpu_s,
                                          "commands": p.commands}
                                         for (pid, _), p in seen.items()]))
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
