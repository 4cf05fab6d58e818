"""Reading a run dir's tables, and a triage aggregation, with each engine side by side.

The analyzer reads each rank's files with ``pyarrow.parquet`` (``fsdptrace.reading.reader``: footer
and values checked, one rank at a time so the map runs in processes or on Dask). Well-kept
engines read a hive-partitioned folder in one call: pyarrow's dataset scanner, DuckDB, Polars.
This measures, on one generated run dir, with every engine held to the same number of threads:

- ``read``: every row of the tables the analyzer reads, materialized as Arrow (Polars: its
  own frame);
- ``last``: per rank, the last unit entered (step, micro-step, phase, unit at the highest
  ``seq``), what hang triage needs first;
- ``orders``: per rank, the number of distinct forward unit orders over its micro-steps (an
  order signature per pass, the core of checks 4 and 7).

Every measurement runs in a fresh process (its peak memory is its own); variants take turns,
each repeated; the results of ``last`` and ``orders`` must agree across engines. An engine
that is not installed is skipped with a line saying so.

    python benchmarks/engines.py RUN_DIR --repeat 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# The tables ``fsdptrace.analyze`` reads for the default checks.
TABLES = ("meta", "units", "events", "markers", "prefetch", "gradients", "pending",
          "allgathers", "backward_grads", "grads_written", "eval_forwards", "settings",
          "collectives")
ENGINES = ("fsdptrace-reader", "pq-per-file", "pa-dataset", "duckdb", "polars")
TASKS = ("read", "last", "orders")
OPTIONAL = {"duckdb": "duckdb", "polars": "polars"}


def _files(run_dir: Path, table: str) -> list[Path]:
    return sorted((run_dir / table).glob("rank=*/part-*.parquet"))


def _rank(path: Path) -> int:
    return int(path.parent.name.split("=", 1)[1])


# --- pyarrow: per file (the analyzer's reader, and bare) ---------------------------------------

def _read_per_file(run_dir: Path, table: str, columns: list[str] | None = None):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = []
    for path in _files(run_dir, table):
        data = pq.read_table(path, columns=columns)
        parts.append(data.append_column("rank", pa.array(np.full(data.num_rows, _rank(path),
                                                                 dtype=np.int32))))
    return pa.concat_tables(parts, promote_options="permissive")


def _read_fsdptrace(run_dir: Path, table: str):
    from fsdptrace.reading import reader

    return reader.read_ranks(run_dir, table, reader.discover_ranks(run_dir))


def _arrow_last(events) -> list:
    """Per rank, the row with the highest seq (numpy over the Arrow columns)."""
    import numpy as np
    import pyarrow.compute as pc

    order = pc.sort_indices(events, [("rank", "ascending"), ("seq", "ascending")])
    events = events.take(order)
    rank = events.column("rank").to_numpy()
    last = np.flatnonzero(np.append(rank[1:] != rank[:-1], True))
    picked = events.take(last)
    return _rows(picked.column("rank"), picked.column("step"), picked.column("micro_step"),
                 picked.column("phase"), picked.column("unit"))


def _arrow_orders(events) -> list:
    """Per rank, distinct forward orders: units of a pass joined in seq order, then counted."""
    import pyarrow as pa
    import pyarrow.compute as pc

    forward = events.filter(pc.equal(events.column("phase").cast(pa.string()), "forward"))
    forward = forward.take(pc.sort_indices(forward, [("rank", "ascending"), ("step", "ascending"),
                                                     ("micro_step", "ascending"),
                                                     ("seq", "ascending")]))
    forward = forward.set_column(forward.schema.get_field_index("unit"), "unit",
                                 forward.column("unit").cast(pa.string()))
    passes = forward.group_by(["rank", "step", "micro_step"], use_threads=False).aggregate(
        [("unit", "list")])
    signature = pc.binary_join(passes.column("unit_list"), ",")
    counted = pa.table({"rank": passes.column("rank"), "sig": signature}).group_by(
        "rank").aggregate([("sig", "count_distinct")])
    return sorted(zip(counted.column("rank").to_pylist(),
                      counted.column("sig_count_distinct").to_pylist(), strict=True))


def _rows(*columns) -> list:
    return sorted(zip(*(c.cast("string").to_pylist() if str(c.type).startswith("dictionary")
                        else c.to_pylist() for c in columns), strict=True))


# --- pyarrow dataset scanner -----------------------------------------------------------------

def _dataset(run_dir: Path, table: str, columns: list[str] | None = None):
    import pyarrow.dataset as ds

    dataset = ds.dataset(run_dir / table, format="parquet", partitioning="hive")
    return dataset.to_table(columns=columns)


# --- DuckDB ------------------------------------------------------------------------------------

def _duck(threads: int):
    import duckdb

    con = duckdb.connect()
    con.execute(f"SET threads = {threads}")
    return con


def _duck_source(run_dir: Path, table: str) -> str:
    return (f"read_parquet('{run_dir / table}/rank=*/part-*.parquet', hive_partitioning=true,"
            " union_by_name=true)")


def _duck_read(con, run_dir: Path, table: str):
    return con.execute(f"SELECT * FROM {_duck_source(run_dir, table)}").to_arrow_table()


def _duck_last(con, run_dir: Path) -> list:
    rows = con.execute(
        "SELECT CAST(rank AS INTEGER), arg_max(step, seq), arg_max(micro_step, seq), "
        "CAST(arg_max(phase, seq) AS VARCHAR), CAST(arg_max(unit, seq) AS VARCHAR) "
        f"FROM {_duck_source(run_dir, 'events')} GROUP BY rank").fetchall()
    return sorted(tuple(r) for r in rows)


def _duck_orders(con, run_dir: Path) -> list:
    rows = con.execute(
        "SELECT CAST(rank AS INTEGER), count(DISTINCT sig) FROM ("
        "  SELECT rank, string_agg(CAST(unit AS VARCHAR), ',' ORDER BY seq) AS sig "
        f"  FROM {_duck_source(run_dir, 'events')} WHERE phase = 'forward' "
        "  GROUP BY rank, step, micro_step) GROUP BY rank").fetchall()
    return sorted(tuple(r) for r in rows)


# --- Polars ------------------------------------------------------------------------------------

def _polars_scan(run_dir: Path, table: str):
    import polars as pl

    return pl.scan_parquet(str(run_dir / table / "rank=*" / "part-*.parquet"),
                           hive_partitioning=True)


def _polars_last(run_dir: Path) -> list:
    import polars as pl

    frame = (_polars_scan(run_dir, "events").group_by("rank")
             .agg(pl.col("step", "micro_step", "phase", "unit").sort_by("seq").last())
             .collect())
    return sorted((int(r), s, m, str(p), str(u)) for r, s, m, p, u in frame.iter_rows())


def _polars_orders(run_dir: Path) -> list:
    import polars as pl

    frame = (_polars_scan(run_dir, "events").filter(pl.col("phase") == "forward")
             .group_by("rank", "step", "micro_step")
             .agg(pl.col("unit").cast(pl.String).sort_by("seq").str.join(",").alias("sig"))
             .group_by("rank").agg(pl.col("sig").n_unique()).collect())
    return sorted((int(r), int(n)) for r, n in frame.iter_rows())


# --- one measurement ---------------------------------------------------------------------------

def run_task(engine: str, task: str, run_dir: Path, threads: int) -> object:
    """Do ``task`` with ``engine``; returns what to compare across engines (rows read, or the
    aggregation's result)."""
    if engine == "duckdb":
        con = _duck(threads)
        if task == "read":
            return sum(_duck_read(con, run_dir, t).num_rows for t in TABLES if _files(run_dir, t))
        return (_duck_last if task == "last" else _duck_orders)(con, run_dir)
    if engine == "polars":
        if task == "read":
            return sum(_polars_scan(run_dir, t).collect().height for t in TABLES
                       if _files(run_dir, t))
        return (_polars_last if task == "last" else _polars_orders)(run_dir)
    read: Callable = {"fsdptrace-reader": _read_fsdptrace, "pq-per-file": _read_per_file,
                      "pa-dataset": _dataset}[engine]
    if task == "read":
        return sum(read(run_dir, t).num_rows for t in TABLES if _files(run_dir, t))
    events = read(run_dir, "events").unify_dictionaries()
    if "rank" not in events.column_names:
        raise AssertionError(f"{engine}: no rank column")
    return (_arrow_last if task == "last" else _arrow_orders)(events)


def child(engine: str, task: str, run_dir: Path, threads: int) -> dict[str, object]:
    import pyarrow as pa

    pa.set_cpu_count(threads)
    pa.set_io_thread_count(threads)
    if engine == "polars":
        import polars  # noqa: F401
    elif engine == "duckdb":
        import duckdb  # noqa: F401
    elif engine == "fsdptrace-reader":
        import fsdptrace.reading.reader  # noqa: F401
    start = time.perf_counter()
    result = run_task(engine, task, run_dir, threads)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": seconds, "peak_mib": peak, "result": result}


def measure(engine: str, task: str, run_dir: Path, threads: int) -> dict:
    env = {**os.environ, "POLARS_MAX_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, __file__, "--child", engine, task, str(run_dir),
                          "--threads", str(threads)], check=True, capture_output=True,
                         text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def tail_ranks(run_dir: Path) -> set[int]:
    """Ranks with journal segments: rows hive readers do not see (``fsdptrace.reading.reader`` folds
    them in)."""
    return {_rank(p) for p in (run_dir / "journal").glob("rank=*/*.seg")}


def available() -> list[str]:
    import importlib.util

    engines = []
    for engine in ENGINES:
        module = OPTIONAL.get(engine)
        if module and importlib.util.find_spec(module) is None:
            print(f"skipped {engine}: not installed (pip install {module})")
            continue
        engines.append(engine)
    return engines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "TASK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.run_dir, args.threads), default=list))
        return 0
    wanted = args.engines.split(",")
    engines = [e for e in available() if e in wanted]
    tasks = args.tasks.split(",")
    samples: dict[tuple[str, str], list[dict]] = {(e, t): [] for e in engines for t in tasks}
    for rep in range(args.repeat):
        for task in tasks:
            turn = engines[rep % len(engines):] + engines[:rep % len(engines)]
            for engine in turn:
                samples[engine, task].append(measure(engine, task, args.run_dir, args.threads))
    tails = tail_ranks(args.run_dir)
    for task in (t for t in tasks if t != "read"):
        results = {e: json.dumps([r for r in samples[e, task][0]["result"] if r[0] not in tails])
                   for e in engines}
        if len(set(results.values())) != 1:
            print(f"{task}: engines disagree: " + ", ".join(
                f"{e}={r[:80]}" for e, r in results.items()))
            return 1
    base = "fsdptrace-reader"
    print(f"\n{args.run_dir}: {args.repeat} repetitions, {args.threads} thread(s) per engine; "
          f"every engine gave the same result outside the {len(tails)} ranks whose rows are "
          "(partly) a journal tail, which only fsdptrace's reader reads\n")
    print("| task | engine | rows or ranks | min s | median s | min / " + base + " | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for task in tasks:
        floor = min(s["seconds"] for s in samples[base, task]) if base in engines else None
        for engine in engines:
            seconds = [s["seconds"] for s in samples[engine, task]]
            peak = max(s["peak_mib"] for s in samples[engine, task])
            ratio = f"{min(seconds) / floor:.2f}" if floor else "-"
            result = samples[engine, task][0]["result"]
            size = f"{result:,}" if task == "read" else f"{len(result):,}"
            print(f"| {task} | {engine} | {size} | {min(seconds):.2f} | "
                  f"{statistics.median(seconds):.2f}"
                  f" | {ratio} | {peak:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
