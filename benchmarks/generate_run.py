"""Synthetic run dirs of any size, in the real on-disk format, with known planted problems.

Real recordings (tests/test_analyzer_scenarios.py) prove the checks right on small runs; the
analyzer's scale needs runs of 10M+ events that no CPU test job can record in time. This
writes them directly: one file per table per rank, stamped with ``schema.with_metadata`` like
the recorder's, built with numpy (no Python loop over events), and it plants one of each
problem CHECKS.md describes at a known place, returning the exact findings expected.

Layout: ``stages`` pipeline stages with disjoint units (``layers.<stage*units+i>``), each
stage's ranks contiguous. A micro-step runs forward ``<root>, layers..., layers.first``
(a repeated call) then backward ``<root>, layers reversed``. ``adapter`` has parameters and
never runs; ``act`` has no parameters. Odd ranks store their dictionaries in reverse order so
that nothing may compare category codes across ranks.

    python benchmarks/generate_run.py OUT_DIR --events 10000000
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdptrace import schema
from fsdptrace.version import __version__

PLANTED_FILE = "planted.json"
Finding = tuple[str, int, int | None, int | None, str | None, str | None, str | None]


@dataclass(frozen=True)
class Shape:
    """How big a synthetic run is; ``num_events`` counts every rank's events."""

    ranks: int = 16
    steps: int = 8
    micro_steps: int = 4
    units: int = 48
    stages: int = 2

    @property
    def per_micro_step(self) -> int:
        return (self.units + 2) + (self.units + 1)

    @property
    def num_events(self) -> int:
        return self.ranks * self.steps * self.micro_steps * self.per_micro_step

    def validate(self) -> None:
        per_stage = self.ranks // self.stages
        if self.ranks % self.stages or per_stage < 3:
            raise ValueError(f"{self}: need ranks divisible by stages, >= 3 ranks per stage")
        if self.steps < 6 or self.micro_steps < 2 or self.units < 4:
            raise ValueError(f"{self}: need >= 6 steps, >= 2 micro-steps, >= 4 units")


def shape_for(num_events: int, **fixed: int) -> Shape:
    """The shape with ``fixed`` ranks/micro_steps/units/stages and enough steps for the events."""
    base = Shape(**fixed)
    per_step = base.ranks * base.micro_steps * base.per_micro_step
    return Shape(**{**asdict(base), "steps": max(6, math.ceil(num_events / per_step))})


@dataclass(frozen=True)
class Plan:
    """Where each problem is planted (ranks in stage 0 unless said otherwise)."""

    stalled: int = 0       # no close marker; stops in the last step
    bypassed: int = 1      # adapter holds gradients at step ``bypass_step``
    swapped: int = 1       # forward order of layers.1 and layers.2 swapped at ``swap_step``
    config: int = 2        # layers.0 prefetches layers.2 instead of layers.1
    pending: int = 2       # an all-gather still held at step ``pending_step``
    wrong_edge_step: int = 1   # every stage-0 rank adds layers.2 -> layers.1 for one step
    bypass_step: int = 2
    pending_step: int = 2
    swap_step: int = 3
    change_step: int = 4   # every stage-0 rank changes its forward order at micro-step 1
    stall_micro: int = 1
    stall_position: int = 2


def plan_for(shape: Shape) -> Plan:
    s = shape.steps
    return Plan(wrong_edge_step=s // 6, bypass_step=2 * s // 6, pending_step=2 * s // 6,
                swap_step=3 * s // 6, change_step=4 * s // 6)


def _names(shape: Shape, stage: int) -> list[str]:
    first = stage * shape.units
    return (["<root>"] + [f"layers.{first + i}" for i in range(shape.units)]
            + ["adapter", "act"])


def _stage(shape: Shape, rank: int) -> int:
    return rank // (shape.ranks // shape.stages)


def _dictionary(names: list[str], rank: int) -> tuple[pa.Array, np.ndarray]:
    """The rank's dictionary and, per canonical index, its code in that dictionary."""
    order = np.arange(len(names))[::-1] if rank % 2 else np.arange(len(names))
    codes = np.empty(len(names), dtype=np.int32)
    codes[order] = np.arange(len(names), dtype=np.int32)
    return pa.array([names[i] for i in order]), codes


def _dict_column(canonical: np.ndarray, dictionary: pa.Array, codes: np.ndarray
                 ) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(codes[canonical]), dictionary)


