"""The per-rank map on a Dask cluster against local processes (``--jobs``), on one run dir.

``fsdptrace analyze --scheduler tcp://HOST:PORT`` sends each rank's map to a Dask cluster;
this measures what that path costs against ``--jobs N`` with the same number of workers on
one machine, where both have the same cores. A ``distributed.LocalCluster`` of N worker
processes (one thread each) is started once, outside the timing (a real cluster is already
running when a person analyzes); the local pool is started by each analysis, as the CLI does.
The variants take turns, each repeated; every analysis must find exactly the planted findings,
and all paths the same table.

    python benchmarks/dask_vs_jobs.py --ranks 1024 --events 2400000 --repeat 3
    python benchmarks/dask_vs_jobs.py --run-dir /tmp/r1024      # an existing generated run
    python benchmarks/dask_vs_jobs.py --run-dir /tmp/r1024 --check stalled-rank
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import generate_run  # noqa: E402
import pandas as pd  # noqa: E402

WHERE = ["check", "rank", "step", "micro_step", "phase", "unit", "target"]


def where(findings: pd.DataFrame) -> set[tuple]:
    return {tuple(None if pd.isna(v) else v for v in row)
            for row in findings[WHERE].itertuples(index=False, name=None)}


def _warm() -> None:
    import fsdptrace.analysis.run  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--events", type=int, default=2_400_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--run-dir", type=Path, help="a generated run dir to reuse")
    parser.add_argument("--work-dir", type=Path, help="where to generate (deleted after)")
    parser.add_argument("--check", action="append", dest="checks", metavar="NAME",
                        help="run only this check (repeatable); default: all")
    args = parser.parse_args(argv)
    try:
        import distributed
    except ImportError:
        print("skipped: Dask distributed is not installed (pip install 'fsdptrace[dask]')")
        return 0
    import fsdptrace
    from fsdptrace.reading import reader

    work = Path(tempfile.mkdtemp(dir=args.work_dir)) if args.run_dir is None else None
    run_dir = args.run_dir or work / "run"  # type: ignore[operator]
    try:
        if work is not None:
            started = time.perf_counter()
            generate_run.generate(run_dir, generate_run.shape_for(args.events, ranks=args.ranks))
            print(f"generated {run_dir} in {time.perf_counter() - started:.1f} s")
        expected = {row for row in generate_run.read_expected(run_dir)
                    if args.checks is None or row[0] in args.checks}
        started = time.perf_counter()
        cluster = distributed.LocalCluster(n_workers=args.workers, threads_per_worker=1,
                                           processes=True, dashboard_address=None)
        client = distributed.Client(cluster)
        print(f"LocalCluster of {args.workers} processes up in "
              f"{time.perf_counter() - started:.1f} s (not timed below)")
        variants = {
            f"jobs-{args.workers}": lambda: fsdptrace.analyze(run_dir, args.checks,
                                                              jobs=args.workers).findings,
            f"dask-{args.workers}": lambda: fsdptrace.analyze(run_dir, args.checks,
                                                              scheduler=client).findings,
        }
        client.run(_warm)  # imports are not measured
        num_ranks = len(reader.discover_ranks(run_dir))
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        tables: dict[str, pd.DataFrame] = {}
        names = list(variants)
        for rep in range(args.repeat):
            for name in names[rep % 2:] + names[:rep % 2]:
                start = time.perf_counter()
                found = variants[name]()
                seconds[name].append(time.perf_counter() - start)
                assert where(found) == expected, f"{name}: not the planted findings"
                if name in tables:
                    pd.testing.assert_frame_equal(found, tables[name])
                tables[name] = found
        pd.testing.assert_frame_equal(*tables.values())
        client.close()
        cluster.close()
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    local = f"jobs-{args.workers}"
    print(f"\n{num_ranks} ranks on disk, "
          f"{args.repeat} repetitions, findings identical on both paths and all planted\n")
    print("| path | min s | median s | min / jobs min |")
    print("|---|---|---|---|")
    for name, samples in seconds.items():
        ratio = min(samples) / min(seconds[local])
        print(f"| {name} | {min(samples):.2f} | {statistics.median(samples):.2f} | "
              f"{ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
