"""Parameters coded and named by FSDP2's own order (CHECKS.md v3, checks 2 and 10).

Real 2-rank FSDP2 jobs (gloo, CPU) of ``tests/jobs_scripts/records_params.py``. Found by
experiment on torch 2.13: FSDP2 collects a unit's parameters module by module in post-order
(children first), so ``Plus``'s ``bias2``, registered after ``super().__init__()``, is the
*last* of ``layers.1``'s ``fsdp_params`` while ``named_parameters()`` lists it first; a tied
embedding/head grouped by ``fully_shard([embed, head])`` holds one parameter, named
``embed.weight`` by FSDP2's lazy init. The recorder used to name codes in
``named_parameters`` order and check 10 said ``layers.1.fc2.bias`` for ``layers.1.bias2``.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import fsdptrace
from fsdptrace.store import fatal_signals
from tests.jobs import REPO, RankResult, assert_ok, case_result, run_ranks
from tests.jobs_scripts.tables import read_folded

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "jobs_scripts" / "records_params.py"
CODED = ("gradients", "backward_grads", "grads_written")


def _run(tmp_path: Path, case: str) -> list[RankResult]:
    return run_ranks([str(SCRIPT), "--out", str(tmp_path), case], timeout_s=150)


def test_units_list_parameters_as_fsdp2_does(tmp_path: Path) -> None:
    """Own parameters beside children's, a subclass's late parameter, a tied grouped unit:
    the units table lists exactly FSDP2's ``_param_fqn``s in ``fsdp_params`` order, and every
    table that codes parameters uses those names."""
    assert_ok(_run(tmp_path, "layout"))
    # A clean close removes the fatal-signal dump nothing wrote to (test_records_v3_fatal).
    assert not list((tmp_path / fatal_signals.DUMPS_DIR).rglob(fatal_signals.FATAL_PATTERN))
    units = read_folded(tmp_path, "units", [0, 1])
    for rank in (0, 1):
        fsdp = case_result(tmp_path, rank)["fsdp_fqns"]
        mine = units[units["rank"] == rank]
        recorded = {u: list(p) for u, p in zip(mine["unit"], mine["param_names"], strict=True)}
        assert recorded == fsdp
    assert recorded["layers.1"][-1] == "layers.1.bias2"
    assert recorded["embed,head"] == ["embed.weight"]
    every = {p for names in recorded.values() for p in names}
    for table in CODED:
        rows = read_folded(tmp_path, table, [0, 1])
        for unit, names in recorded.items():
            assert set(rows.loc[rows["unit"] == unit, "param"]) <= set(names), (table, unit)
        assert set(rows["param"]) <= every


def test_own_parameter_on_one_rank_is_named(tmp_path: Path) -> None:
    """Rank 1 alone uses ``layers.1.bias2`` in the no-sync micro-step (1, 0); the syncing
    micro-step's reduce-scatter then carries 5 parameters on rank 1 and 4 on rank 0, and gloo
    aborts rank 0 (SIGABRT, "Received data size doesn't match expected size").
    gradient-divergence names ``layers.1.bias2``, the parameter the user added."""
    results = _run(tmp_path, "own_param")
    assert results[0].returncode == -signal.SIGABRT, results[0].output[-2000:]
    grads = read_folded(tmp_path, "backward_grads", [0, 1])
    first = grads[(grads["unit"] == "layers.1") & (grads["step"] == 1)
                  & (grads["micro_step"] == 0) & (grads["state"] == "received")]
    assert set(first.loc[first["rank"] == 1, "param"]) - set(
        first.loc[first["rank"] == 0, "param"]) == {"layers.1.bias2"}
    found = fsdptrace.analyze(tmp_path).findings
    divergence = found[found["check"] == "gradient-divergence"]
    # Two ranks, no majority (CHECKS.md v3): each side is reported against the other.
    assert sorted(divergence["rank"]) == [0, 1], found[["check", "rank", "message"]]
    for _, row in divergence.iterrows():
        assert (row["unit"], row["step"], row["micro_step"]) == ("layers.1", 1, 0)
        assert "layers.1.bias2" in row["message"]
        assert "fc2" not in row["message"]


def test_swapped_same_shaped_parameters_are_named(tmp_path: Path) -> None:
    """Rank 0 uses ``img_bias``, rank 1 ``txt_bias`` (same shape) at step 1: both reduce-scatter
    equal sizes, so the job finishes with misaligned data. The finding names both biases."""
    assert_ok(_run(tmp_path, "swapped"))
    found = fsdptrace.analyze(tmp_path).findings
    divergence = found[found["check"] == "gradient-divergence"]
    assert len(divergence) >= 1, found[["check", "rank", "message"]]
    for message in divergence["message"]:
        assert "layers.1.img_bias" in message and "layers.1.txt_bias" in message
        assert "fc2" not in message
