"""Recorder v2 under failure: a real 2-rank FSDP2 job whose recording machinery is attacked.

Run through ``tests.jobs.start_ranks``::

    python tests/jobs_scripts/failure_job.py --run-dir RUN_DIR --case CASE [--steps N]

Trains ``plain_train``'s model (3 layers and the root, each a ``fully_shard`` unit), one
micro-step per optimizer step, recorded with ``fsdptrace.attach``. Each rank writes
``RUN_DIR/../<case>.rank<r>.json``: the warnings fsdptrace gave, the pids of the rank and of its
writer process(es), and the number of steps trained. Cases:

- ``clean``: nothing happens (the reference, and the job run into a tiny hot root);
- ``kill-writer``: rank 1 SIGKILLs its writer process at the start of step 5 and trains on;
- ``stop-writer``: rank 1 SIGSTOPs its writer process at the start of step 5 (whoever runs
  the job sends SIGCONT; the pid is in the report);
- ``hang``: after step 3 both ranks write their pids and sleep, for the test to SIGKILL the
  ranks together with their writer processes (as a cgroup or OOM kill takes a whole job);
- ``run-on``: the same pids after step 3, but the ranks train on (``--steps``), for the test
  to kill them with their writers mid-training, the run dir's copy some way behind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import fsdptrace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plain_train  # noqa: E402

KILL_STEP = 5
HANG_AFTER_STEP = 3


def _writer_pid(rec: object) -> int | None:
    process = rec.writer._process  # type: ignore[attr-defined]
    return process.pid if process is not None else None


def _wait_for_writer(rec: object, timeout_s: float = 120.0) -> None:
    """Until the writer process wrote its first parts and mirrored the journal once (on a
    loaded machine it may still be importing pyarrow when training is steps ahead)."""
    deadline = time.monotonic() + timeout_s
    while rec.bytes_written == 0 and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.1)
    time.sleep(1.0)


def _report(path: Path, **fields: object) -> None:
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps(fields))
    os.replace(temp, path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--case", required=True,
                        choices=["clean", "kill-writer", "stop-writer", "hang", "run-on"])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    warnings.simplefilter("always")
    plain_train.init_process_group()
    rank = dist.get_rank()
    report = args.run_dir.parent / f"{args.case}.rank{rank}.json"
    model = plain_train.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    writers: list[int | None] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fsdptrace.attach(model, run_dir=args.run_dir, optimizer=optimizer,
                              flush_interval_s=0.2) as rec:
            writers.append(_writer_pid(rec))
            for step in range(args.steps):
                if args.case == "kill-writer" and rank == 1 and step == KILL_STEP:
                    os.kill(writers[0], signal.SIGKILL)
                    time.sleep(0.5)  # it is dead before the next boundary looks
                if args.case == "stop-writer" and rank == 1 and step == KILL_STEP:
                    os.kill(writers[0], signal.SIGSTOP)
                if args.case in ("hang", "run-on") and step == HANG_AFTER_STEP:
                    _wait_for_writer(rec)
                    _report(report, pid=os.getpid(), writers=[_writer_pid(rec)], steps=step)
                    while args.case == "hang":
                        time.sleep(1)
                model(torch.randn(4, plain_train.DIM, generator=generator)).pow(2).mean(
                    ).backward()
                optimizer.step()
                optimizer.zero_grad()
            writers.append(_writer_pid(rec))
    _report(report, pid=os.getpid(), writers=writers, steps=args.steps,
            warnings=[str(w.message) for w in caught if "fsdptrace" in str(w.message)])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
