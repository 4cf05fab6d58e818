"""Record the normal-ending cases of several batched job scripts in one launch.

``python catalogue.py --out DIR SCRIPT[:CASE,CASE...] [SCRIPT[:CASE,...]]`` on 2 gloo ranks runs
each script's ``main`` with ``--out DIR/SCRIPT`` and its cases, all in one process group (the
scripts' ``harness.run_cases`` joins it). One launch instead of one per script: starting the
ranks and their group costs more than a case. Each case writes what its own script writes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_cases  # noqa: E402
import diff_variants  # noqa: E402
import ledger_job  # noqa: E402
import long_run  # noqa: E402
import provenance_cases  # noqa: E402
import recorder_cases  # noqa: E402
import reused_block_cases  # noqa: E402

# Each takes ``--out DIR [CASE...]`` and records its cases with ``harness.run_cases`` or
# ``harness.process_group``, which join this launch's group.
SCRIPTS: dict[str, Callable[[list[str]], object]] = {
    "check_cases": check_cases.main,
    "provenance_cases": provenance_cases.main,
    "recorder_cases": recorder_cases.main,
    "reused_block_cases": reused_block_cases.main,
    "ledger_job": ledger_job.main,
    "long_run": long_run.main,
    "diff_variants": diff_variants.main,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("batches", nargs="+", help="SCRIPT:CASE,CASE...")
    args = parser.parse_args()
    batches = [(*batch.split(":", 1), "")[:2] for batch in args.batches]
    unknown = [script for script, _ in batches if script not in SCRIPTS]
    if unknown:
        parser.error(f"unknown scripts {unknown}; known: {sorted(SCRIPTS)}")
    dist.init_process_group("gloo")
    try:
        for script, cases in batches:
            SCRIPTS[script](["--out", str(args.out / script), *filter(None, cases.split(","))])
            print(f"done {script}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