def _template(shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """Canonical unit indices and phase indices (0 forward) of one micro-step."""
    layers = np.arange(1, shape.units + 1)
    forward = np.concatenate([[0], layers, [1]])
    backward = np.concatenate([[0], layers[::-1]])
    phases = np.repeat([0, 1], [len(forward), len(backward)])
    return np.concatenate([forward, backward]).astype(np.int64), phases


def _events(shape: Shape, plan: Plan, rank: int) -> tuple[pa.Table, int, int]:
    """Events of one rank; also the number of complete steps and the last seq used."""
    units, phases = _template(shape)
    per = shape.per_micro_step
    total = shape.steps * shape.micro_steps
    unit = np.tile(units, total)
    stage0 = _stage(shape, rank) == 0

    def swap(step: int, micro: int, a: int, b: int) -> None:
        base = (step * shape.micro_steps + micro) * per
        unit[[base + a, base + b]] = unit[[base + b, base + a]]

    if rank == plan.swapped:
        for micro in range(shape.micro_steps):
            swap(plan.swap_step, micro, 2, 3)  # positions of layers.1, layers.2
    if stage0:
        b = shape.units - 3  # layers.b at position b+1
        swap(plan.change_step, 1, b + 1, b + 2)
    index = np.arange(total * per)
    micro_index, within = np.divmod(index, per)
    step, micro = np.divmod(micro_index, shape.micro_steps)
    step_slots = shape.micro_steps * (per + 1) + 1
    seq = step * step_slots + micro * (per + 1) + within + 2
    count = len(index)
    if rank == plan.stalled:
        count = ((shape.steps - 1) * shape.micro_steps + plan.stall_micro) * per
        count += plan.stall_position + 1
    names = _names(shape, _stage(shape, rank))
    dictionary, codes = _dictionary(names, rank)
    phase_dict, phase_codes = _dictionary(list(schema.PHASES), rank)
    table = pa.table({
        "seq": pa.array(seq[:count]),
        "t_ns": pa.array(seq[:count] * 1000),
        "step": pa.array(step[:count].astype(np.int32)),
        "micro_step": pa.array(micro[:count].astype(np.int32)),
        "phase": _dict_column(phases[np.tile(np.arange(per), total)][:count], phase_dict,
                              phase_codes),
        "unit": _dict_column(unit[:count], dictionary, codes),
    }, schema=schema.EVENTS)
    complete = shape.steps - 1 if rank == plan.stalled else shape.steps
    return table, complete, int(seq[count - 1])


def _markers(shape: Shape, plan: Plan, rank: int, complete: int, last_seq: int) -> pa.Table:
    per = shape.per_micro_step
    step_slots = shape.micro_steps * (per + 1) + 1
    micro_total = complete * shape.micro_steps
    if rank == plan.stalled:
        micro_total += plan.stall_micro + 1
    micro_index = np.arange(micro_total)
    step, micro = np.divmod(micro_index, shape.micro_steps)
    begin_seq = step * step_slots + micro * (per + 1) + 1
    opt_steps = np.arange(complete)
    opt_seq = (opt_steps + 1) * step_slots
    kinds = ([schema.MARKER_MICRO_STEP] * micro_total + [schema.MARKER_OPTIMIZER_STEP] * complete)
    seqs = np.concatenate([begin_seq, opt_seq])
    steps = np.concatenate([step, opt_steps])
    micros = np.concatenate([micro, np.full(complete, shape.micro_steps - 1)])
    if rank != plan.stalled:
        kinds.append(schema.MARKER_CLOSE)
        seqs = np.append(seqs, last_seq + 2)
        steps = np.append(steps, shape.steps - 1)
        micros = np.append(micros, shape.micro_steps - 1)
    order = np.argsort(seqs, kind="stable")
    return pa.table({
        "seq": pa.array(seqs[order]), "t_ns": pa.array(seqs[order] * 1000),
        "step": pa.array(steps[order].astype(np.int32)),
        "micro_step": pa.array(micros[order].astype(np.int32)),
        "kind": pa.array([kinds[i] for i in order]).dictionary_encode(),
        "count": pa.array(np.zeros(len(order), dtype=np.int64)),
        "detail": pa.array([""] * len(order)),
    }, schema=schema.MARKERS)


def _snapshot(shape: Shape, plan: Plan, rank: int, step: int, wrong_edge: bool) -> list[tuple]:
    names = _names(shape, _stage(shape, rank))
    layers, u = names[1:-2], shape.units
    forward = {names[0]: [layers[0]], **{layers[i]: [layers[i + 1]] for i in range(u - 1)}}
    backward = {names[0]: [layers[-1]], **{layers[i]: [layers[i - 1]] for i in range(1, u)}}
    if rank == plan.config:
        forward[layers[0]] = [layers[2]]
    if wrong_edge:
        forward[layers[2]] = [layers[3], layers[1]]
    rows = []
    for phase, edges in ((schema.FORWARD, forward), (schema.BACKWARD, backward)):
        for name in names:
            targets = edges.get(name) or [None]
            rows += [(step, 0, name, phase, t, i) for i, t in enumerate(targets)]
    return rows


def _prefetch(shape: Shape, plan: Plan, rank: int) -> pa.Table:
    rows = _snapshot(shape, plan, rank, 0, False)
    if _stage(shape, rank) == 0:
        rows += _snapshot(shape, plan, rank, plan.wrong_edge_step, True)
        rows += _snapshot(shape, plan, rank, plan.wrong_edge_step + 1, False)
    columns = list(zip(*rows, strict=True))
    return pa.table(dict(zip(schema.PREFETCH.names, columns, strict=True)), schema=schema.PREFETCH)


def _gradients(shape: Shape, plan: Plan, rank: int, complete: int) -> pa.Table:
    names = _names(shape, _stage(shape, rank))
    params = ([("<root>", "embed.weight")]
              + [(n, f"{n}.{p}") for n in names[1:-2] for p in ("weight", "bias")]
              + [("adapter", "adapter.weight")])
    unit_names, param_names = (np.array(c) for c in zip(*params, strict=True))
    has_grad = np.tile(unit_names != "adapter", complete)
    if rank == plan.bypassed:
        has_grad[plan.bypass_step * len(params) + len(params) - 1] = True
    return pa.table({
        "step": pa.array(np.repeat(np.arange(complete, dtype=np.int32), len(params))),
        "micro_step": pa.array(np.full(complete * len(params), shape.micro_steps - 1,
                                       dtype=np.int32)),
        "unit": pa.array(np.tile(unit_names, complete)).dictionary_encode(),
        "param": pa.array(np.tile(param_names, complete)),
        "has_grad": pa.array(has_grad),
        "grad_source": pa.array(np.where(has_grad, "sharded", "none")).dictionary_encode(),
    }, schema=schema.GRADIENTS)


def _pending(shape: Shape, plan: Plan, rank: int) -> pa.Table:
    if rank != plan.pending:
        return schema.PENDING.empty_table()
    row = {"step": [plan.pending_step], "micro_step": [shape.micro_steps - 1],
           "unit": ["layers.1"], "kind": ["all_gather_result"], "bucket": ["bucket0"],
           "state": ["completed, not consumed"]}
    return pa.table(row, schema=schema.PENDING)


def _units(shape: Shape, rank: int) -> pa.Table:
    names = _names(shape, _stage(shape, rank))
    num_params = [1] + [2] * shape.units + [1, 0]
    params = ([["embed.weight"]] + [[f"{n}.weight", f"{n}.bias"] for n in names[1:-2]]
              + [["adapter.weight"], []])
    return pa.table({
        "unit": names, "part": [0] * len(names),
        "fqn": [""] + names[1:], "module_type": ["Model"] + ["Block"] * shape.units
        + ["Adapter", "Act"],
        "is_root": [True] + [False] * (len(names) - 1), "num_params": num_params,
        "num_param_elements": [1024 * n for n in num_params], "param_names": params,
    }, schema=schema.UNITS)


def _meta(shape: Shape, rank: int) -> pa.Table:
    row = {"world_size": [shape.ranks], "host": [f"node{rank // 8}"], "pid": [1000 + rank],
           "backend": ["fsdp2"], "torch_version": ["synthetic"],
           "fsdptrace_version": [__version__], "schema_version": [schema.SCHEMA_VERSION],
           "wall_anchor_ns": [0], "mono_anchor_ns": [0], "num_parts": [1],
           "steps_spec": ["all"], "raise_on_violation": [False]}
    return pa.table(row, schema=schema.META)


def rank_tables(shape: Shape, plan: Plan, rank: int) -> dict[str, pa.Table]:
    """Every table of one rank, in the declared schemas."""
    events, complete, last_seq = _events(shape, plan, rank)
    return {
        "meta": _meta(shape, rank), "units": _units(shape, rank), "events": events,
        "markers": _markers(shape, plan, rank, complete, last_seq),
        "prefetch": _prefetch(shape, plan, rank),
        "gradients": _gradients(shape, plan, rank, complete),
        "pending": _pending(shape, plan, rank),
    }


def write_rank(run_dir: Path, rank: int, tables: dict[str, pa.Table]) -> None:
    """One file per table, as one recorder writer with one chunk would leave it."""
    for name, table in tables.items():
        directory = run_dir / schema.TABLE_DIR.format(table=name) / schema.RANK_DIR.format(
            rank=rank)
        directory.mkdir(parents=True, exist_ok=True)
        stamped = table.cast(schema.with_metadata(table.schema, rank=rank, version=__version__))
        pq.write_table(stamped, directory / schema.PART_FILE.format(writer=0, chunk=0),
                       compression="zstd")


def expected_findings(shape: Shape, plan: Plan) -> set[Finding]:
    """Exactly what ``fsdptrace.analyze`` must report: (check, rank, step, micro, phase, unit,
    target)."""
    stage0 = range(shape.ranks // shape.stages)
    micros = range(shape.micro_steps)
    last_micro = shape.micro_steps - 1
    b = shape.units - 3
    out: set[Finding] = set()
    for r in stage0:
        out |= {("prefetch-order", r, plan.wrong_edge_step, m, "forward", "layers.2", "layers.1")
                for m in micros}
        out.add(("prefetch-order", r, plan.change_step, 1, "forward", f"layers.{b}",
                 f"layers.{b + 1}"))
        out.add(("order-instability", r, plan.change_step, 1, "forward", f"layers.{b + 1}",
                 f"layers.{b}"))
    for m in micros:
        s, r = plan.swap_step, plan.swapped
        out |= {("rank-divergence", r, s, m, "forward", "layers.2", "layers.1"),
                ("order-instability", r, s, m, "forward", "layers.2", "layers.1"),
                ("prefetch-order", r, s, m, "forward", "layers.1", "layers.2")}
    out.add(("bypassed-unit", plan.bypassed, plan.bypass_step, last_micro, None, "adapter", None))
    out.add(("pending-all-gather", plan.pending, plan.pending_step, last_micro, None, "layers.1",
             "bucket0"))
    out |= {("prefetch-config-divergence", plan.config, s, 0, None, None, None)
            for s in (0, plan.wrong_edge_step)}
    out.add(("stalled-rank", plan.stalled, shape.steps - 1, plan.stall_micro, "forward",
             "layers.1", None))
    out.add(("stalled-rank", missing_rank(shape), None, None, None, None, None))
    return out


def missing_rank(shape: Shape) -> int:
    return shape.ranks - 1


def generate(run_dir: str | Path, shape: Shape) -> set[Finding]:
    """Write a synthetic run dir (all ranks but the missing one) and its expected findings."""
    shape.validate()
    plan = plan_for(shape)
    path = Path(run_dir)
    for rank in range(shape.ranks):
        if rank != missing_rank(shape):
            write_rank(path, rank, rank_tables(shape, plan, rank))
    expected = expected_findings(shape, plan)
    manifest = {"shape": asdict(shape), "plan": asdict(plan),
                "expected": sorted(expected, key=repr)}
    (path / PLANTED_FILE).write_text(json.dumps(manifest, indent=1))
    return expected


def read_expected(run_dir: str | Path) -> set[Finding]:
    """The findings a generated run dir was planted with."""
    manifest = json.loads((Path(run_dir) / PLANTED_FILE).read_text())
    return {tuple(row) for row in manifest["expected"]}  # type: ignore[misc]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--events", type=int, default=1_000_000, help="total events, approx.")
    for name, default in (("ranks", 16), ("micro-steps", 4), ("units", 48), ("stages", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    shape = shape_for(args.events, ranks=args.ranks, micro_steps=args.micro_steps,
                      units=args.units, stages=args.stages)
    start = time.perf_counter()
    expected = generate(args.run_dir, shape)
    print(f"{args.run_dir}: {shape} -> {shape.num_events:,} events, {len(expected)} planted "
          f"findings, {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
