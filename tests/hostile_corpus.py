"""A hostile-input corpus: real recorded run dirs, mutated the ways an attacker would.

Every case starts from a copy of a shipped ``sample_traces/`` run (real 2-rank FSDP2
recordings) and changes what a copied or attached run dir could hold: odd partitions, claims
of millions of ranks or steps, footers promising more rows than bytes, malformed marker
details, nulls and unknown enums where the checks index, invalid UTF-8, terminal escapes and
code in names, and files that are no files. A seeded ``random.Random`` picks the rank, rows
and values, so a failing case reproduces from its name and seed.

``run_isolated`` runs every command on one case in a forked child under an address-space
limit and an alarm, and reports what each command did and the child's peak memory.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdptrace import schema

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"
BASE = "wrong-forward-prefetch"  # findings, prefetch edges and all-gathers
KILLED = "killed-rank"  # crash messages, a stalled rank
ESCAPES = "\x1b[2J\x1b]0;owned\x07\x1b]52;c;cHduZWQ=\x07\x9b31m\u202e"
INJECTION = "a,b\n__import__('os').system('touch PWNED') #"

# Every command, as a reader of the run dir; ``{out}`` is a scratch folder.
COMMANDS: dict[str, list[str]] = {
    "analyze": ["analyze", "{run}", "-j", "1"],
    "analyze-json": ["analyze", "{run}", "-j", "1", "--format", "json"],
    "analyze-markdown": ["analyze", "{run}", "-j", "1", "--format", "markdown"],
    "analyze-j2": ["analyze", "{run}", "-j", "2"],
    "summary": ["summary", "{run}"],
    "suggest": ["suggest", "{run}"],
    "report": ["report", "{run}", "-j", "1", "-o", "{out}/report.html"],
    "export": ["export", "{run}", "--chrome-trace", "{out}/trace.json"],
}


# ------------------------------------------------------------------ file helpers
def parts(run: Path, table: str, rank: int | None = None) -> list[Path]:
    pattern = f"rank={rank}" if rank is not None else "rank=*"
    return sorted(run.glob(f"{table}/{pattern}/part-*.parquet"))


def rewrite(path: Path, change: Callable[[pa.Table], pa.Table]) -> None:
    """Rewrite one chunk keeping fsdptrace's footer metadata, so only the change is odd."""
    table = pq.read_table(path)
    metadata = table.schema.metadata
    pq.write_table(change(table).replace_schema_metadata(metadata), path)


def set_column(name: str, values: Callable[[pa.Table], list[object]]
               ) -> Callable[[pa.Table], pa.Table]:
    def change(table: pa.Table) -> pa.Table:
        field = table.schema.field(name)
        array = pa.array(values(table))
        kind = field.type.value_type if pa.types.is_dictionary(field.type) else field.type
        array = array.cast(kind) if array.type != pa.null() else pa.nulls(len(array), kind)
        if pa.types.is_dictionary(field.type):
            array = array.dictionary_encode()
        return table.set_column(table.schema.get_field_index(name), name, array)

    return change


def set_cell(path: Path, name: str, value: object, rng: random.Random) -> None:
    """One seeded row of one column gets ``value``; the rest keep theirs."""

    def change(table: pa.Table) -> pa.Table:
        column = table.column(name).to_pylist()
        column[rng.randrange(len(column))] = value
        return set_column(name, lambda _: column)(table)

    rewrite(path, change)


def rename_strings(run: Path, rename: Callable[[str], str]) -> None:
    """Every unit-like name in every table is renamed, consistently across ranks."""
    for path in run.glob("*/rank=*/part-*.parquet"):
        def change(table: pa.Table) -> pa.Table:
            for name in ("unit", "target", "issuer_unit", "fqn"):
                if name in table.column_names:
                    values = [None if v is None else rename(v)
                              for v in table.column(name).to_pylist()]
                    table = set_column(name, lambda _, v=values: v)(table)
            return table

        rewrite(path, change)


def add_marker(run: Path, rank: int, kind: str, detail: str) -> None:
    path = parts(run, "markers", rank)[0]

    def change(table: pa.Table) -> pa.Table:
        row = {name: table.column(name).to_pylist()[-1] for name in table.column_names}
        row.update(kind=kind, detail=detail, count=3)
        extra = pa.Table.from_pylist([row], schema=table.schema.remove_metadata()
                                     ).cast(table.schema.remove_metadata())
        return pa.concat_tables([table.cast(extra.schema), extra]).unify_dictionaries()

    rewrite(path, change)


