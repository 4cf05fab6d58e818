"""Synthetic run dirs of any size, in the recorder's on-disk format, with known planted problems.

Real recordings (tests/test_analyzer_scenarios.py) prove the checks right on small runs; the
analyzer's scale needs runs of 10,000 ranks or 10M+ events that no CPU test job can record in
time. This writes them directly, built with numpy (no Python loop over events): every table
the recorder writes, compacted parts named by journal segment range like the writer process's
(``_run_files``), and dead ranks (a lost node: training and writer process killed together)
whose rows are Parquet parts of full segments plus the journal tail, written by the
recorder's own journal code. It plants one problem of most checks at a known place and
returns the exact findings expected (``planted.json``).

Layout: ``stages`` pipeline stages with disjoint units (``layers.<stage*units+i>``), each
stage's ranks contiguous. A micro-step runs forward ``<root>, layers..., layers.first``
(a repeated call) then backward ``<root>, layers reversed``. ``adapter`` has parameters and
never runs; ``act`` has no parameters. Odd ranks store their dictionaries in reverse order so
that nothing may compare category codes across ranks.

    python benchmarks/generate_run.py OUT_DIR --events 10000000
    python benchmarks/generate_run.py OUT_DIR --ranks 10240 --events 6144000 --jobs 2
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import _run_files
import _run_tables
import numpy as np
import pyarrow as pa

from fsdptrace.store import run_mark, schema

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
    # Killed with their node in the last step (stage 1): no close, rows in the journal tail.
    dead: tuple[int, ...] = field(default=())
    dead_micro: int = 1
    dead_position: int = 4


def plan_for(shape: Shape) -> Plan:
    s = shape.steps
    per_stage = shape.ranks // shape.stages
    # Up to a node of 8 ranks, the first of stage 1, never the last rank (missing on disk).
    num_dead = max(1, min(8, (per_stage - 1) // 2))
    dead = tuple(r for r in range(per_stage, per_stage + num_dead) if r < missing_rank(shape))
    return Plan(wrong_edge_step=s // 6, bypass_step=2 * s // 6, pending_step=2 * s // 6,
                swap_step=3 * s // 6, change_step=4 * s // 6, dead=dead)


def _layout(shape: Shape, plan: Plan, rank: int) -> _run_tables.RankLayout:
    per = shape.per_micro_step
    stop = None
    if rank == plan.stalled or rank in plan.dead:
        micro, position = ((plan.stall_micro, plan.stall_position) if rank == plan.stalled
                           else (plan.dead_micro, plan.dead_position))
        stop = ((shape.steps - 1) * shape.micro_steps + micro) * per + position + 1
    return _run_tables.RankLayout(
        micro_steps=shape.micro_steps, units=shape.units, steps=shape.steps,
        stage=_stage(shape, rank), world_size=shape.ranks, stop=stop,
        complete=shape.steps - (stop is not None))


def _stage(shape: Shape, rank: int) -> int:
    return rank // (shape.ranks // shape.stages)


def _unit_order(shape: Shape, plan: Plan, rank: int) -> np.ndarray:
    """Canonical unit per entry of the whole run, with the planted order changes."""
    units, _ = _run_tables.template(shape.units)
    per = shape.per_micro_step
    unit = np.tile(units, shape.steps * shape.micro_steps)

    def swap(step: int, micro: int, a: int, b: int) -> None:
        base = (step * shape.micro_steps + micro) * per
        unit[[base + a, base + b]] = unit[[base + b, base + a]]

    if rank == plan.swapped:
        for micro in range(shape.micro_steps):
            swap(plan.swap_step, micro, 2, 3)  # positions of layers.1, layers.2
    if _stage(shape, rank) == 0:
        b = shape.units - 3  # layers.b at position b+1
        swap(plan.change_step, 1, b + 1, b + 2)
    return unit


def _markers(layout: _run_tables.RankLayout, entries: _run_tables.Entries) -> pa.Table:
    """Micro-step begins, optimizer steps and, for a rank that closed, the close marker."""
    per = _run_tables.slots_per_micro(layout.units)
    slots = _run_tables.step_slots(layout)
    began = np.unique(entries.step * layout.micro_steps + entries.micro)
    step, micro = np.divmod(began, layout.micro_steps)
    begin_slot = step * slots + micro * (per + 1) + 1
    opt_steps = np.arange(layout.complete)
    kinds = ([schema.MARKER_MICRO_STEP] * len(began)
             + [schema.MARKER_OPTIMIZER_STEP] * layout.complete)
    seqs = np.concatenate([begin_slot, (opt_steps + 1) * slots])
    steps = np.concatenate([step, opt_steps])
    micros = np.concatenate([micro, np.full(layout.complete, layout.micro_steps - 1)])
    if layout.stop is None:
        kinds.append(schema.MARKER_CLOSE)
        seqs = np.append(seqs, entries.slot[-1] + 2)
        steps = np.append(steps, layout.steps - 1)
        micros = np.append(micros, layout.micro_steps - 1)
    order = np.argsort(seqs, kind="stable")
    seq = seqs[order] * _run_tables.SEQ_SCALE
    return pa.table({
        "seq": pa.array(seq), "t_ns": pa.array(seq * 125),
        "step": pa.array(steps[order].astype(np.int32)),
        "micro_step": pa.array(micros[order].astype(np.int32)),
        "kind": pa.array([kinds[i] for i in order], pa.string()).dictionary_encode(),
        "count": pa.array(np.zeros(len(order), dtype=np.int64)),
        "detail": pa.array([""] * len(order), pa.string()),
    }, schema=schema.MARKERS)


def _snapshot(shape: Shape, plan: Plan, rank: int, step: int, wrong_edge: bool) -> list[tuple]:
    names = _run_tables.names(shape.units, _stage(shape, rank))
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
            targets = edges.get(name)
            if targets is None:  # no targets: one row with a null target, as recorded
                rows.append((step, 0, name, phase, None, None))
            rows += [(step, 0, name, phase, t, i) for i, t in enumerate(targets or ())]
    return rows


def _prefetch(shape: Shape, plan: Plan, rank: int) -> pa.Table:
    rows = _snapshot(shape, plan, rank, 0, False)
    if _stage(shape, rank) == 0:
        rows += _snapshot(shape, plan, rank, plan.wrong_edge_step, True)
        rows += _snapshot(shape, plan, rank, plan.wrong_edge_step + 1, False)
    columns = list(zip(*rows, strict=True))
    return pa.table(dict(zip(schema.PREFETCH.names, columns, strict=True)), schema=schema.PREFETCH)


def _has_grad(shape: Shape, plan: Plan, rank: int, complete: int) -> np.ndarray:
    params = _run_tables.params(shape.units, _stage(shape, rank))
    has_grad = np.tile(np.array([u != "adapter" for u, _ in params]), complete)
    if rank == plan.bypassed:
        has_grad[plan.bypass_step * len(params) + len(params) - 1] = True
    return has_grad


def _pending(shape: Shape, plan: Plan, rank: int) -> pa.Table:
    if rank != plan.pending:
        return schema.PENDING.empty_table()
    row = {"step": [plan.pending_step], "micro_step": [shape.micro_steps - 1],
           "unit": ["layers.1"], "kind": ["all_gather_result"], "bucket": ["bucket0"],
           "state": ["completed, not consumed"]}
    return pa.table(row, schema=schema.PENDING)


def rank_tables(shape: Shape, plan: Plan, rank: int) -> dict[str, pa.Table]:
    """Every table of one rank, in the declared schemas."""
    planted = {plan.stalled, plan.bypassed, plan.swapped, plan.config, plan.pending, *plan.dead}
    if rank in planted:
        tables = _tables(shape, plan, rank)
    else:  # the same rows as the stage's other ranks with its dictionary order: built once
        tables = _ordinary_tables(shape, plan, _stage(shape, rank), rank % 2)
    return {**tables, "meta": _run_tables.meta(_layout(shape, plan, rank), rank)}


@functools.lru_cache(maxsize=8)
def _ordinary_tables(shape: Shape, plan: Plan, stage: int, parity: int) -> dict[str, pa.Table]:
    planted = {plan.stalled, plan.bypassed, plan.swapped, plan.config, plan.pending, *plan.dead}
    rank = next(r for r in range(stage * shape.ranks // shape.stages, shape.ranks)
                if r % 2 == parity and r not in planted)
    return _tables(shape, plan, rank)


def _tables(shape: Shape, plan: Plan, rank: int) -> dict[str, pa.Table]:
    layout = _layout(shape, plan, rank)
    entries = _run_tables.entries(layout, _unit_order(shape, plan, rank))
    gradients, written = _run_tables.boundary(layout, _has_grad(shape, plan, rank,
                                                                layout.complete))
    return {
        "meta": _run_tables.meta(layout, rank), "units": _run_tables.units_table(layout),
        "events": _run_tables.events(entries, layout, rank),
        "markers": _markers(layout, entries),
        "prefetch": _prefetch(shape, plan, rank),
        "gradients": gradients, "grads_written": written,
        "pending": _pending(shape, plan, rank),
        "allgathers": _run_tables.allgathers(entries, layout, rank),
        "backward_grads": _run_tables.backward_grads(entries, layout, rank),
        "settings": _run_tables.settings(layout),
    }


def write_rank(run_dir: Path, shape: Shape, plan: Plan, rank: int, *,
               segment_bytes: tuple[int, int] | None = None) -> None:
    """One rank as the recorder leaves it: compacted parts, or a dead rank's journal tail."""
    tables = rank_tables(shape, plan, rank)
    writer = _run_tables.writer_id(rank)
    if rank in plan.dead:
        kwargs = {"segment_bytes": segment_bytes} if segment_bytes else {}
        _run_files.write_dead(run_dir, rank, writer, tables, **kwargs)
    else:
        _run_files.write_closed(run_dir, rank, writer, tables)


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
    out |= {("stalled-rank", r, shape.steps - 1, plan.dead_micro, "forward",
             _run_tables.names(shape.units, _stage(shape, r))[plan.dead_position], None)
            for r in plan.dead}
    out.add(("stalled-rank", missing_rank(shape), None, None, None, None, None))
    return out


