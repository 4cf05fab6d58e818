"""The HSDP backend on real hyper_parallel units (2 ranks, gloo, CPU), and on a fake only for
the attribute layout this release does not have.

One launch of ``tests/jobs_scripts/hsdp_cases.py`` runs every real case; each test judges what
one case recorded. What hyper_parallel 0.1 does, observed in these jobs, is written next to the
test that relies on it; a test with an FSDP2 twin names it and asserts the same findings
(``tests/test_provenance.py``, ``tests/test_unsharded.py``). The fake (``tests/fake_hsdp.py``)
remains for the reference checker's newer layout (fused ``all_gather_buckets`` and
``allgather_comm_ctx``), which this release cannot produce.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import torch.nn as nn

import fsdptrace
from fsdptrace import LifecycleError
from fsdptrace.record.launch import record_env
from tests import fake_hsdp
from tests.jobs import REPO, assert_ok, case_result, run_ranks
from tests.jobs_scripts.tables import orders, read_table, rows_of

SCRIPT = REPO / "tests" / "jobs_scripts" / "hsdp_cases.py"
WHEELS = REPO.parent / "shared" / "wheels"
FINDING_COLUMNS = ["check", "step", "micro_step", "phase", "unit", "target", "message"]
LAYERS = [f"layers.{i}" for i in range(4)]
FORWARD = ["<root>", *LAYERS]
BACKWARD = ["<root>", *LAYERS[::-1]]
PASSES = [(rank, step, micro) for rank in (0, 1) for step in (0, 1) for micro in (0, 1)]
BOUNDARIES = [(rank, step) for rank in (0, 1) for step in (0, 1)]
EXTRA = ["extra.fc.bias", "extra.fc.weight"]
BLOCK_BYTES = (8 * 8 + 8) * 4  # one Block's Linear(8, 8), float32, gathered whole
WIDE_BYTES = (512 * 512 + 512) * 4  # the ledger cases' Linear(512, 512) units
RANKS = (0, 1)

real_hsdp = pytest.mark.skipif(
    importlib.util.find_spec("hyper_parallel") is None,
    reason="hyper_parallel is not installed: `make setup` installs it from ../shared/wheels/ "
           f"({'present' if WHEELS.is_dir() else 'absent here'})")


# --------------------------------------------------------------------- real hyper_parallel
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hsdp")
    from tests.jobs_scripts.hsdp_cases import CASES

    assert_ok(run_ranks([str(SCRIPT), "--out", str(out), *CASES], timeout_s=600))
    return out


def findings(run_dir: Path) -> pd.DataFrame:
    return fsdptrace.analyze(run_dir).findings


def where(found: pd.DataFrame, check: str) -> set[tuple]:
    rows = found[found["check"] == check]
    return rows_of(rows, "rank", "step", "micro_step", "phase", "unit", "target")


def keys(found: pd.DataFrame, check: str) -> list[tuple]:
    rows = found[found["check"] == check]
    return sorted(zip(rows["rank"], rows["step"], rows["micro_step"], rows["target"],
                      strict=True))


@real_hsdp
@pytest.mark.slow
def test_clean_chain_records_every_pass_and_finds_nothing(runs: Path) -> None:
    run_dir = runs / "clean"
    assert set(read_table(run_dir, "meta")["backend"]) == {"hsdp"}
    assert list(read_table(run_dir, "units").query("rank == 0")["unit"]) == [*FORWARD, "extra"]
    recorded = orders(run_dir)
    assert {k: v for k, v in recorded.items() if k[3] == "forward"} == {
        (*p, "forward"): FORWARD for p in PASSES}
    assert {k: v for k, v in recorded.items() if k[3] == "backward"} == {
        (*p, "backward"): BACKWARD for p in PASSES}
    # hyper_parallel 0.1 leaves _param_fqn None: names come from its (module, param_name).
    gradients = read_table(run_dir, "gradients").query("rank == 0 and step == 0")
    assert list(gradients.query("unit == 'layers.0'")["param"]) == [
        "layers.0.fc.weight", "layers.0.fc.bias"]
    # After a synced backward every trained unit's gradient is on its sharded parameter.
    assert set(gradients.query("unit != 'extra'")["grad_source"]) == {"sharded"}
    assert len(findings(run_dir)) == 0
    assert case_result(run_dir, 0)["changed"]  # it trained


@real_hsdp
@pytest.mark.slow
def test_explicit_boundaries_record_what_the_optimizer_hook_does(runs: Path) -> None:
    """``begin_micro_step``/``before_optimizer_step`` called by the loop, no optimizer given."""
    run_dir = runs / "clean-explicit-boundaries"
    assert orders(run_dir) == orders(runs / "clean")
    assert len(read_table(run_dir, "gradients")) == len(read_table(runs / "clean", "gradients"))
    assert len(findings(run_dir)) == 0


@real_hsdp
@pytest.mark.slow
def test_checkpoint_recompute_is_not_forward_order(runs: Path) -> None:
    recorded = orders(runs / "clean-checkpoint")
    assert [recorded[(*p, "forward")] for p in PASSES] == [FORWARD] * len(PASSES)
    assert len(findings(runs / "clean-checkpoint")) == 0


@real_hsdp
@pytest.mark.slow
def test_forward_prefetch_of_a_unit_that_never_runs(runs: Path) -> None:
    """HSDP issues the all-gather and nothing ever waits for it: its ``prefetch_handle`` stays
    set and its ``all_gather_outputs`` held at every optimizer boundary, and training exits 0.

    Observed with provenance: one ``issue`` (step 0, micro-step 0), then every later prefetch
    of ``extra`` is a no-op (its handle is still set), so in step 1 the edge did nothing at
    all: redundant-prefetch, naming the gather of step 0 that is still pending. FSDP2's twin
    (scenario ``missing-target``) drops the gather at the end of each backward and reports a
    wasted prefetch per micro-step instead; hyper_parallel drops nothing, so no ``drop`` row
    and no consume: check 8 has nothing to time, check 3 reports the held gather.
    """
    found = findings(runs / "never-runs")
    assert set(found["check"]) == {"prefetch-order", "pending-all-gather", "redundant-prefetch"}
    assert keys(found, "prefetch-order") == [(*p, "extra") for p in PASSES]
    assert keys(found, "pending-all-gather") == [
        (rank, step, 1, param) for rank, step in BOUNDARIES for param in EXTRA]
    pending = found[found["check"] == "pending-all-gather"]
    assert set(pending["unit"]) == {"extra"}
    assert pending["message"].str.contains(
        "handle=set, output=not-consumed (issued by prefetch from layers.3 in step 0 "
        "micro-step 0)", regex=False).all()
    order = found[found["check"] == "prefetch-order"]
    assert order["message"].str.startswith(
        "layers.3 prefetched extra, but extra did not execute in forward").all()
    assert where(found, "redundant-prefetch") == {
        (rank, 1, 0, "forward", "layers.3", "extra") for rank in RANKS}
    assert found["message"].str.contains(
        "already pending (gathered by prefetch from layers.3)", regex=False).any()
    table = read_table(runs / "never-runs", "allgathers")
    extra = table[table["unit"] == "extra"]
    assert rows_of(extra[extra["event"] == "issue"], "rank", "step", "micro_step") == {
        (rank, 0, 0) for rank in RANKS}
    assert rows_of(extra[extra["event"] != "issue"], "rank", "step", "micro_step", "event",
                   "detail") == {(rank, step, micro, "noop", "pending") for rank in RANKS
                                 for step, micro in ((0, 1), (1, 0), (1, 1))}


@real_hsdp
@pytest.mark.slow
@pytest.mark.parametrize("case", ["wrong-backward", "wrong-backward-raf"])
def test_wrong_backward_edge(runs: Path, case: str) -> None:
    """``layers.1`` backward-prefetches ``layers.2``, whose backward already ran.

    Observed: layers.2's post-backward has resharded it by then, so the edge issues a real
    all-gather that no one consumes in backward; it is still pending at every optimizer
    boundary, and the next forward of layers.2 waits for it: a wasted prefetch, consumed
    only in the next micro-step's forward (the last one of the run never is). So in step 1
    layers.1's forward prefetch of layers.2 always finds that gather pending: redundant.
    FSDP2's twin (scenario ``wrong-backward-prefetch``) drops the gather at the end of
    backward: the same wasted prefetches, ended by a drop. The same findings with
    ``reshard_after_forward=True`` (``-raf``: every unit re-gathered in backward).
    """
    found = findings(runs / case)
    assert set(found["check"]) == {"prefetch-order", "pending-all-gather", "wasted-prefetch",
                                   "redundant-prefetch"}
    order = found[found["check"] == "prefetch-order"]
    assert keys(found, "prefetch-order") == [(*p, "layers.2") for p in PASSES]
    assert set(order["phase"]) == {"backward"}
    assert order["message"].str.startswith(
        "layers.1 prefetched layers.2 at positions 3->2 in backward").all()
    assert keys(found, "pending-all-gather") == [
        (rank, step, 1, f"layers.2.fc.{name}")
        for rank, step in BOUNDARIES for name in ("bias", "weight")]
    assert where(found, "wasted-prefetch") == {
        (rank, step, micro, "backward", "layers.1", "layers.2")
        for rank, step, micro in PASSES if (step, micro) != (1, 1)}
    wasted = found[found["check"] == "wasted-prefetch"]
    assert wasted["message"].str.startswith(
        f"layers.1 in backward prefetched layers.2 ({BLOCK_BYTES} bytes), "
        "consumed only in step ").all()
    assert set(wasted["bytes"]) == {BLOCK_BYTES}
    assert where(found, "redundant-prefetch") == {
        (rank, 1, 0, "forward", "layers.1", "layers.2") for rank in RANKS}


@real_hsdp
@pytest.mark.slow
def test_ranks_with_different_prefetch_configuration(runs: Path) -> None:
    """Rank 0 prefetches one ahead, rank 1 not at all; both gather in the same order."""
    found = findings(runs / "config-divergence")
    # Two ranks, no majority (CHECKS.md v3): both sides are given, neither is the outlier.
    assert list(found["check"]) == ["prefetch-config-divergence"] * 2
    assert sorted(found["rank"]) == [0, 1]
    assert found["message"].str.contains("neither side is the outlier", regex=False).all()
    assert "layers.0 forward -> [layers.1] (rank 1: [])" in " ".join(found["message"])


@real_hsdp
@pytest.mark.slow
def test_rank_divergence(runs: Path) -> None:
    """Rank 1 runs layers.2 before layers.1. The blocks' gathers have equal shapes, so HSDP
    pairs them up across ranks without a hang or an error (silently swapped parameters)."""
    found = findings(runs / "rank-divergence")
    assert set(found["check"]) == {"rank-divergence"}
    # Two ranks, no majority (CHECKS.md v3): each rank is reported against the other.
    assert sorted(zip(found["rank"], found["step"], found["micro_step"], found["phase"],
                      found["unit"], found["target"], strict=True)) == sorted(
        (rank, step, micro, phase, *(("layers.1", "layers.2") if (phase == "backward") == rank
                                     else ("layers.2", "layers.1")))
        for rank in (0, 1) for step in (0, 1) for micro in (0, 1)
        for phase in ("backward", "forward"))


@real_hsdp
@pytest.mark.slow
def test_order_instability(runs: Path) -> None:
    """Every second micro-step swaps layers.1 and layers.2 on both ranks."""
    found = findings(runs / "order-instability")
    assert set(found["check"]) == {"order-instability"}
    assert keys(found, "order-instability") == [
        (rank, step, 1, "layers.1") for rank, step in BOUNDARIES]


@real_hsdp
@pytest.mark.slow
def test_a_unit_used_without_its_forward(runs: Path) -> None:
    """``extra.unshard()`` then its weight used directly: the gradient stays on the unsharded
    parameter (never reduced), and the unit stays unsharded across the optimizer step."""
    found = findings(runs / "bypassed-extra")
    assert set(found["check"]) == {"bypassed-unit", "pending-all-gather"}
    bypassed = found[found["check"] == "bypassed-unit"]
    assert sorted(zip(bypassed["rank"], bypassed["step"], strict=True)) == BOUNDARIES
    assert bypassed["message"].str.contains(r"\(extra.fc.weight\)").all()
    pending = found[found["check"] == "pending-all-gather"]
    assert pending["message"].str.startswith("extra: unit parameters unsharded-held").all()
    gradients = read_table(runs / "bypassed-extra", "gradients").query("unit == 'extra'")
    assert set(gradients.query("has_grad")["grad_source"]) == {"unsharded"}


@real_hsdp
@pytest.mark.slow
def test_live_raising_stops_the_optimizer_step(runs: Path) -> None:
    run_dir = runs / "live-never-runs"
    for rank in (0, 1):
        result = case_result(run_dir, rank)
        assert result["raised"] == "LifecycleError"
        message = result["message"]
        assert f"on rank {rank} before optimizer step 0; the optimizer was not executed" in message
        assert "prefetch-order" in message and "pending-all-gather" in message
        assert result["changed"] == [] and result["optimizer_state"] == 0
    # The live findings are on disk and are the offline analysis's. Offline messages add
    # all-gather provenance ("issued by ..."), a table the live path does not hold (as on
    # FSDP2: test_live.py); the findings themselves are the same rows.
    on_disk = read_table(run_dir, "findings")
    offline = findings(run_dir)
    assert _rows(on_disk, FINDING_COLUMNS[:-1]) == _rows(
        offline[offline["severity"] == "error"], FINDING_COLUMNS[:-1])
    assert set(offline["check"]) == {"prefetch-order", "pending-all-gather"}


@real_hsdp
@pytest.mark.slow
def test_settings_of_every_unit(runs: Path) -> None:
    settings = case_result(runs / "clean", 0)["settings"]
    assert set(settings) == {*FORWARD, "extra"}
    assert settings["layers.0"] == {
        "requires_gradient_sync": True, "requires_all_reduce": True, "is_last_backward": True,
        "reshard_after_forward": False, "reshard_after_backward": True, "mesh_shape": [2]}


@real_hsdp
@pytest.mark.slow
def test_backward_grads_and_settings_tables(runs: Path) -> None:
    """``hsdp_state.post_backward`` runs only for units that ran backward: ``extra`` (never
    called) has no rows, every layer's parameters are ``received`` in every micro-step."""
    run_dir = runs / "clean"
    grads = read_table(run_dir, "backward_grads")
    assert set(grads["unit"]) == {"<root>", *LAYERS}
    assert set(grads["state"]) == {"received"} and set(grads["via"]) == {"backward"}
    per_pass = grads.groupby(["rank", "step", "micro_step"])["param"].agg(frozenset)
    assert per_pass.index.tolist() == PASSES
    assert len(set(per_pass)) == 1
    settings = read_table(run_dir, "settings")
    first = settings[(settings["rank"] == 0) & (settings["step"] == 0)
                     & (settings["micro_step"] == 0) & (settings["unit"] == "layers.0")]
    assert dict(zip(first["setting"], first["value"].fillna("null"), strict=True)) == {
        "requires_gradient_sync": "true", "requires_all_reduce": "true",
        "is_last_backward": "true", "reshard_after_forward": "false",
        "reshard_after_backward": "true", "reduce_scatter_unused_params": "null",
        "mesh_shape": "[2]"}
    written = read_table(run_dir, "grads_written")
    assert written["written"].all() and set(written["unit"]) == {"<root>", *LAYERS}
    assert read_table(run_dir, "eval_forwards").empty


