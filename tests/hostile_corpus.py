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

import functools
import json
import os
import random
import resource
import shutil
import signal
import struct
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pyarrow.parquet as pq

import fsdptrace.store.journal_format as jf
from fsdptrace.store import schema
from fsdptrace.store.run_mark import RUN_MARK

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"
BASE = "wrong-forward-prefetch"  # findings, prefetch edges and all-gathers
KILLED = "killed-rank"  # crash messages, a stalled rank
ESCAPES = "\x1b[2J\x1b]0;owned\x07\x1b]52;c;cHduZWQ=\x07\x9b31m\u202e"
INJECTION = "a,b\n__import__('os').system('touch PWNED') #"

# Every command, as a reader of the run dir; ``{out}`` is a scratch folder. The map step in a
# pool (``-j 2``) and the JSON output are one command: each is its own path (rows read and
# errors raised in worker processes; the JSON renderer), and the findings of ``-j 1`` and
# ``-j 2`` are the same table (tests/test_distributed.py), so their other pairings would run
# one more analysis a case (a ninth of the corpus) to try nothing new.
COMMANDS: dict[str, list[str]] = {
    "analyze": ["analyze", "{run}", "-j", "1"],
    "analyze-j2-json": ["analyze", "{run}", "-j", "2", "--format", "json"],
    "analyze-markdown": ["analyze", "{run}", "-j", "1", "--format", "markdown"],
    "summary": ["summary", "{run}"],
    "suggest": ["suggest", "{run}"],
    "report": ["report", "{run}", "-j", "1", "-o", "{out}/report.html"],
    "export": ["export", "{run}", "--chrome-trace", "{out}/trace.json"],
    "diff": ["diff", str(SAMPLES / BASE), "{run}"],
}

# Journal segments damaged in ways the one decoder (``journal_read.read_segment``, called by the
# reader of every command) refuses alike, as an unreadable chunk: each command's handling of a
# skipped segment is tried on one damage of each kind (``JOURNAL_CASES``: a header, a
# vocabulary, a frame, a fixed-width row, a sparse file, not a file), and these, the other
# damages of a kind, go through ``analyze`` alone in the test suite. ``main`` runs them all.
DECODER_ONLY = frozenset({
    "seg:header-only", "seg:offset-beyond", "seg:vocab-length-4GB", "seg:wrong-kind",
    "seg:deep-vocab", "seg:vocab-list", "seg:vocab-missing-column",
    "seg:deep-frame", "seg:frame-not-list", "seg:frame-short-rows", "seg:frame-wrong-types",
    "seg:sparse-1GB-markers"})


def commands_for(name: str) -> list[str]:
    """The commands the test suite runs on case ``name``."""
    return ["analyze"] if name in DECODER_ONLY else list(COMMANDS)


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


# ------------------------------------------------------------------ schema-2 and empty tables
def typed_column(name: str, kind: str) -> Callable[[pa.Table], pa.Table]:
    """Column ``name`` as a struct or a list of its values: a type no recorder writes there."""
    def change(table: pa.Table) -> pa.Table:
        values = table.column(name).cast(pa.string()) if pa.types.is_dictionary(
            table.schema.field(name).type) else table.column(name)
        values = values.combine_chunks()
        array = (pa.StructArray.from_arrays([values], names=["name"]) if kind == "struct"
                 else pa.ListArray.from_arrays(pa.array(range(len(values) + 1), pa.int32()),
                                               values))
        return table.set_column(table.schema.get_field_index(name), name, array)

    return change


def _typed(table: str, name: str, kind: str) -> Mutation:
    def mutate(run: Path, rng: random.Random) -> None:
        rewrite(parts(run, table, rng.randrange(2))[0], typed_column(name, kind))

    return mutate


def _no_rows(table: str) -> Mutation:
    def mutate(run: Path, rng: random.Random) -> None:
        for path in parts(run, table):
            rewrite(path, lambda t: t.slice(0, 0))

    return mutate