def missing_rank(shape: Shape) -> int:
    return shape.ranks - 1


def generate(run_dir: str | Path, shape: Shape, *, jobs: int = 1,
             segment_bytes: tuple[int, int] | None = None) -> set[Finding]:
    """Write a synthetic run dir (all ranks but the missing one) and its expected findings.

    ``segment_bytes``: the dead ranks' journal segment sizes (first, largest), the recorder's
    unless given; tests make them small so that a tail spans parts and segments.
    """
    shape.validate()
    plan = plan_for(shape)
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    run_mark.mark_run_dir(path)  # as a recording's writer does: readers name hot folders by it
    ranks = [r for r in range(shape.ranks) if r != missing_rank(shape)]
    write = partial(_write, path, shape, plan, segment_bytes)
    if jobs > 1:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            pool.map(write, ranks, chunksize=max(1, len(ranks) // (8 * jobs)))
    else:
        for rank in ranks:
            write(rank)
    expected = expected_findings(shape, plan)
    manifest = {"shape": asdict(shape), "plan": asdict(plan),
                "expected": sorted(expected, key=repr)}
    (path / PLANTED_FILE).write_text(json.dumps(manifest, indent=1))
    return expected


def _write(run_dir: Path, shape: Shape, plan: Plan, segment_bytes: tuple[int, int] | None,
           rank: int) -> None:
    write_rank(run_dir, shape, plan, rank, segment_bytes=segment_bytes)


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
    parser.add_argument("--jobs", type=int, default=1, help="processes writing ranks")
    args = parser.parse_args(argv)
    shape = shape_for(args.events, ranks=args.ranks, micro_steps=args.micro_steps,
                      units=args.units, stages=args.stages)
    start = time.perf_counter()
    expected = generate(args.run_dir, shape, jobs=args.jobs)
    print(f"{args.run_dir}: {shape} -> {shape.num_events:,} events, {len(expected)} planted "
          f"findings, {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
