"""Collectives with sequence numbers, their counts per pass, and the Flight Recorder (contract v3).

Found by experiment on torch 2.13 with gloo: ``ProcessGroup._get_sequence_number_for_group()``
counts the collectives issued on the group, so the one FSDP2 is about to issue gets that plus
one, the Flight Recorder's ``collective_seq_id``; FSDP2 on 2 ranks issues per unit one
all-gather in forward, one in backward (but for the root, which it does not reshard after
forward) and one reduce-scatter.
``TORCH_FR_BUFFER_SIZE`` turns the Flight Recorder on for gloo; every entry stays
``scheduled`` and a finished one is ``retired``; ``_dump_fr_trace_json`` returns bytes.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

import fsdptrace
from fsdptrace.checks import stalled_rank
from fsdptrace.checks.kernel.collective_counts import COLUMNS, collective_count_differences
from fsdptrace.reading import flight_recorder
from fsdptrace.store.fatal_signals import FR_PATTERN
from tests.jobs import REPO, kill_all, run_ranks, start_ranks
from tests.jobs_scripts.tables import read_folded
from tests.test_endings_jobs import SCRIPT as ENDING_SCRIPT
from tests.test_endings_jobs import _wait_truth

SCRIPT = REPO / "tests" / "jobs_scripts" / "records_params.py"
UNITS = ["<root>", "embed,head", "layers.0", "layers.1", "layers.2"]


def _passes(rows: list[tuple[int, int, str, str]]) -> pd.DataFrame:
    """A ``collectives`` table of (rank, step, unit, kind) rows, one forward pass per step."""
    frame = pd.DataFrame(rows, columns=["rank", "step", "unit", "kind"])
    return frame.assign(seq=range(len(frame)), micro_step=0, phase="forward", group="0",
                        collective_seq=0)


def test_counts_name_the_collective_without_partner() -> None:
    """Three ranks, rank 2 skips ``b``'s all-gather: one row, for rank 2, naming ``b``."""
    units = ["a", "b", "c"]
    rows = [(r, 0, u, "all_gather") for r in range(3) for u in units if (r, u) != (2, "b")]
    rows += [(r, 1, u, "all_gather") for r in range(3) for u in units]  # step 1 is even
    found = collective_count_differences(_passes(rows))
    assert found.to_dict("records") == [
        {"step": 0, "micro_step": 0, "phase": "forward", "group": "0", "rank": 2, "count": 2,
         "others": "rank 0: 3, rank 1: 3", "unit": "b", "kind": "all_gather", "index": 1}]


def test_counts_without_majority_give_every_side() -> None:
    """Two ranks: neither is called the outlier; both rows name the unpaired collective."""
    rows = [(0, 0, u, "all_gather") for u in ("a", "b")] + [(1, 0, "a", "all_gather")]
    found = collective_count_differences(_passes(rows))
    assert list(found["rank"]) == [0, 1]
    assert list(found["others"]) == ["rank 1: 1", "rank 0: 2"]
    assert set(found["unit"]) == {"b"}
    assert list(collective_count_differences(_passes(rows[:2] + rows[:0]))) == COLUMNS


def test_counts_take_the_majority_as_every_cross_rank_check_does() -> None:
    """Four ranks issuing 3, 3, 2 and 1 all-gathers: 3 is the most common count
    (``majority.against_majority``), so ranks 2 and 3 are reported, each against rank 0; two
    sides of two ranks each have no majority, and every rank is compared with the other side,
    never with a rank that issued as many as itself."""
    units = ["a", "b", "c"]
    plural = [(r, 0, u, "all_gather") for r, n in enumerate((3, 3, 2, 1)) for u in units[:n]]
    found = collective_count_differences(_passes(plural))
    assert list(zip(found["rank"], found["unit"], found["index"], strict=True)) == [
        (2, "c", 2), (3, "b", 1)]
    tied = [(r, 0, u, "all_gather") for r, n in enumerate((3, 3, 2, 2)) for u in units[:n]]
    found = collective_count_differences(_passes(tied))
    assert list(found["rank"]) == [0, 1, 2, 3] and set(found["unit"]) == {"c"}


@pytest.mark.slow
def test_skipped_layer_issues_one_all_gather_fewer(tmp_path: Path) -> None:
    """Rank 1 skips ``layers.1`` at step 1. Step 0: every collective recorded on both ranks,
    numbered 1.. without a gap, the same unit and kind under the same number. Step 1's forward:
    rank 1 issued 4 all-gathers where rank 0 issued 5; the one without a partner is
    ``layers.1``'s. Rank 1's next all-gather (``embed,head``, backward) then meets rank 0's
    ``layers.2`` with another size and gloo aborts rank 1 (SIGABRT)."""
    results = run_ranks([str(SCRIPT), "--out", str(tmp_path), "skip"], timeout_s=150)
    assert results[1].returncode == -signal.SIGABRT, results[1].output[-2000:]
    rows = read_folded(tmp_path, "collectives", [0, 1])
    first = rows[rows["step"] == 0]
    per_rank = {r: list(zip(part["collective_seq"], part["unit"], part["kind"], strict=True))
                for r, part in first.sort_values("seq").groupby("rank")}
    assert per_rank[0] == per_rank[1]
    # The root keeps its parameters after forward (FSDP2's default for it): no backward gather.
    assert [n for n, _, _ in per_rank[0]] == list(range(1, 3 * len(UNITS)))
    kinds = first[first["rank"] == 0].groupby("kind")["unit"].agg(sorted).to_dict()
    assert kinds == {"all_gather": sorted(UNITS[1:] * 2 + ["<root>"]),
                     "reduce_scatter": sorted(UNITS)}
    assert set(first.loc[first["kind"] == "reduce_scatter", "issuer_kind"]) == {"post_backward"}
    found = collective_count_differences(rows)
    forward = found[(found["step"] == 1) & (found["phase"] == "forward")]
    assert forward[["rank", "count", "unit", "kind"]].to_dict("records") == [
        {"rank": 0, "count": 5, "unit": "layers.1", "kind": "all_gather"},
        {"rank": 1, "count": 4, "unit": "layers.1", "kind": "all_gather"}]


