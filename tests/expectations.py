"""The findings each scenario of ``examples/scenarios.py`` must give: its planted problems, only.

One source of truth for three users: the tests on fresh recordings
(``test_analyzer_scenarios.py``), the tests on the shipped samples (``test_samples.py``) and
``examples/make_samples.py``, which refuses to ship a sample that disagrees. So an expectation
returns what is wrong (an empty list when the findings match) instead of asserting: the script
reports it, the tests assert on it.

A planted problem is pinned by checks 1-7 and 10-12 (``docs/checks.md``): none of the scenarios
diverges in gradients, eval forwards or settings, so those must stay silent. The all-gather
provenance warnings (wasted-prefetch, redundant-prefetch) also fire on several scenarios, as
consequences of the same wrong wiring, with hold times in their messages; the provenance tests
pin those. A clean run must give no finding of any check.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

CORE_CHECKS = frozenset({
    "prefetch-order", "bypassed-unit", "pending-all-gather", "rank-divergence",
    "prefetch-config-divergence", "stalled-rank", "order-instability",
    "gradient-divergence", "eval-divergence", "setting-divergence",
})
WHERE = ["check", "rank", "step", "micro_step", "phase", "unit", "target"]
RANKS = (0, 1)
MICRO_STEPS = (0, 1)  # scenarios.py accumulates gradients over 2 micro-steps
DEFAULT_STEPS = 3  # scenarios.py's own default; the samples are recorded shorter

# The shipped samples: the clean runs and one per kind of problem, kept tiny with fewer steps.
SAMPLES = (
    "clean",
    "clean-checkpoint-accumulation",
    "wrong-forward-prefetch",
    "wrong-backward-prefetch",
    "missing-target",
    "bypassed-child",
    "rank-divergence",
    "config-divergence",
    "pending-all-gather",
    "order-instability",
    "killed-rank",
)
SAMPLE_STEPS = 2

Problems = list[str]


def where(findings: pd.DataFrame) -> set[tuple]:
    """Each finding's location, NaN as None, so sets of findings compare exactly."""
    return {tuple(None if pd.isna(v) else v for v in row)
            for row in findings[WHERE].itertuples(index=False, name=None)}


def differ(label: str, got: set, expected: set) -> Problems:
    if got == expected:
        return []
    return [f"{label}: unexpected {sorted(got - expected, key=repr)}, "
            f"missing {sorted(expected - got, key=repr)}"]


def message_says(findings: pd.DataFrame, text: str, *, every: bool = False) -> Problems:
    """``text`` in the first message (or in every one): the finding tells the person what to do."""
    messages = list(findings["message"]) if every else list(findings["message"][:1])
    if messages and all(text in m for m in messages):
        return []
    return [f"expected {text!r} in {'every' if every else 'the first'} message, got {messages}"]


def every_rank_and_micro_step(check: str, steps: int, phase: str | None, unit: str | None,
                              target: str | None) -> set[tuple]:
    return {(check, r, s, m, phase, unit, target)
            for r in RANKS for s in range(steps) for m in MICRO_STEPS}


def clean(findings: pd.DataFrame, steps: int) -> Problems:
    return differ("findings of a clean run", where(findings), set())


def wrong_forward_prefetch(findings: pd.DataFrame, steps: int) -> Problems:
    expected = every_rank_and_micro_step("prefetch-order", steps, "forward", "layers.2",
                                         "layers.1")
    return differ("findings", where(findings), expected) + message_says(
        findings, "positions 3->2")


def wrong_backward_prefetch(findings: pd.DataFrame, steps: int) -> Problems:
    expected = every_rank_and_micro_step("prefetch-order", steps, "backward", "layers.1",
                                         "layers.2")
    return differ("findings", where(findings), expected)


def missing_target(findings: pd.DataFrame, steps: int) -> Problems:
    expected = every_rank_and_micro_step("prefetch-order", steps, "forward", "layers.3",
                                         "adapter")
    return differ("findings", where(findings), expected) + message_says(
        findings, "did not execute", every=True)


def bypassed_child(findings: pd.DataFrame, steps: int) -> Problems:
    # Reported once per optimizer step, at its last micro-step, where the gradient is found.
    expected = {("bypassed-unit", r, s, MICRO_STEPS[-1], None, "adapter", None)
                for r in RANKS for s in range(steps)}
    return differ("findings", where(findings), expected) + message_says(
        findings, "adapter.fc1.weight", every=True)