def _dir_is_file(table: str) -> Mutation:
    def mutate(run: Path, rng: random.Random) -> None:
        if (run / table).exists():
            shutil.rmtree(run / table)
        (run / table).write_text("not a folder\n")

    return mutate


def add_table(run: Path, table: str, rows: list[dict[str, object]]) -> None:
    """A schema-2 table (one the schema-1 samples lack) with ``rows`` on every rank."""
    declared = schema.TABLES[table]
    data = pa.Table.from_pylist(rows, schema=declared.remove_metadata())
    metadata = {schema.SCHEMA_VERSION_KEY: b"2", schema.FSDPTRACE_VERSION_KEY: b"0.1.0"}
    for rank in range(2):
        folder = run / table / f"rank={rank}"
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(data.replace_schema_metadata(metadata),
                       folder / "part-j1_1-000001-000001.parquet")


def _table(table: str, **row: object) -> Mutation:
    """A schema-2 table of one row: plausible values, ``row`` overriding some."""
    plausible: dict[str, dict[str, object]] = {
        "backward_grads": {"seq": 5, "t_ns": 5, "step": 0, "micro_step": 0, "unit": "layers.0",
                           "param": "weight", "state": schema.GRAD_STATES[0],
                           "via": schema.GRAD_VIAS[0]},
        "grads_written": {"step": 0, "micro_step": 0, "unit": "layers.0", "param": "weight",
                          "written": True},
        "eval_forwards": {"seq": 5, "t_ns": 5, "step": 0, "unit": "layers.0",
                          "grad_mode": schema.GRAD_MODES[0]},
        "settings": {"step": 0, "micro_step": 0, "unit": "layers.0",
                     "setting": schema.SETTING_NAMES[0], "value": "true"},
    }

    def mutate(run: Path, rng: random.Random) -> None:
        add_table(run, table, [plausible[table] | row])

    return mutate


def _many_partitions(count: int) -> Mutation:
    """``count`` extra rank partitions of ``events``, each a copy of rank 1's."""
    def mutate(run: Path, rng: random.Random) -> None:
        source = parts(run, "events", 1)[0]
        for rank in range(2, 2 + count):
            folder = run / "events" / f"rank={rank}"
            folder.mkdir()
            os.link(source, folder / source.name)

    return mutate


