"""The watcher's rule, its options and its record, without a job (the jobs are in
tests/test_watch_jobs.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fsdptrace_cli.main import cli

from fsdptrace.errors import UsageError
from fsdptrace.store import watch_records
from fsdptrace.watch import actions, rule
from fsdptrace.watch.claim import claim
from fsdptrace.watch.loop import WatchSettings, watch
from fsdptrace.watch.probe import RankState

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


def _rank(rank: int, *, where: str = "pass", ending: str | None = None,
          micro_step_s: float = 0.0, begins: list[float] | None = None) -> RankState:
    state = RankState(rank, ending=ending)
    seq = {"pass": "last_event_seq", "eval": "last_eval_seq", "boundary": "last_boundary_seq"}
    setattr(state, seq[where], 10)
    state.micro_step_ns = [int(micro_step_s * 1e9)] if micro_step_s else []
    state.micro_steps = [(i, 0, int(t * 1e9)) for i, t in enumerate(begins or [])]
    return state


def test_hung_inside_a_pass_after_the_hang_time() -> None:
    ranks = {0: _rank(0), 1: _rank(1, where="boundary")}
    assert not rule.judge(ranks, 2.9, hang_after=3.0, idle_after=60).hung
    judged = rule.judge(ranks, 3.0, hang_after=3.0, idle_after=60)
    assert judged.hung and judged.inside == (0,)
    assert "while rank(s) 0 were inside a pass or an eval forward" in judged.reason


def test_between_steps_the_idle_time_holds() -> None:
    """Every running rank at its boundary (a checkpoint): 3x the hang time is no hang."""
    ranks = {0: _rank(0, where="boundary"), 1: _rank(1, where="boundary"),
             2: _rank(2, ending="close")}
    assert not rule.judge(ranks, 9.0, hang_after=3.0, idle_after=60).hung
    judged = rule.judge(ranks, 60.0, hang_after=3.0, idle_after=60)
    assert judged.hung and "between optimizer steps" in judged.reason


def test_an_eval_forward_is_inside() -> None:
    assert rule.judge({0: _rank(0, where="eval")}, 5, hang_after=4, idle_after=60).hung


def test_no_hang_once_every_rank_ended() -> None:
    ranks = {0: _rank(0, ending="close"), 1: _rank(1, ending="crashed")}
    judged = rule.judge(ranks, 1e6, hang_after=1, idle_after=1)
    assert not judged.hung and judged.reason == "every rank ended"


def test_the_default_hang_time_follows_the_slowest_micro_step() -> None:
    assert rule.hang_time([_rank(0, micro_step_s=0.1)], None) == rule.MIN_HANG_S
    assert rule.hang_time([_rank(0, micro_step_s=1.0), _rank(1, micro_step_s=7.0)],
                          None) == pytest.approx(rule.HANG_FACTOR * 7.0)
    assert rule.hang_time([_rank(0, micro_step_s=7.0)], 2.5) == 2.5


def test_a_mirror_lengthens_the_limits() -> None:
    ranks = {0: _rank(0)}
    assert rule.judge(ranks, 3.5, hang_after=3, idle_after=60).hung
    judged = rule.judge(ranks, 3.5, hang_after=3, idle_after=60, mirrored=True)
    assert not judged.hung and judged.limit_s == 3 + rule.MIRROR_LAG_S


def test_a_rank_late_at_every_micro_step_straggles() -> None:
    """Rank 2 begins each micro-step 0.8 s after the others (period 1 s); rank 1 jitters."""
    base = [float(i) for i in range(8)]
    ranks = {0: _rank(0, begins=base), 1: _rank(1, begins=[t + 0.05 for t in base]),
             2: _rank(2, begins=[t + 0.8 for t in base])}
    [found] = rule.stragglers(ranks)
    assert found.rank == 2 and found.late_s == pytest.approx(0.75)
    assert found.num_micro_steps == 8
    ranks[2] = _rank(2, begins=[t + 0.1 for t in base])
    assert rule.stragglers(ranks) == []


def test_stragglers_compare_wall_clocks_across_hosts() -> None:
    """Rank 1's monotonic clock is 100 s behind (another host): its offset puts it on time."""
    base = [float(i) for i in range(5)]
    ranks = {0: _rank(0, begins=base), 1: _rank(1, begins=[t - 100 for t in base])}
    assert rule.stragglers(ranks, {0: 0, 1: int(100e9)}) == []


@pytest.mark.parametrize(("text", "expected"), [
    ("report", actions.OnHang("report")), ("terminate", actions.OnHang("terminate")),
    ("exec ./notify.sh --urgent", actions.OnHang("exec", "./notify.sh --urgent")),
])
def test_on_hang_parses(text: str, expected: actions.OnHang) -> None:
    assert actions.parse_on_hang(text) == expected


@pytest.mark.parametrize("text", ["reboot", "exec", "exec  ", "terminate now", ""])
def test_a_bad_on_hang_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match="--on-hang"):
        actions.parse_on_hang(text)


def test_the_hook_gets_the_verdict_on_stdin(tmp_path: Path) -> None:
    out = tmp_path / "got.json"
    assert actions.run_hook(f"cat > {out}", {"reason": "quiet"}) == 0
    assert json.loads(out.read_text()) == {"reason": "quiet"}
    assert actions.run_hook("exit 3", {}) == 3


def test_records_round_trip_and_bad_ones_are_skipped(tmp_path: Path) -> None:
    first = watch_records.write_hang(tmp_path, {"reason": "a"})
    second = watch_records.write_hang(tmp_path, {"reason": "b"})
    assert first.name == "hang-000.json" and second.name == "hang-001.json"
    (tmp_path / "watch" / "hang-002.json").write_text("[1, 2")
    with pytest.warns(UserWarning, match="hang-002.json: not a fsdptrace hang record"):
        records = watch_records.read_hangs(tmp_path)
    assert [r["reason"] for r in records] == ["a", "b"]
    assert records[0]["version"] == watch_records.RECORD_VERSION
    assert watch_records.read_hangs(tmp_path / "nowhere") == []


def test_one_watcher_claims(tmp_path: Path) -> None:
    assert claim(tmp_path) and not claim(tmp_path) and not claim(tmp_path)


def test_a_run_that_ended_stops_the_watcher(tmp_path: Path) -> None:
    """A finished recording: the endings are read whole, the watcher returns None."""
    out, log = io.StringIO(), io.StringIO()
    settings = WatchSettings(hang_after=0.5, idle_after=0.5, poll_s=0.05)
    assert watch(SAMPLES / "clean", settings, out=out, log=log) is None
    assert out.getvalue() == "" and log.getvalue().startswith("fsdptrace: watching ")


def test_cli_watch_failure_modes(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(cli, ["watch", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    bad = runner.invoke(cli, ["watch", str(tmp_path), "--on-hang", "reboot"])
    assert bad.exit_code == 2 and "expected report, terminate or 'exec CMD'" in bad.output
    assert runner.invoke(cli, ["watch", str(tmp_path), "--hang-after", "0"]).exit_code == 2
    helped = runner.invoke(cli, ["watch", "--help"])
    assert helped.exit_code == 0 and "--on-hang" in helped.output
    record = runner.invoke(cli, ["record", "--watch", "--on-hang", "exec", "--", "true"])
    assert record.exit_code == 2 and "--on-hang exec needs a command" in record.output
