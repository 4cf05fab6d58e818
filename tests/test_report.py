"""``fsdptrace report``: the HTML page on every real scenario, big runs, escaping, a browser."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from io import StringIO
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from fsdptrace_cli.main import cli

import fsdptrace
from fsdptrace import schema
from fsdptrace.render import html_report
from fsdptrace.render.text import verdict
from fsdptrace.trace import Trace
from tests.conftest import NORMAL_SCENARIOS

ALL_SCENARIOS = [*NORMAL_SCENARIOS, "killed-rank"]
CHROMIUM = Path("/usr/bin/chromium")
DATA_RE = re.compile(r'<script type="application/json" id="fsdptrace-data">(.*?)</script>', re.S)


def embedded(page: str) -> dict:
    match = DATA_RE.search(page)
    assert match, "no embedded data"
    return json.loads(match.group(1))


def write_report(run_dir: Path, out: Path, *extra: str) -> str:
    result = CliRunner().invoke(cli, ["report", str(run_dir), "-o", str(out), "-j", "1", *extra])
    assert result.exit_code == 0, result.output
    return out.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ALL_SCENARIOS)
def test_report_on_every_scenario(scenario_runs: Path, tmp_path: Path, name: str) -> None:
    run_dir = scenario_runs / name
    page = write_report(run_dir, tmp_path / "r.html")
    findings = fsdptrace.analyze(run_dir).findings
    trace = fsdptrace.load(run_dir)
    assert verdict(findings, num_ranks=len(trace.ranks), world_size=trace.world_size) in page
    data = embedded(page)
    assert [s["step"] for s in data["steps"]] == trace.steps
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page
    if len(findings):
        first = int(findings["step"].min())
        assert data["default_step"] == first
        step = next(s for s in data["steps"] if s["step"] == first)
        assert len(step["marks"]) == int((findings["step"] == first).sum())
    for check in set(findings["check"]):
        assert f"<b>{check}</b>" in page


def test_rank_divergence_orders_side_by_side(scenario_runs: Path) -> None:
    trace = fsdptrace.load(scenario_runs / "rank-divergence")
    data = html_report.document(trace, fsdptrace.analyze(trace).findings)
    divergences = data["steps"][0]["divergences"]
    assert {(d["micro"], d["phase"]) for d in divergences} == {
        (m, p) for m in (0, 1) for p in ("forward", "backward")
    }
    forward = next(d for d in divergences if d["phase"] == "forward" and d["micro"] == 0)
    reference, diverging = forward["columns"]
    assert (reference["label"], reference["reference"]) == ("0", True)
    assert diverging["label"] == "1" and diverging["first_diff"] == 2
    units = data["units"]
    assert units[reference["order"][2]] == "layers.1" and units[diverging["order"][2]] == "layers.2"


def test_prefetch_edges_are_embedded_with_the_order(scenario_runs: Path) -> None:
    trace = fsdptrace.load(scenario_runs / "wrong-forward-prefetch")
    data = html_report.document(trace, fsdptrace.analyze(trace).findings)
    (group,) = data["steps"][0]["groups"]
    units = data["units"]
    edges = {(units[s], p, units[t]) for s, p, t in group["edges"]}
    assert ("layers.2", 0, "layers.1") in edges and ("layers.1", 0, "layers.2") in edges
    assert group["label"] == "0-1" and group["num_ranks"] == 2


def test_stalled_run_says_where_each_rank_stopped(scenario_runs: Path) -> None:
    run_dir = scenario_runs / "killed-rank"
    findings = fsdptrace.analyze(run_dir).findings
    stops = {s["ranks"]: s["where"] for s in html_report.stops(findings)}
    assert stops["1"] == "step 2 · micro-step 0 · forward · layers.3"
    assert set(stops) == {"0", "1"}


def synthetic_trace(
    *,
    num_ranks: int,
    num_units: int,
    swap_rank: int | None = None,
    names: list[str] | None = None,
    num_steps: int = 1,
) -> Trace:
    """A trace shaped like a real recording, built in memory for sizes no test job reaches."""
    names = names or ["<root>"] + [f"layers.{i}" for i in range(num_units - 1)]
    rows = []
    for rank in range(num_ranks):
        order = list(names)
        if rank == swap_rank:
            order[1], order[2] = order[2], order[1]
        seq = 0
        for step in range(num_steps):
            for phase, units in (("forward", order), ("backward", order[:1] + order[:0:-1])):
                for unit in units:
                    seq += 1
                    rows.append((rank, seq, 1_000_000 * seq + rank, step, 0, phase, unit))
    events = pd.DataFrame(
        rows, columns=["rank", "seq", "t_ns", "step", "micro_step", "phase", "unit"]
    ).astype({"phase": "category", "unit": "category"})
    ranks = range(num_ranks)
    meta = pd.DataFrame({"rank": list(ranks), "world_size": num_ranks, "host": "h", "pid": 1})
    meta["pid"] = meta["rank"] + 100
    units = pd.DataFrame(
        [(r, u, 0, u, "Block", u == names[0], 1, 1, [u + ".w"]) for r in ranks for u in names],
        columns=["rank", *schema.UNITS.names],
    )
    markers = pd.DataFrame(
        [(r, 10**6, 10**12, num_steps - 1, 0, schema.MARKER_CLOSE, 0, "") for r in ranks],
        columns=["rank", *schema.MARKERS.names],
    )
    prefetch = pd.DataFrame(
        [(r, 0, 0, names[1], "forward", names[2], 0) for r in ranks],
        columns=["rank", *schema.PREFETCH.names],
    )
    empty = {
        name: pd.DataFrame(columns=["rank", *schema.TABLES[name].names])
        for name in ("gradients", "pending", "findings")
    }
    return Trace(
        run_dir=Path("synthetic"),
        meta=meta,
        units=units,
        events=events,
        markers=markers,
        prefetch=prefetch,
        **empty,
    )


def test_big_run_is_aggregated_and_bounded() -> None:
    trace = synthetic_trace(num_ranks=512, num_units=80, swap_rank=300, num_steps=2)
    findings = fsdptrace.analyze(trace).findings
    assert set(findings["check"]) == {"rank-divergence", "prefetch-order"}
    out = StringIO()
    html_report.render(trace, findings, out, run_dir="synthetic", max_steps=1)
    page = out.getvalue()
    data = embedded(page)
    assert len(data["steps"]) == 1
    step = data["steps"][0]
    assert [g["label"] for g in step["groups"]] == ["0-299,301-511", "300"]
    assert len(step["lanes"]) == html_report.MAX_RANK_LANES
    assert 300 in {lane["rank"] for lane in step["lanes"]}
    assert len(page) < 2_000_000


def test_names_from_the_trace_are_escaped() -> None:
    evil = "</script><img src=x onerror=alert(1)>\u2028&amp;"
    trace = synthetic_trace(
        num_ranks=2, num_units=4, swap_rank=1, names=["<root>", evil, "layers.1", "layers.2"]
    )
    out = StringIO()
    html_report.render(trace, fsdptrace.analyze(trace).findings, out, run_dir="<b>dir</b>")
    page = out.getvalue()
    assert "<img" not in page and "<b>dir" not in page
    block = DATA_RE.search(page)
    assert block and "\u2028" not in block.group(1)  # raw, it ends a line inside <script>
    assert page.count("</script>") == 2  # the JSON block and the script itself
    assert evil in embedded(page)["units"]


def test_report_bad_run_dir_is_one_line_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["report", str(tmp_path / "nope"), "-o", str(tmp_path / "r.html")]
    )
    assert result.exit_code == 2
    assert result.output.startswith("fsdptrace: error:") and result.output.count("\n") == 1
    assert not (tmp_path / "r.html").exists()


def test_report_help_has_an_example() -> None:
    result = CliRunner().invoke(cli, ["report", "--help"])
    assert result.exit_code == 0 and "Example:" in result.output and "--max-steps" in result.output


def chromium_dom(page: Path) -> tuple[str, str]:
    """Load ``page`` in headless chromium; the DOM after scripts ran, and its log."""
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [
                str(CHROMIUM),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--enable-logging=stderr",
                "--v=0",
                "--dump-dom",
                page.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, done.stderr


@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs Debian's chromium at /usr/bin/chromium "
    "(apt-get install chromium; .ci/run installs it)",
)
@pytest.mark.parametrize("name", ["rank-divergence", "wrong-forward-prefetch", "killed-rank"])
def test_report_in_a_real_browser(scenario_runs: Path, tmp_path: Path, name: str) -> None:
    page = tmp_path / "report.html"
    write_report(scenario_runs / name, page)
    dom, log = chromium_dom(page)
    assert "CONSOLE(" not in log, log
    assert len(re.findall(r'<g class="lane" [^>]*data-rank="\d+"', dom)) == 2
    assert 'id="edges-svg"' in dom and 'class="mark"' in dom
    if name == "rank-divergence":
        assert 'class="first-diff"' in dom and "rank-divergence" in dom
    if name == "wrong-forward-prefetch":
        assert 'class="edge-bad"' in dom and 'class="edge-ok"' in dom
    if name == "killed-rank":
        assert "Where each rank stopped" in dom
