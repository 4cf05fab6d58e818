"""``plain_train.py`` for many steps with ``fsdptrace.attach`` into ``$FSDPTRACE_RUN_DIR``
(the full run-dir disk tests: a run dir on a tiny tmpfs).

    full_disk_job.py NUM_STEPS [PAUSE_S]

``PAUSE_S`` after each step: the writer process's passes (every 2 s) happen while the job
trains, so the disk fills while recording, however fast the machine.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from plain_train import build, init_process_group, train

import fsdptrace


def main() -> int:
    num_steps = int(sys.argv[1])
    pause_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    init_process_group()
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    recorder = fsdptrace.attach(model, optimizer=optimizer)
    for step in range(num_steps):
        train(model, optimizer, num_steps=1, seed=step)
        time.sleep(pause_s)
    recorder.close()
    print(f"rank {dist.get_rank()}: trained {num_steps} steps", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
