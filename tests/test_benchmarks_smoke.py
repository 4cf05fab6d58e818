"""Scale paths on synthetic run dirs: every planted finding, nothing else, at any size.

``benchmarks/generate_run.py`` plants one problem of each check at known places, in a run
with repeated calls, units without parameters, two pipeline stages with disjoint units,
dictionaries ordered differently per rank, a stalled rank, dead ranks whose rows are a journal
tail and a rank missing on disk, in the recorder's on-disk format: the tests below hold it to
what the writer process and a real recording leave.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fsdptrace
from fsdptrace.analysis import map_step
from fsdptrace.checks import CHECKS
from fsdptrace.reading.reader import read_rank
from fsdptrace.store import fatal_signals, schema
from fsdptrace.store.journal_format import FIXED_TABLES, JOURNAL_DIR, RANGE_PART_NAME
from fsdptrace.store.run_mark import RUN_MARK as RUN_MARK_FILE
from fsdptrace.version import __version__
from tests.recordings import Recordings
from tests.synthetic import TINY, generate_run, generate_tiny, where

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[tuple]]:
    path = tmp_path_factory.mktemp("synthetic") / "run"
    return path, generate_tiny(path)


def test_every_planted_finding_and_nothing_else(tiny: tuple[Path, set[tuple]]) -> None:
    run_dir, expected = tiny
    checks = {row[0] for row in expected}
    # Provenance, gradients and settings are recorded as a clean job leaves them: checks 8-13
    # run on them and find nothing.
    assert checks == set(CHECKS) - {"wasted-prefetch", "redundant-prefetch",
                                    "gradient-divergence", "eval-divergence",
                                    "setting-divergence", "unsharded-excess"}
    assert where(fsdptrace.analyze(run_dir).findings) == expected


def test_run_dir_trace_and_processes_agree(tiny: tuple[Path, set[tuple]]) -> None:
    run_dir, _ = tiny
    serial = fsdptrace.analyze(run_dir).findings
    pd.testing.assert_frame_equal(serial, fsdptrace.analyze(run_dir, jobs=2).findings)
    pd.testing.assert_frame_equal(serial, fsdptrace.analyze(fsdptrace.load(run_dir)).findings)


def test_repeated_analysis_is_identical(tiny: tuple[Path, set[tuple]]) -> None:
    run_dir, _ = tiny
    pd.testing.assert_frame_equal(fsdptrace.analyze(run_dir).findings,
                                  fsdptrace.analyze(run_dir).findings)


def test_larger_shape_scales_the_same_findings(tmp_path: Path) -> None:
    shape = generate_run.Shape(ranks=9, steps=13, micro_steps=3, units=7, stages=3)
    expected = generate_run.generate(tmp_path / "run", shape)
    assert where(fsdptrace.analyze(tmp_path / "run", jobs=2).findings) == expected


def test_generator_writes_the_real_format(tiny: tuple[Path, set[tuple]]) -> None:
    run_dir, _ = tiny
    trace = fsdptrace.load(run_dir)
    plan = generate_run.plan_for(TINY)
    assert trace.ranks == [r for r in range(TINY.ranks) if r != TINY.ranks - 1]
    assert trace.world_size == TINY.ranks
    last_step = (TINY.steps - 1) * TINY.micro_steps * TINY.per_micro_step
    stops = {plan.stalled: (plan.stall_micro, plan.stall_position),
             **{r: (plan.dead_micro, plan.dead_position) for r in plan.dead}}
    expected = {r: last_step + micro * TINY.per_micro_step + position + 1
                for r, (micro, position) in stops.items()}
    counts = trace.events.groupby("rank").size()
    full = TINY.steps * TINY.micro_steps * TINY.per_micro_step
    assert counts.to_dict() == {r: expected.get(r, full) for r in trace.ranks}
    for table in schema.TABLES:  # every table, every rank: one compacted part, or a tail
        for rank in trace.ranks:
            names = [p.name for p in (run_dir / table / f"rank={rank}").iterdir()]
            assert all(RANGE_PART_NAME.match(n) for n in names), names
            assert len(names) == (1 if rank not in plan.dead else len(names)), names


def test_dead_rank_reads_from_parts_and_journal_tail(tmp_path: Path) -> None:
    """With small segments a dead rank's rows span converted parts and the journal's open
    segments; the reader folds them back into exactly the rows generated."""
    run_dir = tmp_path / "run"
    generate_run.generate(run_dir, TINY, segment_bytes=(4096, 8192))
    plan = generate_run.plan_for(TINY)
    dead = plan.dead[0]
    tail = list((run_dir / JOURNAL_DIR / f"rank={dead}").glob("events-*.seg"))
    parts = list((run_dir / "events" / f"rank={dead}").glob("part-*.parquet"))
    assert len(tail) == 1 and len(parts) >= 2, (tail, parts)
    made = generate_run.rank_tables(TINY, plan, dead)
    for table in ("events", "allgathers", "markers", "gradients", "settings"):
        read = read_rank(run_dir, table, dead).drop_columns(["rank"])
        assert read.to_pylist() == made[table].to_pylist(), table


def test_closed_rank_is_what_the_writer_process_leaves(tmp_path: Path) -> None:
    """The same rows through the recorder's journal and ``PartWriter.finish`` give the same
    files: names (fixed tables), schema with metadata, row groups, compression, rows."""
    import _run_files
    import _run_tables

    from fsdptrace.record.part_writer import PartWriter

    rank = 1
    plan = generate_run.plan_for(TINY)
    tables = generate_run.rank_tables(TINY, plan, rank)
    writer = _run_tables.writer_id(rank)
    _run_files.write_closed(tmp_path / "generated", rank, writer, tables)
    real = PartWriter(tmp_path / "recorded", rank=rank, version=__version__, writer_id=writer)
    real.journal_dir.mkdir(parents=True)
    real.write_empty_tables()
    for name, table in tables.items():
        _run_files.journal_rows(real.journal_dir, name, writer, table, (65536, 1 << 22))
    real.finish()
    for name in schema.TABLES:
        [ours] = (tmp_path / "generated" / name / f"rank={rank}").iterdir()
        [theirs] = (tmp_path / "recorded" / name / f"rank={rank}").iterdir()
        if name in FIXED_TABLES or not tables.get(name, pa.table({})).num_rows:
            assert ours.name == theirs.name, name
        a, b = pq.ParquetFile(ours), pq.ParquetFile(theirs)
        assert a.schema_arrow.equals(b.schema_arrow, check_metadata=True), name
        assert a.metadata.num_row_groups == b.metadata.num_row_groups, name
        if a.metadata.num_rows:
            assert (a.metadata.row_group(0).column(0).compression
                    == b.metadata.row_group(0).column(0).compression), name
        assert a.read().to_pylist() == b.read().to_pylist(), name


@pytest.mark.slow
def test_matches_a_real_recording(tiny: tuple[Path, set[tuple]], recordings: Recordings
                                  ) -> None:
    """A real 2-rank job recorded with ``fsdptrace record`` (``make demo``'s): the same
    tables, part names of the same form and segment ranges, the same schemas and footer
    metadata keys."""
    recorded, job = recordings.demo()
    assert job.returncode in (0, 1), job.stdout + job.stderr
    generated, _ = tiny

    def layout(run_dir: Path, rank: int) -> dict[str, tuple]:
        found = {}
        for table_dir in sorted(p for p in run_dir.iterdir() if p.is_dir()):
            if table_dir.name not in schema.TABLES:  # the journal, the dumps folder
                continue
            [part] = (table_dir / f"rank={rank}").iterdir()
            match = RANGE_PART_NAME.match(part.name)
            assert match, part
            footer = pq.ParquetFile(part)
            found[table_dir.name] = (
                match["first"], match["last"] == "000000", footer.metadata.num_row_groups,
                sorted(footer.schema_arrow.metadata), footer.schema_arrow.remove_metadata())
        return found

    ours, theirs = layout(generated, 1), layout(recorded, 1)
    assert sorted(ours) == sorted(theirs) == sorted(schema.TABLES)
    # The generator writes no ``collectives`` rows yet (contract v3's table, newer than it):
    # its part is the empty one; the schema and footer keys are still compared.
    for name in schema.TABLES:
        if name == "collectives":
            assert ours[name][2:] == theirs[name][2:], name
            continue
        assert ours[name] == theirs[name], name
    # A recording also holds its (fatal-signal, Flight Recorder) dumps folder, which a
    # generated run, never launched, does not; both hold their run mark.
    assert sorted(p.name for p in generated.iterdir()) == sorted(
        [*(p.name for p in recorded.iterdir() if p.name != fatal_signals.DUMPS_DIR),
         generate_run.PLANTED_FILE])
    assert RUN_MARK_FILE in {p.name for p in generated.iterdir()}
    # A rank that closed leaves its journal folder empty: the reader looks it up per rank.
    for run_dir in (generated, recorded):
        assert not any((run_dir / JOURNAL_DIR / "rank=1").iterdir()), run_dir


def test_generator_command_line_and_analyze(tmp_path: Path) -> None:
    """The command line CI runs: a tiny run dir, then ``fsdptrace analyze`` finds every
    planted problem, the dead ranks' stalls included."""
    run_dir = tmp_path / "run"
    generate_run.main([str(run_dir), "--events", "3000", "--ranks", "6", "--units", "6",
                       "--micro-steps", "2"])
    expected = generate_run.read_expected(run_dir)
    dead = generate_run.plan_for(TINY).dead
    assert {row[1] for row in expected if row[0] == "stalled-rank"} >= set(dead)
    result = subprocess.run(
        [sys.executable, "-m", "fsdptrace_cli.main", "analyze", str(run_dir), "--format",
         "json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 1, result.stderr
    assert where(pd.DataFrame(json.loads(result.stdout)["findings"])) == expected


def test_quick_benchmark_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "analyzer_throughput.py"), "--quick",
         "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "| events | ranks |" in result.stdout



def test_suite_cpu_counts_the_processes_it_did_not_start(tmp_path: Path) -> None:
    """The suite's CPU by kind of process: a child that starts a writer process in its own
    session (as a rank does, so no one waits for it) is counted, and the command's exit status
    passed on."""
    spin = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', {spin!r}, '-m',"
        " 'fsdptrace.record.writer_process'], start_new_session=True).wait()\n"
        "sys.exit(3)\n")
    out = tmp_path / "seen.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "suite_cpu.py"), "--interval", "0.05",
         "--json", str(out), "--", sys.executable, str(launcher)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    rows = {line.split(" | ")[-1].rstrip(" |"): float(line.split(" | ")[0].strip("| "))
            for line in result.stdout.splitlines() if line.startswith("| ") and "CPU-s" not in line}
    assert rows.get("writer processes", 0) >= 0.4, result.stdout
    assert any(p["cpu_s"] >= 0.4 for p in json.loads(out.read_text())), result.stdout

def test_engines_benchmark_agrees(tiny: tuple[Path, set[tuple]]) -> None:
    """The engines benchmark on a tiny run: the engines that always exist agree, and the dead
    ranks' journal tails are named as what they cannot read."""
    run_dir, _ = tiny
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "engines.py"), str(run_dir), "--repeat", "1",
         "--engines", "fsdptrace-reader,pq-per-file,pa-dataset", "--tasks", "last,orders"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| last | pa-dataset |" in result.stdout
    assert "outside the 1 ranks whose rows are (partly) a journal tail" in result.stdout


