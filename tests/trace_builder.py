"""Build in-memory ``fsdptrace.Trace`` objects row by row, without a job or a disk.

The frames come out exactly as ``fsdptrace.load`` produces them: the declared Arrow schema of
``fsdptrace.store.schema`` (dictionary columns become categoricals) plus an int32 ``rank`` column.
``clean_run`` lays down what a healthy FSDP2 job records; tests then plant one problem at a
time by editing the builder before ``build()``.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from fsdptrace.reading.trace import TABLE_NAMES, Trace
from fsdptrace.store import schema

ROOT = "<root>"


class TraceBuilder:
    """Rows of every table, per rank; ``seq`` is numbered per rank as the recorder does."""

    def __init__(self, *, world_size: int) -> None:
        self.world_size = world_size
        self.rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._seq: dict[int, int] = defaultdict(int)

    def _next(self, rank: int) -> int:
        self._seq[rank] += 1
        return self._seq[rank]

    def meta(self, rank: int) -> None:
        self.rows["meta"].append(
            dict(
                rank=rank,
                world_size=self.world_size,
                host="builder",
                pid=1000 + rank,
                backend="fsdp2",
                torch_version="0",
                fsdptrace_version="0",
                schema_version=schema.SCHEMA_VERSION,
                wall_anchor_ns=0,
                mono_anchor_ns=0,
                num_parts=1,
                steps_spec="",
                raise_on_violation=False,
            )
        )

    def unit(
        self, rank: int, name: str, *, is_root: bool = False, params: tuple[str, ...] = ("weight",),
        param_names: list[str] | None = None,
    ) -> None:
        """A unit whose parameters are ``<name>.<p>`` for each of ``params``, or
        ``param_names`` as given (a unit holding another module's parameters)."""
        names = param_names if param_names is not None else [f"{name}.{p}" for p in params]
        self.rows["units"].append(
            dict(
                rank=rank,
                unit=name,
                part=0,
                fqn="" if is_root else name,
                module_type="Linear",
                is_root=is_root,
                num_params=len(names),
                num_param_elements=4 * len(names),
                param_names=names,
            )
        )

    def run(self, rank: int, step: int, micro_step: int, phase: str, order: list[str]) -> None:
        for name in order:
            self.rows["events"].append(
                dict(self._stamp(rank, step, micro_step), phase=phase, unit=name)
            )

    def marker(
        self, rank: int, step: int, micro_step: int, kind: str, *, count: int = 0, detail: str = ""
    ) -> None:
        self.rows["markers"].append(
            dict(self._stamp(rank, step, micro_step), kind=kind, count=count, detail=detail)
        )

    def _stamp(self, rank: int, step: int, micro_step: int) -> dict:
        """Where and when a row happened: the next seq of the rank, a clock derived from it."""
        seq = self._next(rank)
        return dict(rank=rank, seq=seq, t_ns=seq * 1000, step=step, micro_step=micro_step)

    def edges(
        self,
        rank: int,
        step: int,
        micro_step: int,
        targets: dict[tuple[str, str], list[str]],
        units: list[str],
    ) -> None:
        """One complete snapshot: every unit and phase, a null target when it has none."""
        for name in units:
            for phase in schema.PHASES:
                wanted = targets.get((name, phase), [])
                for index, target in enumerate(wanted or [None]):
                    self.rows["prefetch"].append(
                        dict(
                            rank=rank,
                            step=step,
                            micro_step=micro_step,
                            unit=name,
                            phase=phase,
                            target=target,
                            target_index=index if target is not None else None,
                        )
                    )

    def gradient(
        self, rank: int, step: int, micro_step: int, unit: str, param: str, *, has_grad: bool = True
    ) -> None:
        self.rows["gradients"].append(
            dict(
                rank=rank,
                step=step,
                micro_step=micro_step,
                unit=unit,
                param=param,
                has_grad=has_grad,
                grad_source="grad",
            )
        )

    def written(self, rank: int, step: int, unit: str, param: str, *, written: bool) -> None:
        """A ``grads_written`` row: was the gradient held at the boundary written in the step."""
        self.rows["grads_written"].append(dict(rank=rank, step=step, micro_step=0, unit=unit,
                                               param=param, written=written))

    def backward_grad(self, rank: int, step: int, micro_step: int, unit: str, param: str,
                      state: str, *, via: str = "backward") -> None:
        self.rows["backward_grads"].append(dict(
            rank=rank, seq=self._next(rank), t_ns=0, step=step, micro_step=micro_step,
            unit=unit, param=param, state=state, via=via))

    def eval_forward(self, rank: int, step: int, unit: str) -> None:
        """A unit forward without gradients in eval interval ``step``."""
        self.rows["eval_forwards"].append(dict(rank=rank, seq=self._next(rank), t_ns=0,
                                               step=step, unit=unit, grad_mode="no_grad"))

    def setting(self, rank: int, step: int, micro_step: int, unit: str, setting: str,
                value: str | None) -> None:
        self.rows["settings"].append(dict(rank=rank, step=step, micro_step=micro_step,
                                          unit=unit, setting=setting, value=value))

    def pending(
        self,
        rank: int,
        step: int,
        micro_step: int,
        unit: str,
        *,
        bucket: str = "bucket0",
        state: str = "handle set",
    ) -> None:
        self.rows["pending"].append(
            dict(
                rank=rank,
                step=step,
                micro_step=micro_step,
                unit=unit,
                kind="all_gather",
                bucket=bucket,
                state=state,
            )
        )

    def build(self, run_dir: str = "<in-memory>") -> Trace:
        frames = {name: self._frame(name) for name in TABLE_NAMES}
        return Trace(run_dir=Path(run_dir), **frames)

    def _frame(self, name: str) -> pd.DataFrame:
        table_schema = schema.TABLES[name].remove_metadata()
        full = pa.schema([pa.field("rank", pa.int32()), *table_schema])
        rows = self.rows.get(name, [])
        columns = {f.name: [row.get(f.name) for row in rows] for f in full}
        frame = pa.Table.from_pydict(columns, schema=full).to_pandas()
        frame["rank"] = frame["rank"].astype("int32")
        return frame


def clean_run(
    units: list[str],
    *,
    world_size: int,
    steps: int,
    micro_steps: int,
    prefetch: bool = True,
    orders: dict[int, list[str]] | None = None,
    closed: set[int] | None = None,
) -> TraceBuilder:
    """A healthy job: every rank runs ``units`` (root first) forward, reversed backward.

    ``orders`` overrides the forward order of single ranks (for planting swaps, use
    ``swap_run`` instead: a whole-run override is order-consistent within the rank).
    Prefetch edges, if any, point at the next unit of each phase's order, as FSDP2 users wire
    them. Every unit holds a gradient at each boundary; nothing is pending.
    """
    closed = set(range(world_size)) if closed is None else closed
    b = TraceBuilder(world_size=world_size)
    for rank in range(world_size):
        forward = (orders or {}).get(rank, units)
        backward = [forward[0], *reversed(forward[1:])]
        b.meta(rank)
        for index, name in enumerate(units):
            b.unit(rank, name, is_root=index == 0)
        targets: dict[tuple[str, str], list[str]] = {}
        if prefetch:
            for phase, order in ((schema.FORWARD, forward), (schema.BACKWARD, backward)):
                for i in range(1, len(order) - 1):
                    targets[(order[i], phase)] = [order[i + 1]]
        for step in range(steps):
            for micro in range(micro_steps):
                b.marker(rank, step, micro, schema.MARKER_MICRO_STEP)
                if step == 0 and micro == 0:
                    b.edges(rank, 0, 0, targets, units)
                b.run(rank, step, micro, schema.FORWARD, forward)
                b.run(rank, step, micro, schema.BACKWARD, backward)
            for name in units:
                b.gradient(rank, step, micro_steps - 1, name, f"{name}.weight")
            b.marker(rank, step, micro_steps - 1, schema.MARKER_OPTIMIZER_STEP)
        if rank in closed:
            b.marker(rank, steps, 0, schema.MARKER_CLOSE)
    return b


def write_run_dir(trace: Trace, run_dir: Path) -> Path:
    """The trace as the recorder lays it out on disk, for the Arrow map step."""
    for table in TABLE_NAMES:
        frame = getattr(trace, table)
        for rank, rows in frame.groupby("rank", observed=True):
            declared = schema.with_metadata(schema.TABLES[table], rank=int(rank), version="0")
            data = pa.Table.from_pandas(rows.drop(columns="rank"), schema=declared,
                                        preserve_index=False)
            where = run_dir / table / schema.RANK_DIR.format(rank=rank)
            where.mkdir(parents=True, exist_ok=True)
            pq.write_table(data, where / schema.PART_FILE.format(writer="t", chunk=0))
    return run_dir
