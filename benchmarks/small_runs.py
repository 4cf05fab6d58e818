"""The analyzer's fixed cost: how long one small run dir takes, when its rows cost nothing.

A run of a few ranks and steps (the sample traces, a CI gate on a short job, the test suite's
recordings) is analyzed in milliseconds of pandas per check, whatever its rows; this is that
cost. It analyzes each run dir once (imports and caches warm), then ``--repeats`` times
``--number`` analyses of every one in one process (``jobs=1``), and prints the CPU
milliseconds per analysis: the minimum and the median of the repeats. Compare two checkouts
side by side in one run, alternating (the box is shared and noisy):

    python benchmarks/small_runs.py sample_traces/*/
    PYTHONPATH=OTHER:OTHER/cli python /tmp/small_runs.py sample_traces/*/   # a copy outside
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import fsdptrace

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


def per_analysis_ms(run_dirs: list[Path], *, repeats: int, number: int) -> list[float]:
    """CPU milliseconds per analysis, one figure per repeat."""
    for run_dir in run_dirs:
        fsdptrace.analyze(run_dir, jobs=1)
    figures = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(number):
            for run_dir in run_dirs:
                fsdptrace.analyze(run_dir, jobs=1)
        figures.append((time.process_time() - start) / number / len(run_dirs) * 1000)
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="*", type=Path,
                        help="run dirs to analyze [default: every sample trace]")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--number", type=int, default=10, help="analyses of each per repeat")
    args = parser.parse_args(argv)
    run_dirs = args.run_dirs or sorted(p for p in SAMPLES.iterdir() if (p / "meta").is_dir())
    figures = per_analysis_ms(run_dirs, repeats=args.repeats, number=args.number)
    print(f"{len(run_dirs)} run dirs, {args.repeats} x {args.number} analyses of each: "
          f"min {min(figures):.1f} ms, median {statistics.median(figures):.1f} ms "
          "of CPU per analysis")


if __name__ == "__main__":
    main()
