"""The real checks agree with the executable spec (``tests/spec_checks.py``) on random traces.

Seeded random traces (no job, no disk) with what the rules are about: units called twice in a
pass (a reused block), swapped calls on some ranks and micro-steps, ranks of another stage,
random prefetch snapshots (targets that did not run, ran before, or run later), units whose
parameters hold gradients without a forward (written in the step or left from an earlier one),
ranks that did not end clean, and the version-2 tables: per-backward gradient states, settings
changed on some ranks, and eval intervals that differ between ranks.
"""

from __future__ import annotations

import random
from functools import cache

import pandas as pd
import pytest

from fsdptrace import analyze
from fsdptrace.reading.trace import Trace
from fsdptrace.store import schema
from tests import spec_checks as spec
from tests.trace_builder import ROOT, TraceBuilder

SEEDS = range(40)
NAMES = ["a", "b", "c", "d", "e"]


def random_trace(seed: int) -> Trace:
    rng = random.Random(seed)
    world_size, steps, micro_steps = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 2)
    names = [ROOT, *rng.sample(NAMES, rng.randint(1, 4))]
    reused = rng.random() < 0.5 and len(names) > 2
    # Eval passes per interval, the same on every rank unless a rank deviates below.
    eval_plan = [rng.choice([0, 0, 1, 2]) for _ in range(steps + 1)]
    told = {name: rng.random() < 0.15 for name in names}
    b = TraceBuilder(world_size=world_size)
    for rank in range(world_size):
        units = list(names)
        if len(units) > 2 and rng.random() < 0.2:  # a rank of another pipeline stage
            units.remove(rng.choice(units[1:]))
        base = _with_repeat(rng, units) if reused else list(units)
        if rng.random() < 0.2:
            base = _swapped(rng, base)
        ghost = "ghost" if rng.random() < 0.2 else None
        b.meta(rank)
        for index, name in enumerate(units + ([ghost] if ghost else [])):
            b.unit(rank, name, is_root=index == 0)
        for step in range(steps):
            _eval(rng, b, rank, step, units, eval_plan[step])
            for micro in range(micro_steps):
                b.marker(rank, step, micro, schema.MARKER_MICRO_STEP)
                if (step, micro) == (0, 0) or rng.random() < 0.2:
                    b.edges(rank, step, micro, _random_edges(rng, units), units)
                _settings(rng, b, rank, step, micro, units, told)
                forward = _swapped(rng, base) if rng.random() < 0.15 else base
                b.run(rank, step, micro, schema.FORWARD, forward)
                b.run(rank, step, micro, schema.BACKWARD, [forward[0], *reversed(forward[1:])])
                _backward_grads(rng, b, rank, step, micro, units)
            judged = rng.random() < 0.7  # grads_written rows for this step, or none (old dirs)
            for name in units + ([ghost] if ghost and rng.random() < 0.7 else []):
                has_grad = rng.random() < 0.9
                b.gradient(rank, step, micro_steps - 1, name, f"{name}.weight",
                           has_grad=has_grad)
                if judged and has_grad:
                    b.written(rank, step, name, f"{name}.weight", written=rng.random() < 0.7)
            b.marker(rank, step, micro_steps - 1, schema.MARKER_OPTIMIZER_STEP)
        _eval(rng, b, rank, steps, units, eval_plan[steps])
        if rng.random() < 0.8:
            b.marker(rank, steps, 0, schema.MARKER_CLOSE)
    return b.build()


def _eval(rng: random.Random, b: TraceBuilder, rank: int, interval: int, units: list[str],
          passes: int) -> None:
    """``passes`` eval forwards of the units; some ranks run one more or one less, or another
    order."""
    if rng.random() < 0.15:
        passes = max(0, passes + rng.choice([-1, 1]))
    order = _swapped(rng, units) if rng.random() < 0.1 else units
    for _ in range(passes):
        for name in order:
            b.eval_forward(rank, interval, name)


def _settings(rng: random.Random, b: TraceBuilder, rank: int, step: int, micro: int,
              units: list[str], told: dict[str, bool]) -> None:
    """Every setting at the first micro-step, then a change on some ranks now and then."""
    if (step, micro) == (0, 0):
        for name in units:
            b.setting(rank, 0, 0, name, "requires_gradient_sync", "true")
            flipped = rng.random() < 0.1
            b.setting(rank, 0, 0, name, "reduce_scatter_unused_params",
                      "true" if told[name] != flipped else "false")
        return
    if rng.random() < 0.2:
        value = rng.choice(["true", "false", None])
        b.setting(rank, step, micro, rng.choice(units), "requires_gradient_sync", value)