# --------------------------------------------------------------------- all-gather provenance
PROVENANCE_CASES = ["clean", "clean-checkpoint", "never-runs", "wrong-backward",
                    "redundant-prefetch", "manual-unshard", "ledger-keep", "ledger-raf",
                    "clean-raf", "wrong-backward-raf"]


@real_hsdp
@pytest.mark.slow
@pytest.mark.parametrize("case", PROVENANCE_CASES)
def test_issues_are_the_all_gathers_hyper_parallel_ran(runs: Path, case: str) -> None:
    """Per rank and unit, one ``issue`` row per gather of the unit hyper_parallel ran (its
    per-parameter gathers counted inside the job), no more, no less. FSDP2's twin:
    ``test_provenance.py::test_issues_are_the_all_gathers_fsdp_ran``."""
    table = read_table(runs / case, "allgathers")
    for rank in RANKS:
        issues = table[(table["rank"] == rank) & (table["event"] == "issue")]
        counted = case_result(runs / case, rank)["all_gathers"]
        assert issues["unit"].astype(str).value_counts().to_dict() == counted


@real_hsdp
@pytest.mark.slow
@pytest.mark.parametrize("case", ["clean", "clean-raf"])
def test_every_issue_is_consumed_once(runs: Path, case: str) -> None:
    """Between two issues of a unit there is exactly one consume (hyper_parallel drops none)."""
    table = read_table(runs / case, "allgathers")
    life = table[table["event"].isin(["issue", "consume", "drop"])]
    for _, unit in life.groupby(["rank", "unit"], observed=True):
        events = list(unit.sort_values("seq")["event"].astype(str))
        assert events == ["issue", "consume"] * (len(events) // 2)


@real_hsdp
@pytest.mark.slow
def test_issuers_of_a_chained_forward_and_backward(runs: Path) -> None:
    """One ahead in forward, one back in backward, ``reshard_after_forward=True``: each layer
    is gathered by its neighbour's prefetch, the first units of each phase by themselves
    (the root, whose parameters are the head's, runs first in both). With ``False`` backward
    gathers nothing: every unit is still unsharded from forward, and resharded after its
    backward. FSDP2's twin: ``test_provenance.py::test_issuers_of_a_chained_forward``."""
    table = read_table(runs / "clean-raf", "allgathers")
    issues = table[table["event"] == "issue"]
    assert rows_of(issues[issues["phase"] == "forward"], "unit", "issuer_kind",
                   "issuer_unit") == {
        ("<root>", "own", "<root>"), ("layers.0", "own", "layers.0"),
        ("layers.1", "prefetch", "layers.0"), ("layers.2", "prefetch", "layers.1"),
        ("layers.3", "prefetch", "layers.2")}
    assert rows_of(issues[issues["phase"] == "backward"], "unit", "issuer_kind",
                   "issuer_unit") == {
        ("<root>", "own", "<root>"), ("layers.3", "own", "layers.3"),
        ("layers.2", "prefetch", "layers.3"), ("layers.1", "prefetch", "layers.2"),
        ("layers.0", "prefetch", "layers.1")}
    assert set(issues["num_bytes"]) == {BLOCK_BYTES}
    kept = read_table(runs / "clean", "allgathers")
    backward = kept[kept["phase"] == "backward"]
    assert set(backward["event"]) == {"reshard"}
    assert set(backward["unit"]) == {*FORWARD}


@real_hsdp
@pytest.mark.slow
def test_reshard_after_forward_runs_clean_with_hyper_parallels_missing_fix(runs: Path) -> None:
    """hyper_parallel 0.1 fails in backward with ``reshard_after_forward=True`` on any process
    group (its re-gather bumps the version counter of a parameter forward saved; README, and
    ``hsdp_cases.preserve_version_counter``). With the fix FSDP2 has applied in the job, it
    trains to the parameters ``False`` gives (same data, same seed), every check is clean,
    and the wrong backward edge is found (``test_wrong_backward_edge``)."""
    assert len(findings(runs / "clean-raf")) == 0
    settings = read_table(runs / "clean-raf", "settings")
    assert set(settings.loc[settings["setting"] == "reshard_after_forward", "value"]) == {
        "true"}
    for rank in RANKS:
        raf = case_result(runs / "clean-raf", rank)["shard_sums"]
        kept = case_result(runs / "clean", rank)["shard_sums"]
        assert raf == pytest.approx(kept, rel=1e-5, abs=1e-6)


@real_hsdp
@pytest.mark.slow
def test_prefetch_of_a_pending_unit_is_redundant(runs: Path) -> None:
    """layers.0 prefetches layers.1 and layers.2: layers.1's prefetch of layers.2 finds it
    pending at every call. Dead in every micro-step: one warning per step, at its first
    no-op. FSDP2's twin: ``test_provenance.py`` (the same findings, the same message)."""
    found = findings(runs / "redundant-prefetch")
    assert set(found["check"]) == {"redundant-prefetch"}
    assert where(found, "redundant-prefetch") == {
        (rank, step, 0, "forward", "layers.1", "layers.2") for rank in RANKS
        for step in (0, 1)}
    assert found["message"].str.contains(
        "already pending (gathered by prefetch from layers.0)", regex=False).all()


@real_hsdp
@pytest.mark.slow
def test_manual_unshard_before_step_is_pending_with_its_issuer(runs: Path) -> None:
    """``layers.1.unshard()`` right before ``optimizer.step()``: a blocking gather, consumed at
    once, the unit left unsharded across the boundary. FSDP2's twin: ``test_provenance.py``."""
    found = findings(runs / "manual-unshard")
    pending = found[found["check"] == "pending-all-gather"]
    assert set(found["check"]) == {"pending-all-gather"}
    assert rows_of(pending, "rank", "step", "unit") == {
        (rank, step, "layers.1") for rank in RANKS for step in (0, 1)}
    assert pending["message"].str.contains("issued by manual unshard()", regex=False).all()
    table = read_table(runs / "manual-unshard", "allgathers")
    manual = table[table["issuer_kind"] == "manual"]
    assert rows_of(manual, "unit", "event") == {("layers.1", "issue")}
    assert manual["issuer_unit"].isna().all()


@real_hsdp
@pytest.mark.slow
def test_wrappers_are_removed_on_close(runs: Path) -> None:
    for rank in RANKS:
        observed = case_result(runs / "clean", rank)
        assert observed["wrapped_while_attached"] == 6  # root, four layers, extra
        assert observed["wrapped_after_close"] == 0


# --------------------------------------------------------------------- the memory ledger
@real_hsdp
@pytest.mark.slow
def test_keeping_forward_parameters_shows_the_excess_and_its_cause(runs: Path) -> None:
    """Four ``Linear(512, 512)`` units, ``reshard_after_forward=False``: they pile up in
    forward and stay held into backward, each resharded after its own backward. FSDP2's
    twin: ``test_unsharded.py`` (the same peaks, floors and excess)."""
    trace = fsdptrace.load(runs / "ledger-keep")
    peaks = trace.unsharded(peaks=True)
    assert len(peaks) == 2 * 2 * 2 * 2  # ranks x steps x micro-steps x phases
    assert set(peaks["peak_bytes"]) == {4 * WIDE_BYTES}
    assert set(peaks["floor_bytes"]) == {WIDE_BYTES}
    assert set(peaks["excess_bytes"]) == {3 * WIDE_BYTES}
    backward = peaks[peaks["phase"] == "backward"].iloc[0]
    assert backward["held_from_earlier"].count("forward)") == 4
    ledger = trace.unsharded()
    rank0 = ledger[(ledger["rank"] == 0) & (ledger["step"] == 0) & (ledger["micro_step"] == 0)]
    assert list(rank0["held_bytes"])[:4] == [WIDE_BYTES * k for k in (1, 2, 3, 4)]
    assert list(rank0["held_bytes"])[-1] == 0  # every gather ends in a reshard


@real_hsdp
@pytest.mark.slow
def test_resharding_after_forward_holds_one_unit(runs: Path) -> None:
    """With ``reshard_after_forward=True`` (``-raf``) one unit at a time in both phases.
    FSDP2's twin holds two in backward: its implicit backward prefetch gathers the next unit
    while one runs; hyper_parallel has no implicit prefetch, so the floor is one unit."""
    peaks = fsdptrace.load(runs / "ledger-raf").unsharded(peaks=True)
    assert set(peaks["peak_bytes"]) == {WIDE_BYTES}
    assert (peaks["excess_bytes"] == 0).all() and (peaks["held_from_earlier"] == "").all()


@real_hsdp
@pytest.mark.slow
def test_unsharded_excess_warns_with_its_cause_and_not_when_resharding(runs: Path) -> None:
    """Check 13 as on FSDP2 (``test_unsharded.py``): one warning per rank and step, its worst
    pass, 3 units above the floor, naming the setting that keeps them."""
    assert not len(fsdptrace.analyze(runs / "ledger-raf", checks=["unsharded-excess"]).findings)
    found = fsdptrace.analyze(runs / "ledger-keep", checks=["unsharded-excess"]).findings
    assert set(found["severity"]) == {"warning"}
    assert sorted(zip(found["rank"], found["step"], strict=True)) == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert set(found["bytes"]) == {3 * WIDE_BYTES}
    message = found["message"].iloc[0]
    assert "reshard_after_forward=False" in message and "held from an earlier pass" in message


@real_hsdp
@pytest.mark.slow
def test_diff_and_chrome_trace_have_the_bytes(runs: Path) -> None:
    from fsdptrace.render.chrome_trace import chrome_trace

    changes = {c.phase: (c.bytes_a, c.bytes_b) for c in fsdptrace.diff(
        runs / "ledger-raf", runs / "ledger-keep").allgather_bytes}
    assert changes["forward peak unsharded"] == (WIDE_BYTES, 4 * WIDE_BYTES)
    assert changes["backward peak unsharded"] == (WIDE_BYTES, 4 * WIDE_BYTES)
    trace = fsdptrace.load(runs / "ledger-keep")
    counters = [e for e in chrome_trace(trace, fsdptrace.analyze(trace).findings)["traceEvents"]
                if e["ph"] == "C"]
    assert {e["pid"] for e in counters} == {0, 1}
    assert max(e["args"]["bytes"] for e in counters) == 4 * WIDE_BYTES


@real_hsdp
@pytest.mark.slow
@pytest.mark.parametrize("case", ["clean", "clean-raf", "clean-replicated"])
def test_collectives_are_numbered_as_the_group_counts_them(runs: Path, case: str) -> None:
    """hyper_parallel issues one collective per sharded parameter (two per Block: weight and
    bias). On the 1-D mesh: one all-gather row per parameter gather the job counted itself,
    one reduce-scatter per parameter and micro-step issued by ``post_backward``, no all-reduce;
    ``-raf`` adds the backward re-gathers. On the 2-D mesh of 2 replicas of 1 shard
    (``-replicated``, observed: the gathers are local copies on the 1-rank shard group, whose
    counter stays 0) only the gradients' all-reduces, one per parameter and micro-step, on the
    replicate group. Numbered locally, each rank's rows on a group run without a gap up to
    what the group's own counter read after training (observed: nothing else runs on these
    groups); both ranks issued the same collectives under the same numbers. Each all-gather
    names the issuer provenance gave its unit's gather (the same stack read, past
    provenance's wrapper). FSDP2's twin: ``test_records_v3_collectives.py`` (a row per unit)."""
    run_dir = runs / case
    rows = read_table(run_dir, "collectives").sort_values("seq")
    reduction = "all_reduce" if case == "clean-replicated" else "reduce_scatter"
    assert set(rows["kind"]) == ({reduction} if case == "clean-replicated"
                                 else {"all_gather", reduction})
    num_micro_steps = len(PASSES) // len(RANKS)
    sequences = {}
    for rank in RANKS:
        mine = rows[rows["rank"] == rank]
        result = case_result(run_dir, rank)
        for group, numbers in mine.groupby("group")["collective_seq"]:
            assert list(numbers) == list(range(numbers.iloc[0], numbers.iloc[0] + len(numbers)))
            assert numbers.iloc[-1] == result["group_numbers"][str(group)]
        unused = set(result["group_numbers"]) - {str(g) for g in mine["group"]}
        assert all(result["group_numbers"][g] == 0 for g in unused)
        gathers = mine[mine["kind"] == "all_gather"].groupby("unit").size() // 2
        if case != "clean-replicated":
            assert gathers.to_dict() == result["all_gathers"]
        reduced = mine[mine["kind"] == reduction]
        assert reduced.groupby("unit").size().to_dict() == {u: 2 * num_micro_steps
                                                            for u in FORWARD}
        assert set(reduced["issuer_kind"]) == {"post_backward"}
        assert (reduced["unit"] == reduced["issuer_unit"]).all()
        sequences[rank] = list(zip(mine["collective_seq"], mine["unit"], mine["kind"],
                                   strict=True))
    assert sequences[0] == sequences[1]
    issued = read_table(run_dir, "allgathers").query("event == 'issue'")
    key = ["rank", "step", "micro_step", "unit", "issuer_kind", "issuer_unit"]
    gathered = rows[rows["kind"] == "all_gather"].fillna({"issuer_unit": ""})
    if case != "clean-replicated":
        by_provenance = issued.fillna({"issuer_unit": ""}).groupby(key).size() * 2
        assert gathered.groupby(key).size().to_dict() == by_provenance.to_dict()
    if case == "clean-raf":  # re-gathered in backward: by the unit, or prefetched one back
        assert set(gathered.loc[gathered["phase"] == "backward", "issuer_kind"]) == {
            "own", "prefetch"}


@real_hsdp
@pytest.mark.slow
def test_zero_code_record_of_torchrun(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items() if k not in launcher}
    env = record_env(run_dir, base_env={**base, "OMP_NUM_THREADS": "1"})
    cli = [sys.executable, "-m", "fsdptrace_cli.main"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", str(SCRIPT), "--zero-code"]
    done = subprocess.run([*cli, "record", "--run-dir", str(run_dir), "--", *torchrun],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: no findings across 2 of 2 ranks" in done.stdout
    assert set(read_table(run_dir, "meta")["backend"]) == {"hsdp"}
    assert orders(run_dir) == {(*p, ph): FORWARD if ph == "forward" else BACKWARD
                               for p in PASSES for ph in ("forward", "backward")}


def _rows(frame: pd.DataFrame, columns: list[str] = FINDING_COLUMNS) -> set[tuple]:
    return {tuple(None if pd.isna(v) else v for v in row)
            for row in frame[columns].astype(object).itertuples(index=False)}


# --------------------------------------------------------------------- missing attributes
def test_each_missing_attribute_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    """A scheduler with none of the attributes the backend reads (a future or foreign
    release): one warning per attribute, over every step, and the order is still recorded."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    for module in (model[0], model):
        module.hsdp_scheduler = types.SimpleNamespace()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fsdptrace.attach(model, run_dir=tmp_path, optimizer=optimizer, rank=0,
                              world_size=1) as recorder:
            for _ in range(3):
                model(torch.ones(2, 4)).sum().backward()
                optimizer.step()
            settings = recorder.backend.settings(recorder.units[1])
    ours = [str(w.message) for w in caught if "fsdptrace: HSDP unit" in str(w.message)]
    missing = sorted(m.split(" has no ", 1)[1].split(",", 1)[0] for m in ours)
    assert missing == sorted(["hsdp_state", "forward_prefetch_cells", "backward_prefetch_cells",
                              "scheduler_ctx", "reshard_after_forward"])
    assert set(settings.values()) == {None}
    assert orders(tmp_path)[(0, 2, 0, "forward")] == ["<root>", "0"]


# --------------------------------------------------------------------- the reference's layout
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _param(model: Model, index: int) -> fake_hsdp.HSDPParam:
    return fake_hsdp.scheduler(model.layers[1]).hsdp_state.hsdp_params[index]


def fused_handle(model: Model) -> None:
    fake_hsdp.bucket(model.layers[1]).all_gather_result = fake_hsdp.AllGatherResult(object())


def fused_completed(model: Model) -> None:
    fake_hsdp.bucket(model.layers[1]).all_gather_result = fake_hsdp.AllGatherResult(None)


def param_handle(model: Model) -> None:
    _param(model, 0).allgather_comm_ctx.allgather_handle = object()


def param_output(model: Model) -> None:
    _param(model, 1).allgather_comm_ctx.allgather_output = torch.zeros(8)


def param_handle_and_output(model: Model) -> None:
    ctx = _param(model, 2).allgather_comm_ctx
    ctx.allgather_handle = object()
    ctx.allgather_output = torch.zeros(8)


# Planted right before optimizer.step(): what the reference reports for each (its section
# "unconsumed parameter all-gather exists at the optimizer boundary" is our check 3).
LAYOUT_CASES: dict[str, tuple[Callable[[Model], None], tuple[str, ...]]] = {
    "fused-bucket-handle": (fused_handle, ("layers.1:", "fused_bucket[0]", "handle=set")),
    "fused-bucket-completed": (fused_completed,
                               ("layers.1:", "fused_bucket[0]", "completed-not-consumed")),
    "param-handle": (param_handle, ("layers.1:", "layers.1.fc1.weight", "handle=set")),
    "param-output": (param_output, ("layers.1:", "layers.1.fc1.bias", "output=not-consumed")),
    "param-handle-and-output": (param_handle_and_output, (
        "layers.1:", "layers.1.fc2.weight", "handle=set, output=not-consumed")),
}


def train_fake(run_dir: Path, plant: Callable[[Model], None]) -> Any:
    """One fake-HSDP step with live raising; returns the exception it raised."""
    torch.manual_seed(0)
    model = Model()
    fake_hsdp.shard(model, LAYERS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(LifecycleError) as raised, fsdptrace.attach(
            model, run_dir=run_dir, optimizer=optimizer, raise_on_violation=True, rank=0,
            world_size=1):
        model(torch.arange(8) % 16).pow(2).mean().backward()
        plant(model)
        optimizer.step()
    return raised.value


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_the_reference_layout_is_read_live_and_offline(case: str, tmp_path: Path) -> None:
    """hyper_parallel 0.1 keeps no buckets nor comm contexts: only a fake can plant them."""
    plant, fragments = LAYOUT_CASES[case]
    error = train_fake(tmp_path, plant)
    lines = [line for line in str(error).splitlines() if line.startswith("  - ")]
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), str(error)
    assert "pending-all-gather (" in str(error)
    offline = fsdptrace.analyze(tmp_path).findings
    assert _rows(offline) == _rows(error.findings) == _rows(read_table(tmp_path, "findings"))

