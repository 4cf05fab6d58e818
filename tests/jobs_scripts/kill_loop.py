"""Many short 2-rank FSDP2 runs, each ended by SIGKILL at a random event: the kill loop.

Each rank process imports torch once, then forks one child per run; the two ranks' children
form a fresh gloo group (one port per run) and train until the victim's child, at a random
event of a random rank, writes a truth file (that event's seq, step, phase, unit) and SIGKILLs
itself right after the hook recorded it. The other rank's parent then SIGKILLs its own child
a random instant later, wherever it is (blocked on the dead peer or failing on it). The test
compares each run dir with the truth files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdptrace
from fsdptrace.store import schema

MAX_EVENTS = 1000
# Events and all-gathers segments of 4-8 KiB (a few dozen rows): the writer process converts
# and deletes segments all through each run, so kills land between any two of its steps.
SMALL_SEGMENTS = (4096, 8192)


def child(run_dir: Path, truth: Path, port: int, rank: int, kill_at: int | None) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer, flush_interval_s=0.01)
    for table in ("events", "allgathers"):  # created at attach, first segment not yet
        segments = rec.writer.tables[table].segments
        segments.next_bytes, segments.max_bytes = SMALL_SEGMENTS
    if kill_at is not None:
        original = rec.record_unit

        def record_then_die(unit: int, phase: int) -> None:
            original(unit, phase)
            if rec._seq >= kill_at:
                truth.write_text(json.dumps({
                    "seq": rec._seq, "step": rec.step, "micro_step": rec.micro_step,
                    "phase": schema.PHASES[phase], "unit": rec.unit_names[unit]}))
                os.kill(os.getpid(), signal.SIGKILL)

        rec.record_unit = record_then_die  # type: ignore[method-assign]
    while True:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def run(out: Path, index: int, port: int, rank: int, rng: random.Random) -> dict:
    victim = rng.randrange(2)
    kill_at = rng.randint(1, MAX_EVENTS)
    peer_delay = rng.uniform(0.0, 0.3)
    run_dir, truth = out / f"run{index:02d}", out / f"truth{index:02d}.json"
    pid = os.fork()
    if pid == 0:
        try:
            child(run_dir, truth, port, rank, kill_at if rank == victim else None)
        finally:
            os._exit(1)
    deadline = time.monotonic() + 30
    if rank != victim:
        while not truth.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(peer_delay)
        _kill(pid)
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"victim": victim, "rank": rank, "signal": os.WTERMSIG(status)
                    if os.WIFSIGNALED(status) else None}
        time.sleep(0.01)
    _kill(pid)
    os.waitpid(pid, 0)
    return {"victim": victim, "rank": rank, "signal": "timeout"}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ports", required=True, help="one free port per run, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    rng = random.Random(args.seed)  # the same draws on both ranks
    ports = [int(p) for p in args.ports.split(",")]
    results = [run(args.out, i, port, rank, rng) for i, port in enumerate(ports)]
    (args.out / f"results.rank{rank}.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