def _backward_grads(rng: random.Random, b: TraceBuilder, rank: int, step: int, micro: int,
                    units: list[str]) -> None:
    """Two parameters per non-root unit, mostly received; now and then one is missing,
    carried from an earlier micro-step or zero-filled."""
    for name in units[1:]:
        for param in (f"{name}.weight", f"{name}.bias"):
            draw = rng.random()
            state = ("none" if draw < 0.06 else "zero_filled" if draw < 0.09
                     else "carried" if draw < 0.15 and micro else "received")
            b.backward_grad(rank, step, micro, name, param, state)


def _with_repeat(rng: random.Random, units: list[str]) -> list[str]:
    """A unit called again later in the pass (a block reused at two depths)."""
    order = list(units)
    index = rng.randint(1, len(order) - 1)
    order.insert(rng.randint(index + 1, len(order)), order[index])
    return order


def _swapped(rng: random.Random, order: list[str]) -> list[str]:
    order = list(order)
    i, j = rng.sample(range(1, len(order)), 2) if len(order) > 2 else (0, 0)
    order[i], order[j] = order[j], order[i]
    return order


def _random_edges(rng: random.Random, units: list[str]) -> dict[tuple[str, str], list[str]]:
    candidates = [*units, "<untracked:Dropout>"]
    return {(unit, phase): rng.sample(candidates, rng.randint(1, 2))
            for unit in units for phase in schema.PHASES if rng.random() < 0.4}


def _rows(found: pd.DataFrame, check: str, columns: list[str]) -> set[tuple]:
    rows = found[found["check"] == check]
    return {tuple(None if pd.isna(v) else (int(v) if isinstance(v, int | float) or
                                           hasattr(v, "item") else v) for v in row)
            for row in rows[columns].astype(object).itertuples(index=False, name=None)}


CASES = {
    "prefetch-order": (spec.prefetch_order, ["rank", "step", "micro_step", "phase", "unit",
                                             "target", "position", "target_position"]),
    "bypassed-unit": (spec.bypassed_unit, ["rank", "step", "unit"]),
    "rank-divergence": (spec.rank_divergence, ["rank", "step", "micro_step", "phase",
                                               "position", "unit", "target"]),
    "prefetch-config-divergence": (spec.prefetch_config_divergence,
                                   ["rank", "step", "micro_step"]),
    "order-instability": (spec.order_instability, ["rank", "step", "micro_step", "position",
                                                   "unit", "target"]),
    "gradient-divergence": (spec.gradient_divergence, ["rank", "step", "micro_step", "unit",
                                                       "parameters"]),
    "eval-divergence": (spec.eval_divergence, ["rank", "step", "position", "unit", "target"]),
    "setting-divergence": (spec.setting_divergence, ["rank", "step", "micro_step", "unit",
                                                     "target"]),
}


@cache
def generated(seed: int) -> tuple[Trace, pd.DataFrame]:
    """One seed's trace and the findings of all the spec'd checks on it, for every test.

    One analysis per trace, not one per check: the map step costs the same whatever check
    is asked, and a check's findings do not depend on which other checks run (each reads
    only the trace), so each parametrized check filters its own rows from the one result.
    """
    trace = random_trace(seed)
    return trace, analyze(trace, checks=sorted(CASES)).findings


@pytest.mark.parametrize("check", sorted(CASES))
def test_checks_agree_with_the_spec(check: str) -> None:
    rule, columns = CASES[check]
    hits = 0
    for seed in SEEDS:
        trace, findings = generated(seed)
        expected = rule(trace)
        got = _rows(findings, check, columns)
        assert got == expected, (seed, sorted(got - expected, key=str),
                                 sorted(expected - got, key=str))
        hits += bool(expected)
    assert hits >= len(SEEDS) // 10, f"{check}: too few random traces exercise the rule"


def test_random_traces_reuse_blocks_across_a_source() -> None:
    """Rule 1's revision is exercised: some edge's target runs before and after its source."""
    exercised = 0
    for seed in SEEDS:
        trace, _ = generated(seed)
        for (rank, step, micro, phase), calls in spec.passes(trace).items():
            for (source, edge_phase), targets in spec.edges_in_effect(
                    trace, rank, step, micro).items():
                if edge_phase != phase or source not in calls:
                    continue
                first = calls.index(source)
                exercised += any(t in calls[:first] and t in calls[first:] for t in targets)
    assert exercised >= 5