@pytest.mark.slow
def test_flight_recorder_dump_names_the_hung_collective(tmp_path: Path) -> None:
    """Rank 1 sleeps inside ``layers.1``'s forward at step 2; rank 0 waits in its next
    all-gather. Both get SIGTERM with the Flight Recorder on: each rank's dump is in the run
    dir, and the one collective not completed is rank 0's, named by its FSDP unit, phase and
    issuer from ``collectives``."""
    procs = start_ranks([ENDING_SCRIPT, "--out", str(tmp_path), "hang"],
                        env={"TORCH_FR_BUFFER_SIZE": "2000"})
    try:
        truth = _wait_truth(tmp_path)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=60)
    finally:
        kill_all(procs)
    assert [p.returncode for p in procs] == [-signal.SIGTERM] * 2
    run_dir = tmp_path / "run"
    for rank in (0, 1):
        assert len(list((run_dir / "dumps" / f"rank={rank}").glob(FR_PATTERN))) == 1
    entries = flight_recorder.read_dumps(run_dir)
    named = flight_recorder.not_completed(entries, read_folded(run_dir, "collectives", [0, 1]))
    assert len(named) == 1, named
    row = named.iloc[0]
    assert (row["rank"], row["step"], row["phase"], row["kind"]) == (0, truth[0], "forward",
                                                                    "all_gather")
    recorded = read_folded(run_dir, "collectives", [0])
    last = recorded.sort_values("seq").iloc[-1]
    assert (row["collective_seq"], row["unit"]) == (last["collective_seq"], last["unit"])
    assert row["description"].startswith(
        f"rank 0 never completed collective {row['collective_seq']} of group 0 = the "
        f"all-gather of {row['unit']}, issued by ")
    # The verdict quotes it on the rank that waited in it.
    found = fsdptrace.analyze(run_dir, ["stalled-rank"]).findings
    verdict = found[found["rank"] == 0]["message"].iloc[0]
    assert "Flight Recorder: " + row["description"] in verdict


def _summary(rank: int, step: int, phase: str, calls: list[str]) -> dict:
    """One stalled-rank summary row of a pass's collectives, as the map step keeps it."""
    joined = stalled_rank._SEP.join(f"{u}{stalled_rank._US}all_gather" for u in calls)
    return {"rank": rank, "kind": stalled_rank.COLLECTIVES, "step": step, "micro_step": 0,
            "phase": phase, "position": 0, "unit": joined, "group": "0"}


def test_verdict_names_a_rank_that_issued_one_collective_fewer() -> None:
    """Three ranks ran the same units in the same order, but rank 2 issued one all-gather fewer
    in step 0's forward (a unit that gathered nothing: e.g. another reshard setting): the cause
    is the count, with rank 2 outside the majority and the all-gather without a partner named.
    The stopped pass (step 1's forward, short by design) is not counted."""
    rows = [_summary(r, 0, "forward", ["a", "b", "c"] if r < 2 else ["a", "c"]) for r in range(3)]
    rows += [_summary(r, 1, "forward", ["a"] * (r + 1)) for r in range(3)]
    merged = SimpleNamespace(summaries={stalled_rank.NAME: pd.DataFrame(rows)})
    stalled = pd.DataFrame({"rank": [0, 1, 2], "step": [1, 1, 1], "micro_step": [0, 0, 0],
                            "phase": ["forward"] * 3})
    cause = stalled_rank._from_collective_counts(merged, stalled)  # type: ignore[arg-type]
    assert cause is not None
    assert (cause.ranks, cause.tied) == ((2,), False)
    assert "rank 2 issued 2 FSDP collective(s)" in cause.what
    assert "the all_gather of b" in cause.what
    clean = [_summary(r, 0, "forward", ["a", "b"]) for r in range(2)]
    merged = SimpleNamespace(summaries={stalled_rank.NAME: pd.DataFrame(clean)})
    assert stalled_rank._from_collective_counts(merged, stalled[:2]) is None  # type: ignore[arg-type]


@pytest.mark.slow
def test_sequence_numbers_are_the_groups_despite_collectives_around_the_passes(
        tmp_path: Path) -> None:
    """The recorder reads the group's counter once per pass and counts on within it. Found by
    experiment (gloo, torch 2.13): FSDP2's default mesh uses the default group, and a loss
    all-reduced between forward and backward, ``clip_grad_norm_``, an eval metric between two
    eval forwards and a barrier each advance its counter past what FSDP issued. Every row's
    ``collective_seq`` is still the counter plus one read by a wrapper just outside FSDP2's
    collective functions, and that truth is no plain count (it would be with no collective
    of the loop's own)."""
    script = REPO / "tests" / "jobs_scripts" / "collective_numbers.py"
    results = run_ranks([str(script), "--out", str(tmp_path)], timeout_s=150)
    assert all(r.returncode == 0 for r in results), [r.output[-2000:] for r in results]
    rows = read_folded(tmp_path, "collectives", [0, 1])
    for rank in (0, 1):
        truth = json.loads((tmp_path / f"result.rank{rank}.json").read_text())["truth"]
        recorded = list(rows[rows["rank"] == rank].sort_values("seq")["collective_seq"])
        assert recorded == truth
        assert truth != list(range(1, len(truth) + 1))
    assert set(rows["phase"]) == {"forward", "backward", "eval"}
