"""Where ``fsdptrace analyze`` spends its time, per rank: map, reduce, process fan-out.

``analyzer_throughput.py`` says how fast the whole analysis is against the read floor; this
says what each rank costs and where, on one run dir (``generate_run.py`` or a recorded one):

- map: the per-rank step (read plus checks), wall time per rank, one process;
- reduce: the across-ranks checks over every rank's summary, wall time per rank;
- fan-out: with ``--jobs 2``, the parent process's own CPU time while the workers map
  (submitting work, unpickling summaries, noting skipped chunks), per rank;
- a cProfile of the one-process analysis, its top entries by own time.

    python benchmarks/analyzer_costs.py RUN_DIR [--top 20]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import resource
import time
from pathlib import Path

from fsdptrace.analysis import run as analysis
from fsdptrace.checks import resolve
from fsdptrace.reading import reader


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def costs(run_dir: Path, checks: list[str] | None = None) -> dict[str, float]:
    """Seconds of map, reduce and parent fan-out CPU, and the number of ranks."""
    names = resolve(checks)
    ranks = reader.discover_ranks(run_dir)
    start = time.perf_counter()
    summaries = analysis._map_ranks(run_dir, ranks, names, 1, None)
    mapped = time.perf_counter()
    analysis.reduce_run_dir(run_dir, summaries, names)
    reduced = time.perf_counter()
    cpu = _cpu_s()
    fanned_start = time.perf_counter()
    analysis._map_ranks(run_dir, ranks, names, 2, None)
    fanned = time.perf_counter() - fanned_start
    return {"ranks": len(ranks), "map_s": mapped - start, "reduce_s": reduced - mapped,
            "fan_out_cpu_s": _cpu_s() - cpu, "map_j2_s": fanned}


def profile(run_dir: Path, top: int, checks: list[str] | None = None) -> str:
    profiler = cProfile.Profile()
    profiler.runcall(analysis.analyze, run_dir, checks)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("ncalls"))
    return "\n".join(line.replace(str(Path.cwd()) + "/", "") for line in lines[start - 3:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--check", action="append", help="only these checks (repeatable)")
    args = parser.parse_args(argv)
    found = costs(args.run_dir, args.check)
    per = 1e6 / found["ranks"]
    print(f"| ranks | map µs/rank (j1) | reduce µs/rank | fan-out parent CPU µs/rank (j2) "
          f"| map s (j1) | map s (j2) |\n|---|---|---|---|---|---|\n"
          f"| {found['ranks']:,.0f} | {found['map_s'] * per:,.0f} | "
          f"{found['reduce_s'] * per:,.0f} | {found['fan_out_cpu_s'] * per:,.0f} | "
          f"{found['map_s']:.2f} | {found['map_j2_s']:.2f} |")
    print("\ncProfile of the one-process analysis, top entries by own time:\n")
    print(profile(args.run_dir, args.top, args.check))


if __name__ == "__main__":
    main()