def test_dask_benchmark_runs(tmp_path: Path) -> None:
    pytest.importorskip("distributed")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "dask_vs_jobs.py"), "--ranks", "6",
         "--events", "3000", "--repeat", "1", "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| dask-2 |" in result.stdout


def test_batches_of_any_size_give_the_same_findings(tiny: tuple[Path, set[tuple]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The map step batches ranks; one rank per batch, a row limit that splits the run, one
    batch for all and two processes must all give the same table."""
    run_dir, _ = tiny
    whole = fsdptrace.analyze(run_dir).findings
    monkeypatch.setattr(map_step, "BATCH_RANKS", 1)
    pd.testing.assert_frame_equal(whole, fsdptrace.analyze(run_dir).findings)
    done: list[int] = []
    pd.testing.assert_frame_equal(whole, fsdptrace.analyze(
        run_dir, jobs=2, progress=lambda n, total: done.append(n)).findings)
    assert done == sorted(set(done)) and done[-1] == TINY.ranks - 1  # one missing on disk
    monkeypatch.setattr(map_step, "BATCH_RANKS", 256)
    monkeypatch.setattr(map_step, "BATCH_ROWS", TINY.num_events // TINY.ranks * 2)
    pd.testing.assert_frame_equal(whole, fsdptrace.analyze(run_dir).findings)


def test_triage_reads_endings_and_agrees(tmp_path: Path) -> None:
    """``--check stalled-rank`` alone says exactly what the full analysis says of the stalls
    (its cause checks run with it, whatever was asked)."""
    run_dir = tmp_path / "run"
    generate_tiny(run_dir)
    # Small row groups: the stalled rank's last step spans several, its history many more.
    for path in sorted((run_dir / "events").glob("rank=*/part-*.parquet")):
        data = pq.read_table(path)
        pq.write_table(data, path, row_group_size=7)
    full = fsdptrace.analyze(run_dir).findings
    stalled = full[full["check"] == "stalled-rank"].reset_index(drop=True)
    pd.testing.assert_frame_equal(
        stalled, fsdptrace.analyze(run_dir, checks=["stalled-rank"]).findings)


def test_the_read_floor_reads_every_table_the_analyzer_reads() -> None:
    import importlib.util

    from fsdptrace.reading.trace import TABLE_NAMES

    spec = importlib.util.spec_from_file_location(
        "analyzer_throughput", ROOT / "benchmarks" / "analyzer_throughput.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TABLES == TABLE_NAMES


def test_small_runs_benchmark_times_each_sample(capsys: pytest.CaptureFixture[str]) -> None:
    """``small_runs.py`` (in process: its figure is CPU time of this process) on two samples."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "small_runs", ROOT / "benchmarks" / "small_runs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    samples = [ROOT / "sample_traces" / "clean", ROOT / "sample_traces" / "killed-rank"]
    module.main([*map(str, samples), "--repeats", "2", "--number", "1"])
    line = capsys.readouterr().out
    match = re.fullmatch(r"2 run dirs, 2 x 1 analyses of each: min ([\d.]+) ms, "
                         r"median ([\d.]+) ms of CPU per analysis\n", line)
    assert match and 0 < float(match[1]) <= float(match[2]), line


def test_gpu_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    """``gpu_overhead.py --device cpu --quick``: the GPU benchmark's own code path (real
    ``fully_shard`` units, explicit prefetch, alternated blocks, hook timers) on a tiny model;
    every recorder call it times was called, and the two variants ran the same steps."""
    out = tmp_path / "gpu.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_overhead.py"), "--device", "cpu",
         "--quick", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| fsdptrace    |" in result.stdout
    figures = json.loads(out.read_text())
    assert len(figures["times"]["fsdptrace"]) == len(figures["times"]["no recording"]) == 2
    assert {"forward pre-hook", "backward grad hook", "gradient baseline (first micro-step)",
            "optimizer boundary (before_optimizer_step)"} <= set(figures["latency"])


def test_boundary_breakdown_runs(tmp_path: Path) -> None:
    """``boundary_cost.py --breakdown`` on a few units: every part it times was called in the
    recorded loop (a part never reached would print 0 and hide where the boundary goes)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "boundary_cost.py"), "--units", "4",
         "--steps", "2", "--breakdown"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in result.stdout.splitlines() if line.startswith("| backend.")
            or line.startswith("| journal ")}
    assert set(rows) == {"backend.all_gradients", "backend.all_pending_all_gathers",
                         "backend.all_grad_tokens", "journal gradients", "journal pending",
                         "journal grads_written"}
    assert all(float(value) > 0 for value in rows.values()), rows


@pytest.mark.slow
def test_collective_record_cost_compares_reading_each_time(tmp_path: Path) -> None:
    """``collective_record_cost.py --quick --units 4`` (a smoke test; its 33 units by default
    cost twice the CPU): the three variants ran on 2 real ranks and the wrappers' added time is
    given for ``Numbers`` and for reading the counter each time."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "collective_record_cost.py"), "--quick",
         "--units", "4"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for label in ("| with: added by recording", "| read each: added by recording",
                  "| ratio with ÷ read each"):
        assert label in result.stdout, result.stdout
