"""All-gather provenance on real 2-rank FSDP2 jobs (gloo, CPU), and checks 8 and 9 on it.

One launch of ``tests/jobs_scripts/provenance_cases.py`` records every case. The job counts
FSDP's real all-gathers per unit by wrapping ``foreach_all_gather`` itself, so the recorded
``issue`` rows are compared with what FSDP did, not with what the recorder believes.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import fsdptrace
from tests.jobs import case_result
from tests.jobs_scripts.provenance_cases import DIM, MICRO_STEPS, STEPS
from tests.jobs_scripts.tables import read_table, rows_of
from tests.recordings import CATALOGUE, Recordings

pytestmark = pytest.mark.slow

CASES = CATALOGUE["provenance_cases"]
WRAPPED = [case for case in CASES if case.startswith("wrapped-")]
RANKS = (0, 1)
PASSES = {(r, s, m) for r in RANKS for s in range(STEPS) for m in range(MICRO_STEPS)}
LINEAR_BYTES = (DIM * DIM + DIM) * 4  # one Block's Linear(DIM, DIM), float32


@pytest.fixture(scope="module")
def runs(recordings: Recordings) -> Path:
    """One run dir per case, from the session's catalogue launch."""
    return recordings.catalogue("provenance_cases")


def where(findings: pd.DataFrame, check: str) -> set[tuple]:
    rows = findings[findings["check"] == check]
    return rows_of(rows, "rank", "step", "micro_step", "phase", "unit", "target")


@pytest.mark.parametrize("case", CASES)
def test_issues_are_the_all_gathers_fsdp_ran(runs: Path, case: str) -> None:
    """Per rank and unit, one ``issue`` row per real collective, no more, no less."""
    table = read_table(runs / case, "allgathers")
    for rank in RANKS:
        issues = table[(table["rank"] == rank) & (table["event"] == "issue")]
        counted = case_result(runs / case, rank)["all_gathers"]
        assert issues["unit"].value_counts().to_dict() == counted


def test_every_issue_is_consumed_or_dropped_once(runs: Path) -> None:
    """Between two issues of a group there is exactly one consume or drop."""
    table = read_table(runs / "clean-chained", "allgathers")
    life = table[table["event"].isin(["issue", "consume", "drop"])]
    for _, group in life.groupby(["rank", "unit", "group"]):
        events = list(group.sort_values("seq")["event"])
        assert events[0::2] == ["issue"] * len(events[0::2])
        assert all(e in ("consume", "drop") for e in events[1::2])


def test_issuers_of_a_chained_forward(runs: Path) -> None:
    """Each layer is gathered by the previous unit's prefetch; the first units by themselves."""
    table = read_table(runs / "clean-chained", "allgathers")
    forward = table[(table["event"] == "issue") & (table["phase"] == "forward")]
    assert rows_of(forward, "unit", "issuer_kind", "issuer_unit") == {
        ("<root>", "own", "<root>"),
        ("tok_embeddings", "own", "tok_embeddings"),
        ("layers.0", "prefetch", "tok_embeddings"),
        ("layers.1", "prefetch", "layers.0"),
        ("layers.2", "prefetch", "layers.1"),
    }
    assert set(forward.loc[forward["unit"] == "layers.0", "num_bytes"]) == {LINEAR_BYTES}


def test_clean_chained_has_no_findings(runs: Path) -> None:
    findings = fsdptrace.analyze(runs / "clean-chained").findings
    assert findings.empty, findings.to_string()


def test_second_call_prefetch_held_into_backward_is_wasted(runs: Path) -> None:
    findings = fsdptrace.analyze(runs / "embed-twice").findings
    assert where(findings, "wasted-prefetch") == {
        (r, s, m, "forward", "tok_embeddings", "layers.0") for r, s, m in PASSES}
    wasted = findings[findings["check"] == "wasted-prefetch"]
    assert wasted["severity"].eq("warning").all()
    for message in wasted["message"]:
        assert message.startswith("second call of tok_embeddings in forward prefetched layers.0")
        assert f"({LINEAR_BYTES} bytes)" in message
        assert "consumed only in step" in message and "backward after holding it" in message


