"""The rows of one synthetic rank, every table the recorder writes, built with numpy.

``generate_run`` decides the shape and where problems are planted; this module turns that into
Arrow tables of the declared schemas. Rows come as the recorder would leave them for a plain
FSDP2 job: one ``events`` row per unit entry, an all-gather issued, consumed and resharded per
entry (``allgathers``), a ``backward_grads`` row per parameter at each unit's post-backward
(``adapter`` never runs: FSDP's end-of-backward safety net reports it idle), one settings
snapshot at the start, the boundary snapshots (``gradients``, ``grads_written``, ``pending``).
Every table that shares the recorder's sequence counter (events, allgathers, backward_grads,
markers) takes numbers from one counter: ``SEQ_SCALE`` numbers per slot of the layout below.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from fsdptrace.store import schema
from fsdptrace.version import __version__

# Per slot of the layout: the event, its all-gather (issue, consume, reshard), then up to two
# backward_grads rows (a layer's weight and bias) and the idle adapter's row.
SEQ_SCALE = 8
GATHER_BYTES = 8192  # far below unsharded-excess's 1 MiB: nothing planted there
PARAM_SUFFIXES = ("weight", "bias")


@dataclass(frozen=True)
class RankLayout:
    """What one rank's rows depend on: the shape, the plan, and where the rank stops."""

    micro_steps: int
    units: int
    steps: int
    stage: int
    world_size: int
    stop: int | None  # events recorded, or None: ran to the end and closed cleanly
    complete: int  # optimizer steps finished


def names(units: int, stage: int) -> list[str]:
    first = stage * units
    return ["<root>"] + [f"layers.{first + i}" for i in range(units)] + ["adapter", "act"]


def params(units: int, stage: int) -> list[tuple[str, str]]:
    """(unit, parameter) in unit order: what ``gradients`` and ``grads_written`` list."""
    unit_names = names(units, stage)
    return ([("<root>", "embed.weight")]
            + [(n, f"{n}.{p}") for n in unit_names[1:-2] for p in PARAM_SUFFIXES]
            + [("adapter", "adapter.weight")])


def dictionary(words: list[str], rank: int) -> tuple[pa.Array, np.ndarray]:
    """The rank's dictionary and, per canonical index, its code in it.

    Odd ranks store their dictionaries reversed: nothing may compare codes across ranks.
    """
    order = np.arange(len(words))[::-1] if rank % 2 else np.arange(len(words))
    codes = np.empty(len(words), dtype=np.int32)
    codes[order] = np.arange(len(words), dtype=np.int32)
    return pa.array([words[i] for i in order], pa.string()), codes


def coded(canonical: np.ndarray, words: list[str], rank: int) -> pa.DictionaryArray:
    """A dictionary column from canonical indexes (-1: null) into ``words``."""
    values, codes = dictionary(words, rank)
    indices = np.where(canonical < 0, 0, codes[np.maximum(canonical, 0)]).astype(np.int32)
    return pa.DictionaryArray.from_arrays(pa.array(indices, mask=canonical < 0), values)


def template(units: int) -> tuple[np.ndarray, np.ndarray]:
    """Canonical unit indexes and phase indexes (0 forward) of one micro-step."""
    layers = np.arange(1, units + 1)
    forward = np.concatenate([[0], layers, [1]])
    backward = np.concatenate([[0], layers[::-1]])
    phases = np.repeat([0, 1], [len(forward), len(backward)])
    return np.concatenate([forward, backward]).astype(np.int64), phases.astype(np.int64)


@dataclass(frozen=True)
class Entries:
    """One rank's unit entries: canonical unit, phase, step, micro-step and slot number."""

    unit: np.ndarray
    phase: np.ndarray
    step: np.ndarray
    micro: np.ndarray
    slot: np.ndarray


def slots_per_micro(units: int) -> int:
    return 2 * units + 3


def step_slots(layout: RankLayout) -> int:
    return layout.micro_steps * (slots_per_micro(layout.units) + 1) + 1