def _many_parts(count: int) -> Mutation:
    """Rank 0's ``events`` as ``count`` part files of a row or two each."""
    def mutate(run: Path, rng: random.Random) -> None:
        source = parts(run, "events", 0)[0]
        table = pq.read_table(source)
        source.unlink()
        for index in range(count):
            one = table.slice(index * table.num_rows // count, 1)
            pq.write_table(one, source.parent / f"part-w1-1-{index:06d}.parquet")

    return mutate


# Thousands of partitions or part files: listed and opened in time proportional to their
# number, but each rank still costs milliseconds per table (profiled: empty-table concat,
# path handling), so 5,000 ranks take tens of CPU seconds; measured by ``main``, not yet a test.
MANY_CASES: dict[str, tuple[str, Mutation]] = {
    "many:rank-partitions-5000": (BASE, _many_partitions(5000)),
    "many:part-files-5000": (BASE, _many_parts(5000)),
}

SCHEMA_2_CASES: dict[str, tuple[str, Mutation]] = {
    "allgathers:null-num_bytes": (BASE, _cell("allgathers", "num_bytes", None)),
    "allgathers:negative-num_bytes": (BASE, _cell("allgathers", "num_bytes", -5)),
    "allgathers:huge-num_bytes": (BASE, _cell("allgathers", "num_bytes", 2**62)),
    "allgathers:null-group": (BASE, _cell("allgathers", "group", None)),
    "allgathers:negative-group": (BASE, _cell("allgathers", "group", -3)),
    "allgathers:unknown-event": (BASE, _cell("allgathers", "event", "teleported")),
    "allgathers:unknown-issuer_kind": (BASE, _cell("allgathers", "issuer_kind", "\x1b[2J")),
    "events:struct-unit": (BASE, _typed("events", "unit", "struct")),
    "events:list-unit": (BASE, _typed("events", "unit", "list")),
    "units:struct-unit": (BASE, _typed("units", "unit", "struct")),
    "units:list-unit": (BASE, _typed("units", "unit", "list")),
    "allgathers:struct-unit": (BASE, _typed("allgathers", "unit", "struct")),
    "events:no-rows": (BASE, _no_rows("events")),
    "units:no-rows": (BASE, _no_rows("units")),
    "meta:no-rows": (BASE, _no_rows("meta")),
    "markers:no-rows": (KILLED, _no_rows("markers")),
    "allgathers:no-rows": (BASE, _no_rows("allgathers")),
    "dir-is-file:events": (BASE, _dir_is_file("events")),
    "dir-is-file:units": (BASE, _dir_is_file("units")),
    "dir-is-file:meta": (BASE, _dir_is_file("meta")),
    "dir-is-file:allgathers": (BASE, _dir_is_file("allgathers")),
    "dir-is-file:settings": (BASE, _dir_is_file("settings")),
    "dir-is-file:journal": (BASE, _dir_is_file("journal")),
    "settings:unknown-setting": (BASE, _table("settings", setting="teleport")),
    "settings:null-unit": (BASE, _table("settings", unit=None)),
    "settings:negative-step": (BASE, _table("settings", step=-1)),
    "settings:long-value": (BASE, _table("settings", value="x" * 100_000)),
    "settings:not-json-value": (BASE, _table("settings", value="{nope")),
    "settings:ok": (BASE, _table("settings")),
    "backward_grads:unknown-state": (BASE, _table("backward_grads", state="\x1b]0;x\x07")),
    "backward_grads:null-param": (BASE, _table("backward_grads", param=None)),
    "backward_grads:huge-micro_step": (BASE, _table("backward_grads", micro_step=2**31 - 1)),
    "grads_written:null-written": (BASE, _table("grads_written", written=None)),
    "grads_written:unknown-unit": (BASE, _table("grads_written", unit="nobody")),
    "eval_forwards:unknown-grad_mode": (BASE, _table("eval_forwards", grad_mode="sideways")),
    "eval_forwards:negative-step": (BASE, _table("eval_forwards", step=-2)),
    "eval_forwards:huge-step": (BASE, _table("eval_forwards", step=2**31 - 1)),
    "eval_forwards:ok": (BASE, _table("eval_forwards")),
}


# ------------------------------------------------------------------ journal segments
SEGMENT_WRITER = "j7_7"  # a schema-2 writer id: no Parquet part of the samples covers it


def segment_bytes(table: str, rows: pa.Table) -> bytes:
    """``rows`` as one journal segment, laid out as ``fsdptrace.store.journal_format`` says (the
    recorder's own format: header, JSON vocabulary, then fixed slots or framed records)."""
    names = schema.TABLES[table].names
    if table in jf.FIXED_TABLES:
        coded = jf.dictionary_columns(table)
        vocab = {c: pa.compute.unique(rows.column(c).cast(pa.string())).to_pylist()
                 for c in coded}
        text = json.dumps(vocab).encode()
        offset = -(-(jf.HEADER.size + len(text)) // 8) * 8
        columns = {n: rows.column(n).cast(pa.string()).to_pylist() if n in coded
                   else rows.column(n).to_pylist() for n in names}
        for c in coded:
            columns[c] = [vocab[c].index(v) for v in columns[c]]
        fmt = struct.Struct(jf.fixed_format(table))
        body = b"".join(fmt.pack(*row, row[0]) for row in zip(*columns.values(), strict=True))
        header = jf.HEADER.pack(jf.MAGIC, jf.KIND_FIXED, fmt.size, offset, len(text))
        return header + text + b"\0" * (offset - len(header) - len(text)) + body
    payload = json.dumps([[row[n] for n in names] for row in rows.cast(
        schema.TABLES[table].remove_metadata()).to_pylist()]).encode()
    header = jf.HEADER.pack(jf.MAGIC, jf.KIND_FRAMED, 0, jf.HEADER.size, 0)
    return header + jf.FRAME.pack(len(payload)) + payload + jf.FRAME.pack(len(payload))


def move_tail_to_journal(run: Path, table: str, rank: int) -> Path:
    """The rows of the last step of one rank's ``table`` leave its Parquet part for a journal
    segment (what a rank killed with its writer leaves): the reader folds them back in."""
    path = parts(run, table, rank)[0]
    data = pq.read_table(path)
    step = np.asarray(data.column("step").to_numpy(zero_copy_only=False))
    tail = step == step.max()
    pq.write_table(data.filter(pa.array(~tail)), path)
    journal = run / jf.JOURNAL_DIR / f"rank={rank}"
    journal.mkdir(parents=True, exist_ok=True)
    segment = journal / jf.SEGMENT_FILE.format(table=table, writer=SEGMENT_WRITER, index=1)
    segment.write_bytes(segment_bytes(table, data.filter(pa.array(tail))))
    return segment


def _segment(change: Callable[[Path], None], table: str = "events") -> Mutation:
    def mutate(run: Path, rng: random.Random) -> None:
        change(move_tail_to_journal(run, table, rng.randrange(2)))

    return mutate


def _splice(at: int, data: bytes) -> Callable[[Path], None]:
    """Overwrite bytes from ``at`` (negative: from the end)."""
    def change(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        start = at % len(raw)
        raw[start:start + len(data)] = data
        path.write_bytes(bytes(raw))

    return change


def _sparse(size: int) -> Callable[[Path], None]:
    """The segment grows to ``size`` bytes of holes: gigabytes claimed in a few blocks."""
    def change(path: Path) -> None:
        os.truncate(path, size)

    return change


def _vocab(text: bytes) -> Callable[[Path], None]:
    """Another JSON vocabulary, the header pointing at it."""
    def change(path: Path) -> None:
        raw = path.read_bytes()
        magic, kind, size, offset, length = jf.HEADER.unpack_from(raw)
        body = raw[offset:]
        new_offset = -(-(jf.HEADER.size + len(text)) // 8) * 8
        header = jf.HEADER.pack(magic, kind, size, new_offset, len(text))
        path.write_bytes(header + text + b"\0" * (new_offset - len(header) - len(text)) + body)

    return change


def _frame(payload: bytes) -> Callable[[Path], None]:
    """A framed segment whose one record is ``payload``."""
    def change(path: Path) -> None:
        header = path.read_bytes()[:jf.HEADER.size]
        path.write_bytes(header + jf.FRAME.pack(len(payload)) + payload
                         + jf.FRAME.pack(len(payload)))

    return change


def _segment_symlink(target: str) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        path.unlink()
        path.symlink_to(target)

    return change


def _fixed_field(name: str, value: int) -> Callable[[Path], None]:
    """One field of the first slot of an ``events`` segment (the trailer kept valid)."""
    def change(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        offset = jf.HEADER.unpack_from(raw)[3]
        dtype = np.dtype([(f.name, "<i8" if f.type == pa.int64() else "<i4")
                          for f in schema.TABLES["events"]] + [("_trailer", "<i8")])
        slots = np.frombuffer(raw, dtype, (len(raw) - offset) // dtype.itemsize, offset).copy()
        slots[name][0] = value
        raw[offset:offset + slots.nbytes] = slots.tobytes()
        path.write_bytes(bytes(raw))

    return change


def _journal_folder_loop(run: Path, rng: random.Random) -> None:
    """A rank's journal folder that is a link to itself: neither a folder nor missing."""
    folder = run / jf.JOURNAL_DIR / f"rank={rng.randrange(2)}"
    folder.parent.mkdir(exist_ok=True)
    folder.symlink_to(folder)


def _deep_mark(run: Path, rng: random.Random) -> None:
    """A run mark of brackets nested too deep for ``json``, read when a rank's journal
    folder exists (its hot folder is named by the mark's launch id)."""
    (run / jf.JOURNAL_DIR / f"rank={rng.randrange(2)}").mkdir(parents=True)
    (run / RUN_MARK).write_text("[" * 4000)


# Hostile journal segments: every command reads what a rank left in its journal.
JOURNAL_CASES: dict[str, tuple[str, Mutation]] = {
    "journal:folder-symlink-loop": (BASE, _journal_folder_loop),
    "journal:mark-nested-deep": (BASE, _deep_mark),
    "seg:clean": (BASE, _segment(lambda p: None)),
    "seg:clean-markers": (BASE, _segment(lambda p: None, "markers")),
    "seg:sparse-3GB": (BASE, _segment(_sparse(3 << 30))),
    "seg:sparse-1GB-markers": (BASE, _segment(_sparse(1 << 30), "markers")),
    "seg:deep-vocab": (BASE, _segment(_vocab(b"[" * 1_000_000))),
    "seg:deep-frame": (BASE, _segment(_frame(b"[" * 1_000_000 + b"]" * 1_000_000),
                                      "markers")),
    "seg:vocab-list": (BASE, _segment(_vocab(b"[1, 2]"))),
    "seg:vocab-missing-column": (BASE, _segment(_vocab(b'{"phase": ["forward"]}'))),
    "seg:vocab-not-json": (BASE, _segment(_vocab(b"{not json"))),
    "seg:bad-magic": (BASE, _segment(_splice(0, b"NOTJOURN"))),
    "seg:header-only": (BASE, _segment(lambda p: p.write_bytes(p.read_bytes()[:10]))),
    "seg:offset-beyond": (BASE, _segment(_splice(16, struct.pack("<I", 1 << 30)))),
    "seg:vocab-length-4GB": (BASE, _segment(_splice(20, struct.pack("<I", 2**32 - 1)))),
    "seg:wrong-kind": (BASE, _segment(_splice(8, struct.pack("<I", 2)))),
    "seg:frame-not-json": (BASE, _segment(_frame(b"[[1, 2"), "markers")),
    "seg:frame-not-list": (BASE, _segment(_frame(b'{"a": 1}'), "markers")),
    "seg:frame-short-rows": (BASE, _segment(_frame(b"[[1, 2, 3]]"), "markers")),
    "seg:frame-wrong-types": (BASE, _segment(_frame(
        b'[["x", 1, 0, 0, "close", 0, ""]]'), "markers")),
    "seg:unit-code-out-of-range": (BASE, _segment(_fixed_field("unit", 10_000))),
    "seg:negative-step": (BASE, _segment(_fixed_field("step", -7))),
    "seg:huge-micro_step": (BASE, _segment(_fixed_field("micro_step", 2**31 - 1))),
    "seg:zeros": (BASE, _segment(lambda p: p.write_bytes(b"\0" * 4096))),
    "seg:symlink-passwd": (BASE, _segment(_segment_symlink("/etc/passwd"))),
    "seg:symlink-zero": (BASE, _segment(_segment_symlink("/dev/zero"))),
}

CASES.update(SCHEMA_2_CASES)
CASES.update(JOURNAL_CASES)


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


def run_commands(run: Path, scratch: Path, names: list[str] | None = None) -> list[Outcome]:
    """Every command (or those ``names``) on one run dir, in process, as a user's shell would
    see it."""
    from click.testing import CliRunner
    from fsdptrace_cli.main import cli

    outcomes = []
    for name in names or COMMANDS:
        args = [a.format(run=run, out=scratch) for a in COMMANDS[name]]
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


@functools.cache
def _warm_up() -> None:
    """Every command once on the pristine sample, in this process, before the first fork.

    What the commands import lazily (pandas, the analyzer, the renderers: ~440 modules) and
    the caches they fill are then inherited by every case's child instead of being built again
    in each (measured: 1.55 -> 1.40 CPU-s a case, 30 cases on the 2-core box).
    """
    with tempfile.TemporaryDirectory() as scratch:
        run_commands(SAMPLES / BASE, Path(scratch))


def run_isolated(run: Path, *, memory_bytes: int, timeout_s: int,
                 commands: list[str] | None = None) -> tuple[list[Outcome], int]:
    """``run_commands`` (every command, or ``commands``) in a forked child under an
    address-space limit and an alarm.

    ``memory_bytes`` is what the child may map beyond what this process has mapped, and the
    peak returned is how far the child's resident memory grew past where it started, in
    bytes: a test worker that ran torch jobs before holds address space and memory the case
    did not take. A child that dies (memory, time, a signal) is reported as one outcome with
    exit code -1.
    """
    _warm_up()
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "outcomes.json"
        started = Path(scratch) / "resident"
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0
            try:
                mapped, resident = _memory()
                started.write_text(str(resident))
                limit = mapped + memory_bytes
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
                signal.alarm(timeout_s)
                outcomes = run_commands(run, Path(scratch), commands)
                report.write_text(json.dumps([asdict(o) for o in outcomes]))
            except BaseException:
                report.write_text(json.dumps({"crash": traceback.format_exc()}))
                code = 3
            os._exit(code)
        _, status, usage = os.wait4(pid, 0)
        start = int(started.read_text()) if started.exists() else 0
        peak = max(0, usage.ru_maxrss * 1024 - start)
        data = json.loads(report.read_text()) if report.exists() else None
        if os.WIFSIGNALED(status) or not isinstance(data, list):
            why = (f"child died: signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                   else f"child failed: {data}")
            return [Outcome("all", -1, "", why, False, True, 0.0)], peak
        return [Outcome(**o) for o in data], peak


def _memory() -> tuple[int, int]:
    """This process's mapped and resident bytes (``/proc/self/statm``)."""
    size, resident = Path("/proc/self/statm").read_text().split()[:2]
    page = os.sysconf("SC_PAGE_SIZE")
    return int(size) * page, int(resident) * page


# ------------------------------------------------------------------ the whole corpus, counted
def bad_outcomes(outcomes: list[Outcome], *, limit_s: float) -> list[str]:
    """What is wrong with each command's outcome: an internal error, a traceback, a crash, more
    than one line (an unreadable-chunk warning aside), an escape on stdout, too slow."""
    bad = []
    for o in outcomes:
        lines = [line for line in o.stderr.splitlines()
                 if not line.startswith("fsdptrace: warning: skipping ")]
        why = ("internal error" if "internal error" in o.stderr else
               "traceback or crash" if o.traceback or o.exit_code not in (0, 1, 2) else
               "more than one line" if len(lines) > 1 else
               "escape on stdout" if o.stdout_has_escape else
               f"{o.seconds:.0f} s" if o.seconds > limit_s else "")
        if why:
            bad.append(f"{o.command}: {why}: {(lines or [''])[-1][:160]}")
    return bad


def main() -> int:
    """``python -m tests.hostile_corpus [NAME_PREFIX ...]``: every case (or those whose name
    starts with a prefix), every command, under a 2 GB address-space cap and 60 s per
    command; prints each bad run and the count."""
    import sys

    prefixes = sys.argv[1:] or [""]
    CASES.update(MANY_CASES)
    names = [n for n in CASES if any(n.startswith(p) for p in prefixes)]
    num_bad = num_runs = 0
    for name in names:
        with tempfile.TemporaryDirectory() as scratch:
            run = build(name, Path(scratch), seed=16)
            outcomes, peak = run_isolated(run, memory_bytes=2 << 30,
                                          timeout_s=60 * len(COMMANDS))
        bad = bad_outcomes(outcomes, limit_s=60)
        num_runs += len(COMMANDS)
        num_bad += len(COMMANDS) if outcomes[0].command == "all" else len(bad)
        for line in bad:
            print(f"BAD {name} / {line}", flush=True)
        print(f"{name}: {len(bad)} bad, peak {peak >> 20} MiB", flush=True)
    print(f"{num_bad} bad of {num_runs} runs ({len(names)} cases x {len(COMMANDS)} commands)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