def test_prefetch_of_a_pending_unit_is_redundant(runs: Path) -> None:
    """Dead at every call in every micro-step: one warning per step, at its first no-op."""
    findings = fsdptrace.analyze(runs / "redundant-prefetch").findings
    assert set(findings["check"]) == {"redundant-prefetch"}
    assert where(findings, "redundant-prefetch") == {
        (r, s, 0, "forward", "layers.1", "layers.2") for r in RANKS for s in range(STEPS)}
    assert findings["message"].str.contains(
        "already pending (gathered by prefetch from layers.0)", regex=False).all()


def test_manual_unshard_before_step_is_pending_with_its_issuer(runs: Path) -> None:
    findings = fsdptrace.analyze(runs / "manual-unshard").findings
    pending = findings[findings["check"] == "pending-all-gather"]
    assert rows_of(pending, "rank", "step", "unit") == {
        (r, s, "layers.1") for r in RANKS for s in range(STEPS)}
    assert pending["message"].str.contains("issued by manual unshard()", regex=False).all()
    table = read_table(runs / "manual-unshard", "allgathers")
    manual = table[table["issuer_kind"] == "manual"]
    assert rows_of(manual, "unit", "event") == {("layers.1", "issue")}
    assert manual["issuer_unit"].isna().all()


def test_wrappers_are_removed_on_close(runs: Path) -> None:
    for rank in RANKS:
        observed = case_result(runs / "clean-chained", rank)
        assert observed["wrapped_while_attached"] == 5  # root, embeddings, three layers
        assert observed["wrapped_after_close"] == 0


def test_summaries(runs: Path) -> None:
    trace = fsdptrace.load(runs / "embed-twice")
    per_step = trace.allgathers_per_step()
    row = per_step[(per_step["rank"] == 0) & (per_step["step"] == 0)
                   & (per_step["unit"] == "layers.0")].iloc[0]
    # Two micro-steps, each: the first call's prefetch and the second call's wasted one.
    assert (row["all_gathers"], row["prefetch"], row["num_bytes"]) == (4, 4, 4 * LINEAR_BYTES)
    held = trace.bytes_held()
    assert held.groupby("rank")["rank_held_bytes"].last().eq(0).all()
    assert held["held_bytes"].min() == 0


def issuers(table: pd.DataFrame) -> list[tuple]:
    """Every recorded ``unshard`` call, in order per rank, with its issuer (no times, no seqs)."""
    calls = table[table["event"].isin(["issue", "noop"])].sort_values(["rank", "seq"])
    columns = ["rank", "step", "micro_step", "phase", "unit", "event", "issuer_kind",
               "issuer_unit"]
    return list(calls[columns].astype(str).itertuples(index=False, name=None))


@pytest.mark.parametrize("case", WRAPPED)
def test_pass_through_wrappers_change_no_attribution(runs: Path, case: str) -> None:
    """Another tool's pass-through wrapper, on the class or the instance, installed before or
    after attach: the same issuers, the same wasted prefetch, and the wrapper still runs."""
    plain = read_table(runs / "embed-twice", "allgathers")
    wrapped = read_table(runs / case, "allgathers")
    assert issuers(wrapped) == issuers(plain)
    findings = fsdptrace.analyze(runs / case).findings
    assert where(findings, "wasted-prefetch") == {
        (r, s, m, "forward", "tok_embeddings", "layers.0") for r, s, m in PASSES}
    for rank in RANKS:
        observed = case_result(runs / case, rank)
        calls = wrapped[(wrapped["rank"] == rank) & wrapped["event"].isin(["issue", "noop"])]
        if "prefetch" in case:
            calls = calls[calls["issuer_kind"].isin(["prefetch", "implicit"])]
        assert observed["wrapper_calls"] == len(calls) > 0
        assert observed["warnings"] == []
        assert observed["theirs_kept_after_close"] is ("instance" in case or None)


def test_gather_from_no_known_path_is_other_with_one_warning(runs: Path) -> None:
    """A script calling a group's ``unshard()`` itself: issuer ``other``, said once per rank."""
    table = read_table(runs / "direct-group-unshard", "allgathers")
    other = table[table["issuer_kind"] == "other"]
    assert rows_of(other, "rank", "step", "unit", "event") == {
        (r, s, "layers.1", "issue") for r in RANKS for s in range(STEPS)}
    for rank in RANKS:
        (warning,) = case_result(runs / "direct-group-unshard", rank)["warnings"]
        assert f"rank {rank}: an all-gather of layers.1 came from <lambda>" in warning
        assert "provenance_cases.py" in warning and "issuer 'other'" in warning