def entries(layout: RankLayout, unit: np.ndarray) -> Entries:
    """``unit``: canonical unit per entry for the whole run (swaps already applied)."""
    per = slots_per_micro(layout.units)
    _, phases = template(layout.units)
    index = np.arange(len(unit))
    micro_index, within = np.divmod(index, per)
    step, micro = np.divmod(micro_index, layout.micro_steps)
    slot = step * step_slots(layout) + micro * (per + 1) + within + 2
    phase = phases[within]
    stop = len(unit) if layout.stop is None else layout.stop
    return Entries(unit[:stop], phase[:stop], step[:stop], micro[:stop], slot[:stop])


def events(e: Entries, layout: RankLayout, rank: int) -> pa.Table:
    seq = e.slot * SEQ_SCALE
    return pa.table({
        "seq": pa.array(seq), "t_ns": pa.array(seq * 125),
        "step": pa.array(e.step.astype(np.int32)),
        "micro_step": pa.array(e.micro.astype(np.int32)),
        "phase": coded(e.phase, list(schema.PHASES), rank),
        "unit": coded(e.unit, names(layout.units, layout.stage), rank),
    }, schema=schema.EVENTS)


GATHER_EVENTS = ["issue", "consume", "reshard"]


def allgathers(e: Entries, layout: RankLayout, rank: int) -> pa.Table:
    """Per unit entry: its own all-gather issued, consumed, then resharded."""
    n = len(e.slot)
    kind = np.tile(np.arange(3), n)
    seq = np.repeat(e.slot * SEQ_SCALE, 3) + kind + 1
    unit = np.repeat(e.unit, 3)
    issued = kind == 0
    words = names(layout.units, layout.stage)
    return pa.table({
        "seq": pa.array(seq), "t_ns": pa.array(seq * 125),
        "step": pa.array(np.repeat(e.step, 3).astype(np.int32)),
        "micro_step": pa.array(np.repeat(e.micro, 3).astype(np.int32)),
        "phase": coded(np.repeat(e.phase, 3), list(schema.PHASES), rank),
        "unit": coded(unit, words, rank),
        "group": pa.array(np.zeros(3 * n, dtype=np.int32)),
        "event": coded(kind, GATHER_EVENTS, rank),
        "issuer_kind": coded(np.where(issued, 0, -1), ["own"], rank),
        "issuer_unit": coded(np.where(issued, unit, -1), words, rank),
        "num_bytes": pa.array(np.full(3 * n, GATHER_BYTES, dtype=np.int64)),
        "detail": coded(np.full(3 * n, -1), ["pending"], rank),
    }, schema=schema.ALLGATHERS)


def backward_grads(e: Entries, layout: RankLayout, rank: int) -> pa.Table:
    """At each backward unit's post-backward, one row per parameter it received; the adapter
    (never run) reported idle, with nothing, at the end of every backward."""
    units, stage = layout.units, layout.stage
    back = e.phase == 1
    b_unit, b_slot = e.unit[back], e.slot[back]
    count = np.where(b_unit == 0, 1, 2)  # <root>: embed.weight; a layer: weight and bias
    row_unit = np.repeat(b_unit, count)
    first = np.repeat(np.cumsum(count) - count, count)
    which = np.arange(len(row_unit)) - first  # 0 weight, 1 bias
    # Parameter index into params(): <root> 0, layers.i (canonical i+1) at 2i+1, 2i+2.
    param = np.where(row_unit == 0, 0, 2 * (row_unit - 1) + 1 + which)
    seq = np.repeat(b_slot * SEQ_SCALE, count) + 4 + which
    step, micro = np.repeat(e.step[back], count), np.repeat(e.micro[back], count)
    # The idle adapter: after the last backward unit of every backward that finished.
    ends = np.flatnonzero(back & (e.unit == 1))
    idle_seq = e.slot[ends] * SEQ_SCALE + 6
    order = np.argsort(np.concatenate([seq, idle_seq]), kind="stable")
    adapter = len(names(units, stage)) - 2
    all_params = [p for _, p in params(units, stage)]
    cat = np.concatenate
    return pa.table({
        "seq": pa.array(cat([seq, idle_seq])[order]),
        "t_ns": pa.array(cat([seq, idle_seq])[order] * 125),
        "step": pa.array(cat([step, e.step[ends]])[order].astype(np.int32)),
        "micro_step": pa.array(cat([micro, e.micro[ends]])[order].astype(np.int32)),
        "unit": coded(cat([row_unit, np.full(len(ends), adapter)])[order],
                      names(units, stage), rank),
        "param": coded(cat([param, np.full(len(ends), len(all_params) - 1)])[order],
                       all_params, rank),
        "state": coded(cat([np.zeros(len(seq), np.int64), np.full(len(ends), 3)])[order],
                       list(schema.GRAD_STATES), rank),
        "via": coded(cat([np.zeros(len(seq), np.int64), np.ones(len(ends), np.int64)])[order],
                     list(schema.GRAD_VIAS), rank),
    }, schema=schema.BACKWARD_GRADS)


