"""``plain_train.py`` for many steps with ``fsdptrace.attach`` into ``$FSDPTRACE_RUN_DIR``
(the full run-dir disk tests: a run dir on a tiny tmpfs).

    full_disk_job.py NUM_STEPS [PAUSE_S [WHEN]]

``PAUSE_S`` after each step: the writer process's passes (every 2 s) happen while the job
trains, so the disk fills while recording, however fast the machine.

``WHEN`` ``at-close``: the disk fills only at close. The writer passes are spaced far apart
(nothing reaches the run dir during training but the empty tables), then, after every rank's
last step and once each writer process wrote its empty tables (on a loaded machine it may
still be importing pyarrow), rank 0 fills the run dir's disk with a ballast file to the last
byte: the writer processes' final conversion is the first write that finds it full.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from plain_train import build, init_process_group, train

import fsdptrace

BALLAST = "ballast"
CLOSE_TIMEOUT_S = 120.0


def fill(folder: str) -> int:
    """Write ``folder/ballast`` until its disk is full; the bytes written."""
    written = 0
    fd = os.open(os.path.join(folder, BALLAST), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 16, 1 << 12, 1 << 9, 1):
            while True:
                try:
                    done = os.write(fd, b"\1" * size)
                except OSError:
                    break
                written += done
                if done < size:
                    break
    finally:
        os.close(fd)
    return written


def main() -> int:
    num_steps = int(sys.argv[1])
    pause_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    at_close = len(sys.argv) > 3 and sys.argv[3] == "at-close"
    init_process_group()
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # close waits for the writer process's salvage (by default it returns after 5 s and the
    # writer finishes alone): the tests read the run dir, then remove the hot folders, the
    # moment the ranks exit, and a writer still salvaging from them on a loaded machine wrote
    # its loss markers from what was left (one CI run: 37 rows said, 128 lacking).
    recorder = fsdptrace.attach(model, optimizer=optimizer,
                                flush_interval_s=3600.0 if at_close else 2.0,
                                close_timeout_s=CLOSE_TIMEOUT_S)
    for step in range(num_steps):
        train(model, optimizer, num_steps=1, seed=step)
        time.sleep(pause_s)
    if at_close:
        deadline = time.monotonic() + 120
        while recorder.bytes_written == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # its last empty tables, after the first
        dist.barrier()
        if dist.get_rank() == 0:
            disk = os.path.dirname(os.path.abspath(os.environ["FSDPTRACE_RUN_DIR"]))
            print(f"rank 0: ballast of {fill(disk)} bytes", flush=True)
        dist.barrier()
    recorder.close()
    print(f"rank {dist.get_rank()}: trained {num_steps} steps", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
