"""Bad input to the analyzer: every odd run dir gives one clear line and the right exit code.

Each input is a copy of a real scenario run dir (``scenario_runs``) with files rewritten by
pyarrow, keeping fsdptrace's schema metadata unless the case is about that metadata. The CLI
runs through click's ``CliRunner``: 2 for bad input (no traceback), 1/0 for findings.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from fsdptrace_cli.main import cli

import fsdptrace
from fsdptrace.errors import SkippedChunkWarning
from fsdptrace.reading.reader import covered_ranges, part_files
from fsdptrace.store import schema
from fsdptrace.store.journal_format import SEGMENT_NAME
from fsdptrace.store.journal_read import read_segment

pytestmark = pytest.mark.slow


def analyze_cli(run_dir: Path, *args: str) -> Result:
    result = CliRunner().invoke(cli, ["analyze", str(run_dir), "--jobs", "1", *args])
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def copy_run(scenario_runs: Path, tmp_path: Path, name: str = "clean") -> Path:
    target = tmp_path / name
    shutil.copytree(scenario_runs / name, target)
    return target


def first_part(run_dir: Path, table: str, rank: int = 0) -> Path:
    return sorted((run_dir / table / f"rank={rank}").glob("part-*.parquet"))[0]


def rewrite(path: Path, change: Callable[[pa.Table], pa.Table]) -> None:
    """Rewrite one chunk; the change decides what happens to the footer metadata."""
    pq.write_table(change(pq.read_table(path)), path)


def with_version(version: bytes) -> Callable[[pa.Table], pa.Table]:
    def change(table: pa.Table) -> pa.Table:
        meta = dict(table.schema.metadata or {})
        meta[schema.SCHEMA_VERSION_KEY] = version
        meta[schema.FSDPTRACE_VERSION_KEY] = b"9.9"
        return table.replace_schema_metadata(meta)

    return change


# ------------------------------------------------------------------ corrupt files
def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _footer_only_garbage(path: Path) -> None:
    path.write_bytes(b"PAR1" + b"\x00garbage" * 50 + b"PAR1")


SKIPPED = "fsdptrace: warning: skipping "


def split_by_step(path: Path) -> list[Path]:
    """Rewrite one chunk as one chunk per optimizer step (as a long run's writer leaves them),
    in the same order; returns them."""
    data = pq.read_table(path)
    steps = sorted(set(data.column("step").to_pylist()))
    path.unlink()
    paths = []
    for index, step in enumerate(steps):
        piece = path.with_name(path.name.replace(".parquet", f"-{index:06d}.parquet"))
        pq.write_table(data.filter(pa.compute.equal(data.column("step"), step)), piece)
        paths.append(piece)
    return paths


@pytest.mark.parametrize("corrupt", [_empty, _truncated, _footer_only_garbage])
@pytest.mark.parametrize("table", ["events", "meta"])
def test_a_corrupt_chunk_is_skipped_with_one_warning(
    scenario_runs: Path, tmp_path: Path, corrupt: Callable[[Path], None], table: str
) -> None:
    run = copy_run(scenario_runs, tmp_path)
    path = first_part(run, table, rank=1)
    corrupt(path)
    result = analyze_cli(run)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        line for line in result.stderr.splitlines() if line.startswith(SKIPPED)]
    assert len(result.stderr.splitlines()) == 1 and str(path) in result.stderr
    assert "truncated or corrupt" in result.stderr


def test_the_steps_of_a_skipped_chunk_are_incomplete(scenario_runs: Path,
                                                     tmp_path: Path) -> None:
    """Only the steps between the readable chunks around it; no check misreads the gap."""
    run = copy_run(scenario_runs, tmp_path, "wrong-forward-prefetch")
    pieces = split_by_step(first_part(run, "events", rank=1))
    assert len(pieces) == 3
    _truncated(pieces[1])
    with pytest.warns(SkippedChunkWarning, match=pieces[1].name):
        ranges = fsdptrace.incomplete_ranges(run)
    assert ranges[["rank", "table", "first_step", "last_step"]].values.tolist() == [
        [1, "events", 0, 2]]
    result = analyze_cli(run, "--format", "json", "--check", "prefetch-order")
    assert result.exit_code == 1 and result.stderr.startswith(SKIPPED), result.output
    found = json.loads(result.stdout)["findings"]
    assert {(f["rank"], f["step"]) for f in found} == {(0, 0), (0, 1), (0, 2)}
    assert "rank 1: steps 0-2 (events: an unreadable chunk)" in CliRunner().invoke(
        cli, ["summary", str(run)]).stdout
    _truncated(pieces[2])  # the last chunk too: the gap runs past the last recorded step
    with pytest.warns(SkippedChunkWarning, match=pieces[2].name):
        ranges = fsdptrace.incomplete_ranges(run)
    assert ranges[["first_step", "last_step"]].values.tolist() == [[0, 3]]


def test_a_corrupt_chunk_in_parallel_map_is_said_once(scenario_runs: Path,
                                                      tmp_path: Path) -> None:
    """The per-rank map runs in worker processes: the parent says what they skipped, once."""
    run = copy_run(scenario_runs, tmp_path)
    path = first_part(run, "events", rank=1)
    _truncated(path)
    for args in (["--jobs", "2"], ["--jobs", "2", "--format", "markdown"]):
        result = CliRunner().invoke(cli, ["analyze", str(run), *args])
        assert result.exit_code == 0, result.output
        assert result.stderr.splitlines() == [line for line in result.stderr.splitlines()
                                              if line.startswith(SKIPPED + str(path))]
        assert len(result.stderr.splitlines()) == 1


def test_nothing_readable_left_is_bad_input(scenario_runs: Path, tmp_path: Path) -> None:
    run = copy_run(scenario_runs, tmp_path)
    for path in [*run.glob("meta/*/part-*.parquet"), *run.glob("units/*/part-*.parquet")]:
        _empty(path)
    result = analyze_cli(run)
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"fsdptrace: error: nothing readable left in {run}: every "
                                      "meta and units chunk is truncated or corrupt")


# ------------------------------------------------------------------ schemas and versions
def test_wrong_columns_is_bad_input(scenario_runs: Path, tmp_path: Path) -> None:
    run = copy_run(scenario_runs, tmp_path)
    path = first_part(run, "events")
    rewrite(path, lambda t: t.drop_columns(["unit"]))
    result = analyze_cli(run)
    assert result.exit_code == 2
    assert f"{path}: not a events table (missing columns unit)" in result.stderr


def test_wrong_column_types_is_bad_input_naming_the_file(
    scenario_runs: Path, tmp_path: Path
) -> None:
    run = copy_run(scenario_runs, tmp_path)
    path = first_part(run, "events")

    def strings_for_steps(table: pa.Table) -> pa.Table:
        index = table.schema.get_field_index("step")
        values = pa.array(["step-" + str(v) for v in table["step"].to_pylist()])
        return table.set_column(index, "step", values)

    rewrite(path, strings_for_steps)
    result = analyze_cli(run)
    assert result.exit_code == 2, result.output
    assert str(path) in result.stderr and "step" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_parquet_not_written_by_fsdptrace_is_bad_input(
    scenario_runs: Path, tmp_path: Path
) -> None:
    run = copy_run(scenario_runs, tmp_path)
    path = first_part(run, "markers")
    rewrite(path, lambda t: t.replace_schema_metadata({}))
    result = analyze_cli(run)
    assert result.exit_code == 2
    assert f"{path}: not written by fsdptrace" in result.stderr


@pytest.mark.parametrize("table", ["meta", "events", "prefetch"])
def test_future_schema_version_says_which_versions(
    scenario_runs: Path, tmp_path: Path, table: str
) -> None:
    run = copy_run(scenario_runs, tmp_path)
    path = first_part(run, table, rank=1)
    rewrite(path, with_version(b"99"))
    result = analyze_cli(run)
    assert result.exit_code == 2
    readable = " and ".join(map(str, schema.READABLE_SCHEMA_VERSIONS))
    assert (f"{path}: written by fsdptrace 9.9 with schema 99; this fsdptrace reads schema "
            f"{readable}") in result.stderr


def test_ranks_of_different_versions_name_the_odd_rank(
    scenario_runs: Path, tmp_path: Path
) -> None:
    run = copy_run(scenario_runs, tmp_path)
    for path in run.glob("*/rank=1/part-*.parquet"):
        rewrite(path, with_version(b"3"))
    result = analyze_cli(run)
    assert result.exit_code == 2
    assert "/rank=1/" in result.stderr and "with schema 3" in result.stderr
    assert "/rank=0/" not in result.stderr


# ------------------------------------------------------------------ layout
def test_missing_rank_partition_is_a_finding(scenario_runs: Path, tmp_path: Path) -> None:
    run = copy_run(scenario_runs, tmp_path)
    for partition in run.glob("*/rank=1"):
        shutil.rmtree(partition)
    result = analyze_cli(run, "--format", "json")
    assert result.exit_code == 1, result.output
    found = json.loads(result.stdout)["findings"]
    assert [(f["check"], f["rank"]) for f in found] == [("stalled-rank", 1)]
    assert "rank 1 of world size 2 has no data on disk" in found[0]["message"]


def test_rank_missing_from_one_table_only_is_not_an_error(
    scenario_runs: Path, tmp_path: Path
) -> None:
    """A rank that recorded nothing in a table (no pending all-gathers) is normal."""
    run = copy_run(scenario_runs, tmp_path)
    shutil.rmtree(run / "gradients" / "rank=1")
    assert analyze_cli(run).exit_code == 0


@pytest.mark.parametrize("name", ["rank=01", "rank=\u0661", "rank=2147483648"])
def test_non_canonical_rank_partitions_are_bad_input(scenario_runs: Path, tmp_path: Path,
                                                     name: str) -> None:
    """``int()`` reads them, but the reader would open another partition: refuse, by name."""
    run = copy_run(scenario_runs, tmp_path)
    shutil.copytree(run / "events" / "rank=1", run / "events" / name)
    result = analyze_cli(run)
    assert result.exit_code == 2
    assert f"events/{name}:" in result.stderr and "rank" in result.stderr


def test_two_processes_claiming_one_rank_are_bad_input(
    scenario_runs: Path, tmp_path: Path
) -> None:
    run = copy_run(scenario_runs, tmp_path)
    source = first_part(run, "meta", rank=1)
    other = source.with_name("part-wother-000000.parquet")
    table = pq.read_table(source)
    pq.write_table(table.set_column(table.schema.get_field_index("pid"), "pid",
                                    pa.array([4242], pa.int64())), other)
    result = analyze_cli(run)
    assert result.exit_code == 2
    assert "rank 1" in result.stderr and "several processes" in result.stderr


def test_garbage_files_are_ignored(scenario_runs: Path, tmp_path: Path) -> None:
    run = copy_run(scenario_runs, tmp_path, "wrong-forward-prefetch")
    expected = fsdptrace.analyze(run).findings
    (run / "README.txt").write_text("notes")
    (run / "junk").mkdir()
    (run / "junk" / "rank=0").mkdir()
    (run / "events" / "notes.txt").write_text("x")
    (run / "events" / "rank=zero").mkdir()
    (run / "events" / "rank=3.parquet").write_bytes(b"\x00")
    (run / "events" / "rank=0" / ".DS_Store").write_bytes(b"\x00\x01")
    (run / "events" / "rank=0" / "garbage.bin").write_bytes(b"\xff" * 100)
    (run / "events" / "rank=0" / ".part-w1-000009.parquet.tmp").write_bytes(b"PAR1")
    pd.testing.assert_frame_equal(fsdptrace.analyze(run).findings, expected)
    assert analyze_cli(run).exit_code == 1


@pytest.mark.parametrize("path", ["", "nope", "file"])
def test_not_a_run_dir_is_bad_input(tmp_path: Path, path: str) -> None:
    target = tmp_path / path if path else tmp_path
    if path == "file":
        target.write_text("x")
    result = analyze_cli(target)
    assert result.exit_code == 2 and result.stderr.startswith("fsdptrace: error: ")


# ------------------------------------------------------------------ odd unit names
ODD = {
    "layers.0": 'lay"ers\'.0\n# not a heading',
    "layers.1": "<script>alert(1)</script>|x|",
    "layers.2": "층.2 → 😀 `code` *bold* [link](http://x)",
    "layers.3": "\\back\\slash\r\ttab_",
}


def _rename(table: pa.Table) -> pa.Table:
    """Every string column: only exact unit names change, so other text stays as it was."""
    for index, field in enumerate(table.schema):
        kind = field.type.value_type if pa.types.is_dictionary(field.type) else field.type
        if not pa.types.is_string(kind):
            continue
        values = [ODD.get(v, v) for v in table[field.name].to_pylist()]
        table = table.set_column(index, field, pa.array(values).cast(field.type))
    return table


def fold_journal(run: Path) -> None:
    """Write a killed rank's journal tail as Parquet parts, so rewriting reaches every row."""
    for segment in sorted(run.glob("journal/rank=*/*.seg")):
        match = SEGMENT_NAME.match(segment.name)
        assert match
        table, partition = match["table"], run / match["table"] / segment.parent.name
        ranges = covered_ranges(part_files(partition)).get(match["writer"], [])
        if not any(a <= int(match["index"]) <= b for a, b in ranges):
            stamped = schema.with_metadata(schema.TABLES[table],
                                           rank=int(segment.parent.name[5:]), version="test")
            pq.write_table(read_segment(segment, table).cast(stamped),
                           partition / f"part-tail{match['index']}-000000.parquet")
        segment.unlink()


def odd_copy(scenario_runs: Path, tmp_path: Path, name: str) -> Path:
    run = copy_run(scenario_runs, tmp_path, name)
    fold_journal(run)
    for path in run.glob("*/rank=*/part-*.parquet"):
        rewrite(path, _rename)
    return run


@pytest.mark.parametrize("name", ["wrong-forward-prefetch", "rank-divergence", "killed-rank"])
def test_odd_unit_names_keep_every_finding(scenario_runs: Path, tmp_path: Path,
                                           name: str) -> None:
    original = fsdptrace.analyze(scenario_runs / name).findings
    renamed = fsdptrace.analyze(odd_copy(scenario_runs, tmp_path, name)).findings
    assert len(original)
    for column in ("check", "severity", "rank", "step", "micro_step", "phase"):
        pd.testing.assert_series_equal(renamed[column], original[column])
    for column in ("unit", "target"):
        expected = original[column].map(lambda v: ODD.get(v, v), na_action="ignore")
        pd.testing.assert_series_equal(renamed[column], expected.astype("string"))


def test_reports_escape_odd_unit_names(scenario_runs: Path, tmp_path: Path) -> None:
    run = odd_copy(scenario_runs, tmp_path, "wrong-forward-prefetch")
    findings = fsdptrace.analyze(run).findings
    odd_in_findings = set(findings["unit"].dropna()) & set(ODD.values())
    assert odd_in_findings

    as_json = analyze_cli(run, "--format", "json")
    assert as_json.exit_code == 1
    document = json.loads(as_json.stdout)
    assert {f["unit"] for f in document["findings"]} == set(findings["unit"].dropna())

    markdown = analyze_cli(run, "--format", "markdown")
    assert markdown.exit_code == 1
    assert "<script>" not in markdown.stdout and "\\<script\\>" in markdown.stdout
    separators = None  # each table's rows have as many cells as its header: no "|" escaped
    for line in markdown.stdout.splitlines():
        assert not line.startswith("# not a heading")
        if not line.startswith("| "):
            separators = None
        elif separators is None:
            separators = line.count(" | ")
        else:
            assert line.count(" | ") == separators and line.endswith(" |"), line

    plain = analyze_cli(run)
    assert plain.exit_code == 1
    assert not any(line.startswith("# not a heading") for line in plain.stdout.splitlines())
    assert "\r" not in plain.stdout


def test_every_step_the_reader_accepts_has_its_own_key() -> None:
    """``step_key(0, 1_000_000) == step_key(1, 0)`` held while the reader accepted micro-steps
    up to 1,048,575: now the key's widths are the reader's ranges (``key_ranges``)."""
    from fsdptrace.reading.incomplete import in_micro_steps
    from fsdptrace.reading.keys import place_key, rank_step_key, step_key
    from fsdptrace.reading.validate import MAX_MICRO_STEP, MAX_RANK, MAX_STEP

    assert step_key(0, 1_000_000) != step_key(1, 0)
    assert step_key(0, MAX_MICRO_STEP) < step_key(1, 0)
    assert step_key(MAX_STEP, MAX_MICRO_STEP) < 2**63
    assert rank_step_key(MAX_RANK, MAX_STEP, MAX_MICRO_STEP) < 2**63
    assert rank_step_key(0, MAX_STEP, MAX_MICRO_STEP) < rank_step_key(1, 0, 0)
    last = place_key(["boundary"], [MAX_STEP], [MAX_MICRO_STEP], [1], [2**16 - 1])
    assert 0 < int(last[0]) < 2**63
    assert place_key(["pass"], [0], [MAX_MICRO_STEP], [1], [2**16 - 1])[0] < \
        place_key(["eval"], [1], [0], [0], [0])[0] < place_key(["pass"], [1], [0], [0], [0])[0]
    # An incomplete range ending at the last micro-step of step 0 does not reach step 1.
    ranges = pd.DataFrame({"rank": [0], "table": ["events"], "first_step": [0],
                           "first_micro_step": [0], "last_step": [0],
                           "last_micro_step": [1_000_000], "num_rows": [1]})
    inside = in_micro_steps(ranges, ("events",), np.array([0, 0]), np.array([0, 1]),
                            np.array([1_000_000, 0]))
    assert inside.tolist() == [True, False]


@pytest.mark.parametrize("case", ["seg:bad-magic", "seg:sparse-3GB", "seg:deep-vocab"])
def test_an_unreadable_segment_is_skipped_and_its_steps_are_incomplete(
        tmp_path: Path, case: str) -> None:
    """Before, one bad segment made the whole run dir unreadable (or a MemoryError, a
    RecursionError); now it is skipped as an unreadable part is, and counted."""
    from tests.hostile_corpus import build

    run = build(case, tmp_path, seed=16)
    segment = next(run.glob("journal/rank=*/*.seg"))
    with pytest.warns(SkippedChunkWarning, match="unreadable journal segment"):
        ranges = fsdptrace.incomplete_ranges(run)
    rank = int(segment.parent.name.removeprefix("rank="))
    assert ranges[["rank", "table", "cause"]].values.tolist() == [[rank, "events", "unreadable"]]
    summary = CliRunner().invoke(cli, ["summary", str(run), "--format", "json"])
    assert summary.exit_code == 0 and summary.stderr.count("skipping") == 1, summary.output
    assert json.loads(summary.stdout)["unreadable_chunks"] == 1


def test_a_damaged_flight_recorder_dump_is_one_warning_line(scenario_runs: Path,
                                                             tmp_path: Path) -> None:
    """A dump that is no Flight Recorder JSON is skipped with one line naming it (it was a
    Python warning with our source line beneath it); the stalled ranks are still reported."""
    run_dir = copy_run(scenario_runs, tmp_path, "killed-rank")
    dump = run_dir / "dumps" / "rank=1" / "flight_recorder-1.json"
    dump.parent.mkdir(parents=True, exist_ok=True)
    dump.write_bytes(b"\x00 not json")
    result = analyze_cli(run_dir)
    assert result.exit_code == 1 and "stalled-rank" in result.stdout, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith(f"fsdptrace: warning: {dump}: not a Flight Recorder dump "
                           "(JSONDecodeError") and line.endswith("; skipped"), line
