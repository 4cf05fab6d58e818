"""Rule 1 on a block reused at two depths, recorded from real FSDP2 (2 ranks, gloo, CPU).

What FSDP2 (torch 2.13) does, as recorded by ``tests/jobs_scripts/reused_block_cases.py`` and
asserted below from the ``allgathers`` table: forward runs ``embed, shared, mid, shared, late``.
With ``mid -> shared`` configured, ``shared``'s first call gathers for itself; ``mid``'s
pre-forward then issues another all-gather of ``shared`` (resharded after its first call),
``shared``'s second call finds it pending (its own unshard is a no-op) and consumes it in the
same forward. The prefetch did its work: version 2 of rule 1 reports nothing (version 1
reported "positions 3->2", since it compared against the target's first call). With
``late -> shared`` every call of ``shared`` came before ``late``: the gather waits for
backward, and rule 1 reports "positions 5->4".
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import fsdptrace
from tests.jobs_scripts.reused_block_cases import MICRO_STEPS, STEPS
from tests.recordings import CATALOGUE, Recordings

pytestmark = pytest.mark.slow

CASES = CATALOGUE["reused_block_cases"]
PASSES = {(r, s, m) for r in (0, 1) for s in range(STEPS) for m in range(MICRO_STEPS)}


@pytest.fixture(scope="module")
def runs(recordings: Recordings) -> Path:
    """One run dir per case, from the session's catalogue launch."""
    return recordings.catalogue("reused_block_cases")


def _forward_of_shared(run_dir: Path) -> pd.DataFrame:
    gathers = fsdptrace.load(run_dir).allgathers
    rows = gathers[(gathers["unit"] == "shared") & (gathers["phase"] == "forward")
                   & (gathers["event"] != "reshard")]  # when memory is freed: not provenance
    return rows.astype({c: object for c in ("event", "issuer_kind", "issuer_unit")})


def test_forward_runs_shared_twice(runs: Path) -> None:
    events = fsdptrace.load(runs / "mid-prefetches-shared").events
    for (rank, step, micro), order in events[events["phase"] == "forward"].groupby(
            ["rank", "step", "micro_step"]):
        assert list(order.sort_values("seq")["unit"].astype(str)) == [
            "<root>", "embed", "shared", "mid", "shared", "late"], (rank, step, micro)


def test_prefetch_from_mid_is_consumed_by_the_second_call(runs: Path) -> None:
    rows = _forward_of_shared(runs / "mid-prefetches-shared")
    for where, one_pass in rows.groupby(["rank", "step", "micro_step"]):
        life = one_pass.sort_values("seq")
        assert list(zip(life["event"], life["issuer_kind"].fillna(""),
                        life["issuer_unit"].fillna(""), strict=True)) == [
            ("issue", "own", "shared"), ("consume", "", ""),
            ("issue", "prefetch", "mid"), ("noop", "own", "shared"), ("consume", "", "")], where
    assert {tuple(k) for k in rows[["rank", "step", "micro_step"]].drop_duplicates()
            .itertuples(index=False)} == PASSES


def test_edge_consumed_by_a_later_call_is_not_out_of_order(runs: Path) -> None:
    findings = fsdptrace.analyze(runs / "mid-prefetches-shared").findings
    assert not (findings["check"] == "prefetch-order").any(), findings.to_string()


def test_edge_after_every_call_of_its_target_is_an_error(runs: Path) -> None:
    findings = fsdptrace.analyze(runs / "late-prefetches-shared").findings
    found = findings[findings["check"] == "prefetch-order"]
    assert {(int(r), int(s), int(m)) for r, s, m in zip(
        found["rank"], found["step"], found["micro_step"], strict=True)} == PASSES
    assert set(found["unit"]) == {"late"} and set(found["target"]) == {"shared"}
    assert set(found["severity"]) == {"error"}
    assert list(found["position"].unique()) == [5]
    assert list(found["target_position"].unique()) == [4]
    assert found["message"].str.contains("at positions 5->4 in forward").all()
    # FSDP2 issues the gather after shared's last call; it waits for backward.
    rows = _forward_of_shared(runs / "late-prefetches-shared")
    late = rows[rows["issuer_unit"] == "late"]
    assert len(late) == len(PASSES) and set(late["event"]) == {"issue"}