def rank_divergence(findings: pd.DataFrame, steps: int) -> Problems:
    # Two ranks, no majority (CHECKS.md v3): each is reported against the other side.
    forward = {("rank-divergence", 1, s, m, "forward", "layers.2", "layers.1")
               for s in range(steps) for m in MICRO_STEPS}
    forward |= {("rank-divergence", 0, s, m, "forward", "layers.1", "layers.2")
                for s in range(steps) for m in MICRO_STEPS}
    backward = {("rank-divergence", 1, s, m, "backward", "layers.1", "layers.2")
                for s in range(steps) for m in MICRO_STEPS}
    backward |= {("rank-divergence", 0, s, m, "backward", "layers.2", "layers.1")
                 for s in range(steps) for m in MICRO_STEPS}
    return differ("findings", where(findings), forward | backward) + message_says(
        findings, "no majority", every=True)


def config_divergence(findings: pd.DataFrame, steps: int) -> Problems:
    # Two ranks, no majority (CHECKS.md v3): both sides, neither called the outlier.
    expected = {("prefetch-config-divergence", r, 0, 0, None, None, None) for r in RANKS}
    return differ("findings", where(findings), expected) + message_says(
        findings, "neither side is the outlier by its rank number", every=True)


def pending_all_gather(findings: pd.DataFrame, steps: int) -> Problems:
    got = {(c, r, s, u) for c, r, s, _, _, u, _ in where(findings)}
    return differ("findings", got, {("pending-all-gather", r, s, "layers.1")
                                    for r in RANKS for s in range(steps)})


def order_instability(findings: pd.DataFrame, steps: int) -> Problems:
    """Step 1 runs layers 1 and 2 swapped: a warning, and its prefetch edges break there too."""
    warnings = findings[findings["check"] == "order-instability"]
    expected = {("order-instability", r, 1, m, "forward", "layers.2", "layers.1")
                for r in RANKS for m in MICRO_STEPS}
    prefetch_steps = set(findings.loc[findings["check"] == "prefetch-order", "step"])
    return (differ("warnings", where(warnings), expected)
            + differ("checks", set(findings["check"]), {"order-instability", "prefetch-order"})
            + differ("prefetch-order steps", prefetch_steps, {1}))


def killed_rank(findings: pd.DataFrame, steps: int) -> Problems:
    """Rank 1 dies in the last step's first micro-step, after its forward reached layers.3."""
    killed = findings[(findings["check"] == "stalled-rank") & (findings["rank"] == 1)]
    if killed.empty:
        return [f"rank 1 not reported as stalled: {sorted(where(findings), key=repr)}"]
    first = killed.iloc[0]
    got = {(first["step"], first["micro_step"], first["phase"], first["unit"])}
    # The cut-off micro-step is not a prefetch finding.
    return (differ("where rank 1 stopped", got, {(steps - 1, 0, "forward", "layers.3")})
            + message_says(killed, "furthest behind")
            + differ("checks", set(findings["check"]), {"stalled-rank"}))


EXPECTATIONS: dict[str, Callable[[pd.DataFrame, int], Problems]] = {
    "clean": clean,
    "clean-checkpoint-accumulation": clean,
    "clean-reentrant-checkpoint": clean,
    "wrong-forward-prefetch": wrong_forward_prefetch,
    "wrong-backward-prefetch": wrong_backward_prefetch,
    "missing-target": missing_target,
    "bypassed-child": bypassed_child,
    "rank-divergence": rank_divergence,
    "config-divergence": config_divergence,
    "pending-all-gather": pending_all_gather,
    "order-instability": order_instability,
    "killed-rank": killed_rank,
}


def problems(name: str, findings: pd.DataFrame, *, steps: int = DEFAULT_STEPS) -> Problems:
    """What is wrong with the findings of scenario ``name`` recorded over ``steps`` steps."""
    expectation = EXPECTATIONS[name]
    if expectation is not clean:
        findings = findings[findings["check"].isin(CORE_CHECKS)].reset_index(drop=True)
    return expectation(findings, steps)