def drop_detail(**fields: object) -> str:
    detail = {"table": "events", "first_seq": 1, "last_seq": 2, "first_step": 0,
              "first_micro_step": 0, "last_step": 0, "last_micro_step": 1}
    detail.update(fields)
    return json.dumps(detail)


def invalid_utf8_dictionary(path: Path, name: str) -> None:
    """A dictionary entry of bytes that are no UTF-8, written under a string type."""
    table = pq.read_table(path)
    column = table.column(name).combine_chunks()
    words = [w.encode() for w in column.dictionary.to_pylist()]
    words[0] = b"\xff\xfe" + words[0]
    offsets = np.cumsum([0] + [len(w) for w in words]).astype(np.int32)
    bad = pa.Array.from_buffers(pa.string(), len(words),
                                [None, pa.py_buffer(offsets.tobytes()),
                                 pa.py_buffer(b"".join(words))])
    array = pa.DictionaryArray.from_arrays(column.indices, bad)
    table = table.set_column(table.schema.get_field_index(name), name, array)
    pq.write_table(table, path)


def row_bomb(path: Path, num_rows: int) -> None:
    """A tiny file whose footer claims ``num_rows`` rows of one repeated event."""
    table = pq.read_table(path)
    one = table.slice(0, 1)
    metadata = table.schema.metadata
    with pq.ParquetWriter(path, one.schema.with_metadata(metadata), compression="zstd") as w:
        block = pa.concat_tables([one] * 1024).combine_chunks()
        w.write_table(pa.concat_tables([block] * (num_rows // 1024)),
                      row_group_size=num_rows)


def row_groups(path: Path, num_groups: int) -> None:
    table = pq.read_table(path)
    one = table.slice(0, 1)
    pq.write_table(pa.concat_tables([one] * num_groups), path, row_group_size=1)


def string_bomb(path: Path, length: int, num_rows: int) -> None:
    """One long detail string referenced by every row: small on disk, huge decoded."""
    table = pq.read_table(path)
    metadata = table.schema.metadata
    one = table.slice(0, 1)
    many = pa.concat_tables([one] * num_rows)
    detail = pa.DictionaryArray.from_arrays(pa.array(np.zeros(num_rows, dtype=np.int32)),
                                            pa.array(["x" * length]))
    many = many.set_column(many.schema.get_field_index("detail"), "detail", detail)
    pq.write_table(many.replace_schema_metadata(metadata), path, compression="zstd")


def truncate_to_step_zero(run: Path) -> None:
    """A run killed in step 0: later rows and every end marker are gone."""
    for path in run.glob("*/rank=*/part-*.parquet"):
        table = pq.read_table(path)
        if "step" not in table.column_names:
            continue
        keep = np.asarray(table.column("step").to_numpy(zero_copy_only=False)) == 0
        if "kind" in table.column_names and "markers" in str(path):
            kinds = np.asarray(table.column("kind").cast(pa.string()).to_pylist(), dtype=object)
            keep &= ~np.isin(kinds, [schema.MARKER_CLOSE, schema.MARKER_CRASH])
        if "events" in str(path):  # stop in the middle of step 0's forward
            keep &= np.arange(table.num_rows) < 3
        pq.write_table(table.filter(pa.array(keep)), path)


# ------------------------------------------------------------------ the corpus
Mutation = Callable[[Path, random.Random], None]


def _rename_partition(new: str) -> Mutation:
    def mutate(run: Path, rng: random.Random) -> None:
        table = rng.choice(["events", "meta", "markers"])
        (run / table / "rank=1").rename(run / table / new)

    return mutate


def _copy_partition(new: str) -> Mutation:
    def mutate(run: Path, rng: random.Random) -> None:
        shutil.copytree(run / "events" / "rank=1", run / "events" / new)

    return mutate


def _cell(table: str, name: str, value: object) -> Mutation:
    def mutate(run: Path, rng: random.Random) -> None:
        set_cell(parts(run, table, rng.randrange(2))[0], name, value, rng)

    return mutate


def _all_ranks(table: str, name: str, value: object) -> Mutation:
    def mutate(run: Path, rng: random.Random) -> None:
        for path in parts(run, table):
            rewrite(path, set_column(name, lambda t: [value] * t.num_rows))

    return mutate


def _marker(kind: str, detail: str) -> Mutation:
    def mutate(run: Path, rng: random.Random) -> None:
        add_marker(run, rng.randrange(2), kind, detail)

    return mutate


def _file(change: Callable[[Path], None], table: str = "events") -> Mutation:
    def mutate(run: Path, rng: random.Random) -> None:
        change(parts(run, table, rng.randrange(2))[0])

    return mutate


def _symlink(target: str) -> Mutation:
    def mutate(run: Path, rng: random.Random) -> None:
        path = parts(run, "events", rng.randrange(2))[0]
        path.unlink()
        path.symlink_to(target if target != "self" else path)

    return mutate


def _fifo(run: Path, rng: random.Random) -> None:
    os.mkfifo(run / "events" / "rank=0" / "part-fifo-000009.parquet")


def _extra_columns(path: Path) -> None:
    rewrite(path, lambda t: t.append_column("junk", pa.array(["x"] * t.num_rows)))


CASES: dict[str, tuple[str, Mutation]] = {
    # partitions
    "rank=01": (BASE, _rename_partition("rank=01")),
    "rank=arabic-digit": (BASE, _rename_partition("rank=\u0661")),
    "rank=huge": (BASE, _copy_partition("rank=99999999999999999999")),
    "rank=int32-overflow": (BASE, _copy_partition("rank=2147483648")),
    "rank=beyond-world": (BASE, _copy_partition("rank=5")),
    # world size
    "world_size=5M": (BASE, _all_ranks("meta", "world_size", 5_000_000)),
    "world_size=int32-max": (BASE, _all_ranks("meta", "world_size", 2**31 - 1)),
    "world_size=0": (BASE, _all_ranks("meta", "world_size", 0)),
    "world_size=-1": (BASE, _all_ranks("meta", "world_size", -1)),
    "world_size=null": (BASE, _all_ranks("meta", "world_size", None)),
    # dropped_rows details
    "drop:last_step=2e9": (BASE, _marker(schema.MARKER_DROPPED_ROWS,
                                         drop_detail(last_step=2_000_000_000))),
    "drop:list": (BASE, _marker(schema.MARKER_DROPPED_ROWS, "[1, 2, 3]")),
    "drop:dict-values": (BASE, _marker(schema.MARKER_DROPPED_ROWS,
                                       drop_detail(first_step={"a": 1}))),
    "drop:deep": (BASE, _marker(schema.MARKER_DROPPED_ROWS, "[" * 100_000)),
    "drop:not-json": (BASE, _marker(schema.MARKER_DROPPED_ROWS, "{'table': eval('1')}")),
    "drop:backwards": (BASE, _marker(schema.MARKER_DROPPED_ROWS,
                                     drop_detail(first_step=1, last_step=0))),
    "drop:float-step": (BASE, _marker(schema.MARKER_DROPPED_ROWS, drop_detail(last_step=1e308))),
    "drop:table-list": (BASE, _marker(schema.MARKER_DROPPED_ROWS, drop_detail(table=["x"]))),
    "drop:null-steps": (BASE, _marker(schema.MARKER_DROPPED_ROWS,
                                      drop_detail(first_step=None, last_step=None))),
    # indexes, enums, nulls where the checks index
    "prefetch:null-target_index": (BASE, _all_ranks("prefetch", "target_index", None)),
    "prefetch:huge-target_index": (BASE, _cell("prefetch", "target_index", 2**31 - 1)),
    "prefetch:unknown-phase": (BASE, _all_ranks("prefetch", "phase", "sideways")),
    "events:unknown-phase": (BASE, _cell("events", "phase", "sideways")),
    "events:null-unit": (BASE, _cell("events", "unit", None)),
    "events:null-phase": (BASE, _cell("events", "phase", None)),
    "events:null-step": (BASE, _cell("events", "step", None)),
    "events:negative-step": (BASE, _cell("events", "step", -7)),
    "events:int32-max-step": (BASE, _cell("events", "step", 2**31 - 1)),
    "events:huge-micro_step": (BASE, _cell("events", "micro_step", 2**31 - 1)),
    "prefetch:null-unit": (BASE, _cell("prefetch", "unit", None)),
    "markers:null-step": (BASE, _cell("markers", "step", None)),
    "markers:unknown-kind": (BASE, _cell("markers", "kind", "\x1b[31mweird")),
    "allgathers:null-event": (BASE, _cell("allgathers", "event", None)),
    "units:null-unit": (BASE, _cell("units", "unit", None)),
    # encodings and names
    "utf8:events-unit": (BASE, _file(lambda p: invalid_utf8_dictionary(p, "unit"))),
    "escapes:unit-names": (BASE, lambda run, rng: rename_strings(run, lambda v: v + ESCAPES)),
    "escapes:host": (KILLED, _all_ranks("meta", "host", "vm" + ESCAPES)),
    "escapes:backend": (KILLED, _all_ranks("meta", "backend", ESCAPES)),
    "escapes:crash-message": (KILLED, _all_ranks("markers", "detail", "boom" + ESCAPES)),
    "escapes:run-dir-marker-kind": (KILLED, _marker(schema.MARKER_CRASH, ESCAPES * 3)),
    "injection:suggest": (BASE, lambda run, rng: rename_strings(
        run, lambda v: INJECTION if v == "layers.2" else v)),
    "bidi+newline:names": (BASE, lambda run, rng: rename_strings(
        run, lambda v: v.replace(".", "\u202e.\n\r"))),
    # sizes
    "rows:2M-in-kilobytes": (BASE, _file(lambda p: row_bomb(p, 2_000_000))),
    "row-groups:5000": (BASE, _file(lambda p: row_groups(p, 5000))),
    "strings:64MB-detail": (KILLED, _file(lambda p: string_bomb(p, 1 << 16, 1 << 10),
                                          "markers")),
    # files that are no files
    "file:empty": (BASE, _file(lambda p: p.write_bytes(b""))),
    "file:truncated": (BASE, _file(lambda p: p.write_bytes(p.read_bytes()[:200]))),
    "file:extra-columns": (BASE, _file(_extra_columns)),
    "file:wrong-types": (BASE, _file(lambda p: rewrite(p, lambda t: t.set_column(
        t.schema.get_field_index("step"), "step", pa.array([f"s{i}" for i in range(
            t.num_rows)]))))),
    "file:symlink-passwd": (BASE, _symlink("/etc/passwd")),
    "file:symlink-loop": (BASE, _symlink("self")),
    "file:fifo": (BASE, _fifo),
    # real shapes that used to break a command
    "killed-in-step-0": (KILLED, lambda run, rng: truncate_to_step_zero(run)),
    "no-meta": (BASE, lambda run, rng: shutil.rmtree(run / "meta")),
}


def build(name: str, target: Path, *, seed: int) -> Path:
    """The run dir of case ``name`` under ``target``, reproducible from ``seed``."""
    base, mutate = CASES[name]
    run = target / "run"
    shutil.copytree(SAMPLES / base, run, symlinks=True)
    mutate(run, random.Random(f"{seed}:{name}"))
    return run


# ------------------------------------------------------------------ running a case
@dataclass
class Outcome:
    command: str
    exit_code: int
    stdout: str
    stderr: str
    stdout_has_escape: bool
    traceback: bool
    seconds: float


def run_commands(run: Path, scratch: Path) -> list[Outcome]:
    """Every command on one run dir, in process, as a user's shell would see it."""
    from click.testing import CliRunner
    from fsdptrace_cli.main import cli

    outcomes = []
    for name, template in COMMANDS.items():
        args = [a.format(run=run, out=scratch) for a in template]
        start = time.perf_counter()
        result = CliRunner().invoke(cli, args)
        shown = result.stdout + result.stderr
        outcomes.append(Outcome(
            command=name, exit_code=result.exit_code, stdout=result.stdout[-4000:],
            stderr=result.stderr,
            stdout_has_escape=any(c in result.stdout for c in "\x1b\x9b\x07"),
            traceback="Traceback" in shown or not isinstance(
                result.exception, SystemExit | None),
            seconds=time.perf_counter() - start))
    return outcomes


def run_isolated(run: Path, *, memory_bytes: int, timeout_s: int) -> tuple[list[Outcome], int]:
    """``run_commands`` in a forked child under an address-space limit and an alarm.

    Returns the outcomes and the child's peak resident memory in bytes; a child that dies
    (memory, time, a signal) is reported as one outcome with exit code -1.
    """
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "outcomes.json"
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0
            try:
                resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
                signal.alarm(timeout_s)
                outcomes = run_commands(run, Path(scratch))
                report.write_text(json.dumps([asdict(o) for o in outcomes]))
            except BaseException:
                report.write_text(json.dumps({"crash": traceback.format_exc()}))
                code = 3
            os._exit(code)
        _, status, usage = os.wait4(pid, 0)
        peak = usage.ru_maxrss * 1024
        data = json.loads(report.read_text()) if report.exists() else None
        if os.WIFSIGNALED(status) or not isinstance(data, list):
            why = (f"child died: signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                   else f"child failed: {data}")
            return [Outcome("all", -1, "", why, False, True, 0.0)], peak
        return [Outcome(**o) for o in data], peak
