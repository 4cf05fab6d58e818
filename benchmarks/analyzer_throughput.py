"""How fast ``fsdptrace analyze`` is against the time pyarrow alone needs to read the same data.

The machine is shared and noisy, so absolute seconds mean little: every figure is measured
side by side in one run, the variants taking turns, and reported as the minimum of the
repetitions. Each measurement runs in a fresh child process, so its peak memory is that
child's ``resource.getrusage`` maxrss (the pool workers' too, for ``--jobs 2``), not a leftover
of an earlier measurement. Every analysis is also checked against the planted findings of
``generate_run.py``: a fast wrong answer fails the benchmark.

    python benchmarks/analyzer_throughput.py            # 1M and 10M events
    python benchmarks/analyzer_throughput.py --sizes 1e6,1e7,5e7
    python benchmarks/analyzer_throughput.py --sizes 6.2e6 --ranks 10240 --units 8
    python benchmarks/analyzer_throughput.py --run-dir /tmp/run   # one already generated
    python benchmarks/analyzer_throughput.py --quick    # CI smoke test, < 30 s

``triage`` is ``analyze --check stalled-rank`` (what a person runs first after a hang): it
must report exactly the planted stalled-rank findings.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import generate_run  # noqa: E402

# Every table the analyzer reads (``fsdptrace.reading.trace.TABLE_NAMES``): the floor reads
# them all.
TABLES = ("meta", "units", "events", "markers", "prefetch", "gradients", "pending",
          "allgathers", "findings", "backward_grads", "grads_written", "eval_forwards",
          "settings", "collectives")
VARIANTS = ("read", "analyze-j1", "analyze-j2", "triage")
TRIAGE = "stalled-rank"
WHERE = ["check", "rank", "step", "micro_step", "phase", "unit", "target"]


def read_floor(run_dir: Path) -> int:
    """Read every Parquet file the analyzer reads, with pyarrow only (dead ranks' journal
    tails are not Parquet: the analyzer reads them on top); returns the number of events."""
    import pyarrow.parquet as pq

    num_events = 0
    for table in TABLES:
        for path in sorted((run_dir / table).glob("rank=*/part-*.parquet")):
            data = pq.read_table(path)
            if table == "events":
                num_events += data.num_rows
    return num_events


def found(run_dir: Path, jobs: int, checks: list[str] | None = None) -> set[tuple]:
    """The analysis, as comparable (check, rank, step, micro_step, phase, unit, target) rows."""
    import pandas as pd

    import fsdptrace

    findings = fsdptrace.analyze(run_dir, jobs=jobs, checks=checks).findings
    return {tuple(None if pd.isna(v) else v for v in row)
            for row in findings[WHERE].itertuples(index=False, name=None)}


def child(variant: str, run_dir: Path) -> dict[str, object]:
    """One measurement, in this (fresh) process."""
    import fsdptrace.analysis.run  # noqa: F401  (imports are not part of the measurement)

    start = time.perf_counter()
    result: dict[str, object] = {}
    if variant == "read":
        result["events"] = read_floor(run_dir)
    elif variant == "triage":
        got = found(run_dir, jobs=1, checks=[TRIAGE])
        result["correct"] = got == {f for f in generate_run.read_expected(run_dir)
                                    if f[0] == TRIAGE}
    else:
        got = found(run_dir, jobs=int(variant[-1]))
        result["correct"] = got == generate_run.read_expected(run_dir)
    result["seconds"] = time.perf_counter() - start
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result["peak_mib"] = max(own, workers) / 1024
    return result


def measure(variant: str, run_dir: Path) -> dict[str, object]:
    out = subprocess.run([sys.executable, __file__, "--child", variant, str(run_dir)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_size(num_events: int, work: Path, repeats: int, **shape: int) -> dict[str, object]:
    """Generate one run dir, then measure it."""
    run_dir = work / f"run-{num_events}"
    started = time.perf_counter()
    generate_run.generate(run_dir, generate_run.shape_for(num_events, **shape))
    return bench_run_dir(run_dir, repeats, generated=time.perf_counter() - started)


def bench_run_dir(run_dir: Path, repeats: int, *, generated: float = 0.0) -> dict[str, object]:
    """Measure every variant ``repeats`` times on ``run_dir``, in rotating order."""
    samples: dict[str, list[dict[str, object]]] = {v: [] for v in VARIANTS}
    for rep in range(repeats):
        shift = rep % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            samples[variant].append(measure(variant, run_dir))
    bad = [v for v in VARIANTS[1:] if not all(s["correct"] for s in samples[v])]
    if bad:
        raise SystemExit(f"{run_dir}: {', '.join(bad)} did not report exactly the planted "
                         "findings; run fsdptrace analyze on it to see the difference")
    best = {v: min(float(s["seconds"]) for s in samples[v]) for v in VARIANTS}
    peak = {v: max(float(s["peak_mib"]) for s in samples[v]) for v in VARIANTS}
    events = int(samples["read"][0]["events"])
    ranks = json.loads((run_dir / generate_run.PLANTED_FILE).read_text())["shape"]["ranks"]
    return {"events": events, "ranks": ranks, "generate_s": generated, "best": best,
            "peak": peak}


def print_table(rows: list[dict[str, object]]) -> None:
    headers = ["events", "ranks", "gen s", "read s", "analyze s (j1)", "events/s (j1)",
               "ratio to read", "peak MiB (read)", "peak MiB (j1)", "analyze s (j2)",
               "j2 speed-up", "peak MiB (j2, max proc)", "triage s", "triage to read",
               "peak MiB (triage)"]
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        best, peak = row["best"], row["peak"]
        assert isinstance(best, dict) and isinstance(peak, dict)
        events = int(str(row["events"]))
        cells = [f"{events:,}", row["ranks"], f"{row['generate_s']:.1f}",
                 f"{best['read']:.2f}", f"{best['analyze-j1']:.2f}",
                 f"{events / best['analyze-j1']:,.0f}",
                 f"{best['analyze-j1'] / best['read']:.1f}x", f"{peak['read']:.0f}",
                 f"{peak['analyze-j1']:.0f}", f"{best['analyze-j2']:.2f}",
                 f"{best['analyze-j1'] / best['analyze-j2']:.2f}x", f"{peak['analyze-j2']:.0f}",
                 f"{best['triage']:.2f}", f"{best['triage'] / best['read']:.2f}x",
                 f"{peak['triage']:.0f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "RUN_DIR"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="1e6,1e7", help="total events per run dir")
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--units", type=int, default=48)
    parser.add_argument("--run-dir", type=Path, action="append",
                        help="measure this generated run dir (repeatable) instead of --sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, help="keep the run dirs here")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run dirs, one repetition (CI smoke test)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    shape = {"ranks": args.ranks, "units": args.units}
    if args.quick:
        sizes, args.repeats = [20_000], 1
        shape = {"ranks": 6, "units": 8, "micro_steps": 2}
    if args.run_dir:
        print_table([bench_run_dir(path, args.repeats) for path in args.run_dir])
        return
    if args.work_dir:
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        rows = []
        for size in sizes:
            rows.append(bench_size(size, Path(work), args.repeats, **shape))
            print(f"measured {rows[-1]['events']:,} events", file=sys.stderr)
    print_table(rows)


if __name__ == "__main__":
    main()