def settings(layout: RankLayout) -> pa.Table:
    """The snapshot at the first root forward: every unit with parameters, every setting."""
    unit_names = names(layout.units, layout.stage)[:-1]  # act has no parameters
    values = {"requires_gradient_sync": "true", "requires_all_reduce": "true",
              "is_last_backward": "true", "reshard_after_forward": "true",
              "reshard_after_backward": "true", "reduce_scatter_unused_params": "false",
              "mesh_shape": f"[{layout.world_size}]"}
    rows = [(u, s, "false" if (u == "<root>" and s == "reshard_after_forward") else v)
            for u in unit_names for s, v in values.items()]
    unit, setting, value = (list(c) for c in zip(*rows, strict=True))
    return pa.table({"step": [0] * len(rows), "micro_step": [0] * len(rows), "unit": unit,
                     "setting": setting, "value": value}, schema=schema.SETTINGS)


def boundary(layout: RankLayout, has_grad: np.ndarray) -> tuple[pa.Table, pa.Table]:
    """``gradients`` and ``grads_written`` at each finished optimizer step."""
    pairs = params(layout.units, layout.stage)
    unit_names, param_names = (np.array(c) for c in zip(*pairs, strict=True))
    complete, last = layout.complete, layout.micro_steps - 1
    step = np.repeat(np.arange(complete, dtype=np.int32), len(pairs))
    unit, param = np.tile(unit_names, complete), np.tile(param_names, complete)
    gradients = pa.table({
        "step": step, "micro_step": np.full(len(step), last, dtype=np.int32),
        "unit": pa.array(unit).dictionary_encode(), "param": pa.array(param),
        "has_grad": pa.array(has_grad),
        "grad_source": pa.array(np.where(has_grad, "sharded", "none")).dictionary_encode(),
    }, schema=schema.GRADIENTS)
    held = np.flatnonzero(has_grad)
    written = pa.table({
        "step": step[held], "micro_step": np.full(len(held), last, dtype=np.int32),
        "unit": pa.array(unit[held]).dictionary_encode(), "param": pa.array(param[held]),
        "written": pa.array(np.ones(len(held), dtype=bool)),
    }, schema=schema.GRADS_WRITTEN)
    return gradients, written


def units_table(layout: RankLayout) -> pa.Table:
    unit_names = names(layout.units, layout.stage)
    param_lists = ([["embed.weight"]] + [[f"{n}.{p}" for p in PARAM_SUFFIXES]
                                         for n in unit_names[1:-2]] + [["adapter.weight"], []])
    num_params = [len(p) for p in param_lists]
    return pa.table({
        "unit": unit_names, "part": [0] * len(unit_names),
        "fqn": [""] + unit_names[1:],
        "module_type": ["Model"] + ["Block"] * layout.units + ["Adapter", "Act"],
        "is_root": [True] + [False] * (len(unit_names) - 1), "num_params": num_params,
        "num_param_elements": [1024 * n for n in num_params], "param_names": param_lists,
    }, schema=schema.UNITS)


def meta(layout: RankLayout, rank: int) -> pa.Table:
    row = {"world_size": [layout.world_size], "host": [f"node{rank // 8}"],
           "pid": [pid(rank)], "backend": ["fsdp2"], "torch_version": ["synthetic"],
           "fsdptrace_version": [__version__], "schema_version": [schema.SCHEMA_VERSION],
           "wall_anchor_ns": [0], "mono_anchor_ns": [0], "num_parts": [1],
           "steps_spec": [""], "raise_on_violation": [False]}
    return pa.table(row, schema=schema.META)


def pid(rank: int) -> int:
    return 1000 + rank


def writer_id(rank: int) -> str:
    """A writer id of the recorder's form (``j<pid>_<nanoseconds>``), fixed per rank."""
    return f"j{pid(rank)}_{rank * 7919 % 10**9:09d}"
