"""Stacks at hang time: ``ending_job``'s hang (a real 2-rank FSDP2 job, gloo, CPU), with a
handler already on the stack signal.

At step 2 rank 1 sleeps inside ``layers.1``'s forward (after writing ``<out>/truth.json``);
rank 0 blocks in its next FSDP all-gather. ``--previous-handler``: before ``attach`` each rank
puts a Python handler on the stack signal that appends a line to ``<out>/previous-<rank>``, so
a test sees whether fsdptrace chained to it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from fsdptrace.record.stack_dump import configured_signal

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ending_job  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--previous-handler", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if args.previous_handler:
        signum = configured_signal()
        assert signum is not None
        mark = args.out / f"previous-{rank}"

        def previous(number: int, frame: object) -> None:
            with open(mark, "a") as file:
                file.write(f"{number}\n")

        signal.signal(signum, previous)
    dist.init_process_group("gloo")
    try:
        ending_job.train(rank, "hang", args.out, 60.0, False)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
