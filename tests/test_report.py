"""``fsdptrace report``: the HTML page on every real scenario, big runs, escaping, a browser."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from io import StringIO
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from fsdptrace_cli.main import cli

import fsdptrace
from fsdptrace.reading.trace import Trace
from fsdptrace.record.launch import record_env
from fsdptrace.render import html_report, order_compare
from fsdptrace.render.text import verdict
from fsdptrace.render.unit_spans import unit_spans
from fsdptrace.render.wall_clock import shifts
from fsdptrace.store import schema
from tests.conftest import NORMAL_SCENARIOS
from tests.jobs import REPO, assert_ok, run_ranks

ALL_SCENARIOS = [*NORMAL_SCENARIOS, "killed-rank"]
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = REPO / "docs" / "report.png"
DEMO_RUN_DIR = Path("fsdptrace_runs/demo")  # make demo's RUN_DIR
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
    compared = data["steps"][0]["comparisons"]
    assert {c["check"] for c in compared} == {"rank-divergence"}
    assert {c["title"] for c in compared} == {
        f"rank-divergence: step 0, micro-step {m}, {p}" for m in (0, 1)
        for p in ("forward", "backward")
    }
    forward = next(c for c in compared if c["title"].endswith("micro-step 0, forward"))
    reference, diverging = forward["columns"]
    assert (reference["label"], reference["reference"]) == ("ranks 0", True)
    assert diverging["label"] == "ranks 1" and diverging["first_diff"] == 2
    units = data["units"]
    assert units[reference["order"][2]] == "layers.1" and units[diverging["order"][2]] == "layers.2"


def test_order_instability_orders_side_by_side(scenario_runs: Path) -> None:
    """The changed forward order beside the rank's first recorded one, equal ranks folded."""
    trace = fsdptrace.load(scenario_runs / "order-instability")
    findings = fsdptrace.analyze(trace).findings
    data = html_report.document(trace, findings)
    flagged = findings[findings["check"] == "order-instability"]
    step = next(s for s in data["steps"] if s["step"] == int(flagged["step"].min()))
    compared = [c for c in step["comparisons"] if c["check"] == "order-instability"]
    assert len(compared) == flagged.loc[flagged["step"] == step["step"], "micro_step"].nunique()
    units = data["units"]
    for comparison in compared:
        reference, changed = comparison["columns"]
        assert reference["label"] == "ranks 0-1, step 0.0 (first)" and reference["reference"]
        first = changed["first_diff"]
        assert units[reference["order"][first]] != units[changed["order"][first]]
        assert reference["order"][:first] == changed["order"][:first]
        assert sorted(reference["order"]) == sorted(changed["order"])


def test_lanes_start_at_each_ranks_step_start_with_skew_and_recorded_ends(
    scenario_runs: Path,
) -> None:
    trace = fsdptrace.load(scenario_runs / "wrong-forward-prefetch")
    data = html_report.document(trace, fsdptrace.analyze(trace).findings)
    spans = unit_spans(trace.events, trace.allgathers, trace.backward_grads)
    shift = shifts(trace.meta)
    for step in data["steps"]:
        starts = {}
        for lane in step["lanes"]:
            mine = spans[(spans["rank"] == lane["rank"]) & (spans["step"] == step["step"])]
            assert len(lane["t"]) == len(lane["e"]) == len(mine)
            assert [e < 0 for e in lane["e"]] == mine["end_ns"].isna().tolist()
            assert all(e < 0 or e >= t for t, e in zip(lane["t"], lane["e"], strict=True))
            markers = trace.markers[(trace.markers["rank"] == lane["rank"])
                                    & (trace.markers["step"] == step["step"])]
            starts[lane["rank"]] = min(int(mine["t_ns"].min()), int(markers["t_ns"].min()))
            assert min(lane["t"]) >= 0
            assert lane["mem"][0][0] == 0 and all(b >= 0 for _, b in lane["mem"])
        wall = {r: t + shift[r] for r, t in starts.items()}
        skews = {lane["rank"]: lane["skew"] for lane in step["lanes"]}
        assert skews == {r: (w - min(wall.values())) // 1000 for r, w in wall.items()}
        assert min(skews.values()) == 0


def test_spans_made_a_rank_at_a_time_are_the_spans_of_the_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``unit_spans`` takes ranks in pieces of ``PIECE_ROWS`` begins: pieces of one rank give
    the frame one piece of all ranks gives, on a generated run of stalled and dead ranks (rows
    in journal tails) and a rank missing on disk."""
    from fsdptrace.render import unit_spans as spans_module
    from tests.synthetic import generate_tiny

    generate_tiny(tmp_path / "run")
    trace = fsdptrace.load(tmp_path / "run")
    tables = (trace.events, trace.allgathers, trace.backward_grads)
    whole = unit_spans(*tables)
    assert whole["rank"].nunique() > 2 and whole["end_ns"].notna().any()
    monkeypatch.setattr(spans_module, "PIECE_ROWS", 1)
    pd.testing.assert_frame_equal(unit_spans(*tables), whole, check_exact=True)


def test_end_clocks_past_2_to_the_53_stay_exact(tmp_path: Path) -> None:
    """``time.monotonic_ns()`` passes 2**53 on a host up ~104 days; a begin without an end (rank
    0's forwards, its reshards left out) once sent every end's clock through float64."""
    from tests.synthetic import generate_tiny

    generate_tiny(tmp_path / "run")
    trace = fsdptrace.load(tmp_path / "run")
    gathers = trace.allgathers[trace.allgathers["rank"] != 0]
    near, off = unit_spans(trace.events, gathers, trace.backward_grads), (1 << 53) + 12345
    late = unit_spans(trace.events.assign(t_ns=trace.events["t_ns"] + off),
                      gathers.assign(t_ns=gathers["t_ns"] + off),
                      trace.backward_grads.assign(t_ns=trace.backward_grads["t_ns"] + off))
    assert late["end_ns"].isna().any() and late["end_ns"].notna().any()
    assert late["end_ns"].equals(near["end_ns"] + off)


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


NEEDS_CHROMIUM = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs Debian's chromium at /usr/bin/chromium "
    "(apt-get install chromium; .ci/run installs it)",
)
# Appended to a copy of a report: acts as a person would (pointer over an empty stretch and
# over a span, a zoom click, a wheel turn, a drag) and writes what the page did into #probe.
PROBE = """<script>
window.addEventListener("load", () => {
  const out = {};
  try {
  const root = document.getElementById("timeline-svg"), box = root.getBoundingClientRect();
  const DATA = JSON.parse(document.getElementById("fsdptrace-data").textContent);
  const step = Number(document.getElementById("step-select").value);
  const sd = DATA.steps.find((s) => s.step === step);
  const lane = sd.lanes[0], g = sd.groups[lane.group];
  let full = 1;
  sd.lanes.forEach((l) => { l.t.forEach((t, k) => { full = Math.max(full, t, l.e[k]); });
    if (l.mem.length) full = Math.max(full, l.mem[l.mem.length - 1][0]);
    if (l.quiet) full = Math.max(full, l.quiet.to); });
  const width = root.width.baseVal.value, px = (t) => 190 + (t / full) * (width - 12 - 190);
  const move = (t, row) => { root.dispatchEvent(new MouseEvent("mousemove", { bubbles: true,
    clientX: box.left + px(t), clientY: box.top + 22 + (row === 0 ? 10 : 24) }));
    const tip = document.getElementById("tooltip"); return tip.hidden ? null : tip.textContent; };
  const fw = lane.t.map((t, k) => k).filter((k) => g.p[k] === 0);
  let gap = [0, -1];
  for (let i = 1; i < fw.length; i++) {
    const prev = Math.max(lane.t[fw[i - 1]], lane.e[fw[i - 1]]), size = lane.t[fw[i]] - prev;
    if (size > gap[1]) gap = [prev + size / 2, size];
  }
  out.gap_px = px(gap[1]) - px(0);
  out.tip_in_gap = move(gap[0], 0);
  // A forward span with a recorded end on the first lane (a rank cut off mid-step may have
  // none in its last step: then there is nothing to point at).
  const k = fw.find((j) => lane.e[j] >= 0);
  out.span_unit = k === undefined ? null : DATA.units[g.u[k]];
  out.tip_on_span = k === undefined ? null : move((lane.t[k] + lane.e[k]) / 2, 0);
  out.zoom_before = document.getElementById("zoom-note").textContent;
  document.getElementById("zoom-in").click();
  out.zoom_after = document.getElementById("zoom-note").textContent;
  const svg2 = document.getElementById("timeline-svg"), b2 = svg2.getBoundingClientRect();
  svg2.dispatchEvent(new WheelEvent("wheel", { bubbles: true, cancelable: true, deltaY: -100,
    clientX: b2.left + 400, clientY: b2.top + 30 }));
  out.zoom_wheel = document.getElementById("zoom-note").textContent;
  const svg3 = document.getElementById("timeline-svg"), b3 = svg3.getBoundingClientRect();
  svg3.dispatchEvent(new MouseEvent("mousedown", { bubbles: true, clientX: b3.left + 600,
    clientY: b3.top + 30 }));
  window.dispatchEvent(new MouseEvent("mousemove", { clientX: b3.left + 400,
    clientY: b3.top + 30 }));
  // A drag redraws on the next frame, or at once on release (report.js). A loaded machine's
  // headless chromium may dump the DOM before any frame comes, so a (virtual-time) timer
  // finishes the probe if no frame does; the release then draws the drag.
  let done = false;
  const finish = () => {
    if (done) return;
    done = true;
    window.dispatchEvent(new MouseEvent("mouseup", {}));
    out.zoom_dragged = document.getElementById("zoom-note").textContent;
    const pre = document.createElement("pre");
    pre.id = "probe";
    pre.textContent = JSON.stringify(out);
    document.body.appendChild(pre);
  };
  requestAnimationFrame(finish);
  setTimeout(finish, 200);
  } catch (e) {  // a probe that throws says so, instead of leaving no #probe at all
    const pre = document.createElement("pre");
    pre.id = "probe";
    pre.textContent = JSON.stringify({ error: String(e) + " at " + e.stack });
    document.body.appendChild(pre);
  }
});
</script>"""


def chromium(page: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run headless chromium on ``page`` with a throwaway profile."""
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
                *args,
                page.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def chromium_dom(page: Path) -> tuple[str, str]:
    """Load ``page`` in headless chromium; the DOM after scripts ran, and its log."""
    # Virtual time lets the page's load handlers and animation frames run before the dump.
    done = chromium(page, "--virtual-time-budget=2000", "--dump-dom")
    return done.stdout, done.stderr


def probe(page: Path) -> tuple[str, str, dict]:
    """The DOM, log and ``PROBE`` results of a copy of ``page`` with the probe appended."""
    probed = page.with_name("probed-" + page.name)
    text = page.read_text(encoding="utf-8")
    probed.write_text(text.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom, log = chromium_dom(probed)
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, log[-2000:]
    result = json.loads(html.unescape(found.group(1)))
    assert "error" not in result, result["error"]
    return dom, log, result


def shown_range(note: str) -> float:
    """Width in ms of the zoom note's "showing A to B ms of C ms"."""
    a, b = re.match(r"showing (-?[\d.]+) to (-?[\d.]+) ms", note).groups()  # type: ignore[union-attr]
    return float(b) - float(a)


def assert_timeline_works(dom: str, log: str, found: dict, num_ranks: int, *,
                          silent: bool = False) -> None:
    """``silent``: the step ends in a silence (a stalled run): the timeline runs to the ranks'
    ends, and zoomed to its middle it shows the silence, not the spans before it (the
    tooltip on a span, below, still checks those)."""
    assert "CONSOLE(" not in log, log
    assert len(re.findall(r'<g class="lane" [^>]*data-rank="\d+"', dom)) == num_ranks
    for control in ("zoom-in", "zoom-out", "zoom-reset"):
        assert f'id="{control}"' in dom
    if silent:
        assert 'class="quiet"' in dom, found
    else:  # the DOM is read zoomed in, where the view may fall before the first span (a loaded
        # machine's demo step began 0.5 s before its first unit): the probe pointed at one first
        assert 'class="span"' in dom or found["span_unit"] is not None, found
    for drawn in ('class="mem"', 'class="skew"', 'id="memory"'):
        assert drawn in dom, (drawn, found)
    labels = re.findall(r'<text [^>]*class="axis"[^>]*>([^<]*)</text>', dom)
    assert len(labels) >= 3 and len(labels) == len(set(labels)), labels
    if found["gap_px"] > 30:  # an empty stretch wide enough to point into
        assert found["tip_in_gap"] is None, found
    if found["span_unit"] is not None:
        assert found["span_unit"] in found["tip_on_span"], found
    assert shown_range(found["zoom_after"]) == pytest.approx(
        shown_range(found["zoom_before"]) / 2, rel=0.05)
    assert shown_range(found["zoom_wheel"]) < shown_range(found["zoom_after"])
    start = re.match(r"showing (-?[\d.]+)", found["zoom_wheel"]).group(1)  # type: ignore[union-attr]
    dragged = re.match(r"showing (-?[\d.]+)", found["zoom_dragged"]).group(1)  # type: ignore[union-attr]
    # Dragging the picture left shows later times, the visible width unchanged.
    assert float(dragged) > float(start)
    assert shown_range(found["zoom_dragged"]) == pytest.approx(
        shown_range(found["zoom_wheel"]), abs=0.2)


@NEEDS_CHROMIUM
@pytest.mark.parametrize(
    "name", ["rank-divergence", "order-instability", "wrong-forward-prefetch", "killed-rank"]
)
def test_report_in_a_real_browser(scenario_runs: Path, tmp_path: Path, name: str) -> None:
    page = tmp_path / "report.html"
    write_report(scenario_runs / name, page)
    dom, log, found = probe(page)
    assert_timeline_works(dom, log, found, num_ranks=2, silent=name == "killed-rank")
    if name != "killed-rank":  # whole steps: the first lane has a span to point at
        assert found["span_unit"] is not None, found
    assert 'id="edges-svg"' in dom and 'class="mark"' in dom
    if name in ("rank-divergence", "order-instability"):
        assert f'data-check="{name}"' in dom and 'class="first-diff"' in dom
    else:
        assert 'class="first-diff"' not in dom
    if name == "wrong-forward-prefetch":
        assert 'class="edge-bad"' in dom and 'class="edge-ok"' in dom
    if name == "killed-rank":
        assert "Where each rank stopped" in dom


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run ``make demo`` records: examples/train_tiny.py on 2 ranks, zero code changes."""
    run_dir = tmp_path_factory.mktemp("demo") / DEMO_RUN_DIR
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items() if k not in launcher}
    env = record_env(run_dir, base_env={**base, "OMP_NUM_THREADS": "1"})
    results = run_ranks([str(REPO / "examples" / "train_tiny.py")], env=env)
    assert_ok(results)
    return run_dir


@NEEDS_CHROMIUM
def test_demo_report_in_a_real_browser_and_its_screenshot(
    demo_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's picture is this run's report as a browser draws it, regenerated here."""
    page = tmp_path / "report.html"
    monkeypatch.chdir(str(demo_run)[: -len(str(DEMO_RUN_DIR))])  # the page names it as make does
    write_report(DEMO_RUN_DIR, page)
    dom, log, found = probe(page)
    assert_timeline_works(dom, log, found, num_ranks=2)
    assert "prefetch-order" in dom
    shot = tmp_path / "report.png"
    chromium(page, "--hide-scrollbars", "--window-size=1280,1180", f"--screenshot={shot}")
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 20_000
    shutil.copyfile(shot, SCREENSHOT)


def test_eval_divergence_orders_side_by_side() -> None:
    """Rank 1 ran one eval forward fewer in eval interval 1: its order ends early."""
    evals = pd.DataFrame(
        [(0, 1, 1, "<root>"), (0, 2, 1, "layers.0"), (0, 3, 1, "<root>"),
         (1, 1, 1, "<root>"), (1, 2, 1, "layers.0")],
        columns=["rank", "seq", "step", "unit"],
    )
    findings = pd.DataFrame({"check": ["eval-divergence"], "rank": [1], "step": [1],
                             "micro_step": [None], "phase": [None], "unit": ["<end>"]})
    units = {"<root>": 0, "layers.0": 1}
    empty_events = pd.DataFrame(columns=["rank", "seq", "step", "micro_step", "phase", "unit"])
    (compared,) = order_compare.comparisons(empty_events, evals, findings, units, 1)
    assert compared["title"] == "eval-divergence: eval forwards in eval interval 1"
    reference, short = compared["columns"]
    assert (reference["label"], reference["order"], reference["reference"]) == (
        "ranks 0", [0, 1, 0], True)
    assert (short["label"], short["order"], short["first_diff"]) == ("ranks 1", [0, 1], 2)


def test_a_rank_that_ran_no_eval_forward_gets_an_empty_column() -> None:
    """Rank 0 alone ran eval forwards (a rank-0-only validation): rank 1's order is empty and
    still drawn beside rank 0's, whichever rank the finding names (2 ranks: a tie)."""
    evals = pd.DataFrame([(0, 1, 1, "<root>"), (0, 2, 1, "layers.0")],
                         columns=["rank", "seq", "step", "unit"])
    units = {"<root>": 0, "layers.0": 1}
    empty_events = pd.DataFrame(columns=["rank", "seq", "step", "micro_step", "phase", "unit"])
    for flagged in (0, 1):
        findings = pd.DataFrame({"check": ["eval-divergence"], "rank": [flagged], "step": [1],
                                 "micro_step": [None], "phase": [None], "unit": ["<root>"]})
        (compared,) = order_compare.comparisons(empty_events, evals, findings, units, 1,
                                                ranks=[0, 1])
        columns = {c["label"]: (c["order"], c["first_diff"]) for c in compared["columns"]}
        assert columns == {"ranks 0": ([0, 1], None), "ranks 1": ([], 0)}


def test_each_stopped_rank_has_its_own_text(scenario_runs: Path) -> None:
    findings = fsdptrace.analyze(scenario_runs / "killed-rank", jobs=1).findings
    stops = html_report.stops(findings)
    assert [s["ranks"] for s in stops] == ["0", "1"]
    for stop in stops:
        assert stop["message"].startswith(f"rank {stop['ranks']} ")


# Appended to a copy of a report: zooms (wheel turns) onto the first lane's first forward span
# until bars are wide, then, for every unit label drawn on a bar, whether the bar holds it, and
# what the silences and the prefetch boxes say; written into #labels.
LABEL_PROBE = """<script>
window.addEventListener("load", () => {
  const DATA = JSON.parse(document.getElementById("fsdptrace-data").textContent);
  const step = Number(document.getElementById("step-select").value);
  const sd = DATA.steps.find((s) => s.step === step), lane = sd.lanes[0];
  const g = sd.groups[lane.group];
  const quiet = [...document.querySelectorAll("g.quiet")].map((q) => [
    q.querySelector("text").firstChild.textContent,
    q.querySelector("rect").width.baseVal.value]);
  let full = 1;
  sd.lanes.forEach((l) => { l.t.forEach((t, k) => { full = Math.max(full, t, l.e[k]); });
    if (l.mem.length) full = Math.max(full, l.mem[l.mem.length - 1][0]);
    if (l.quiet) full = Math.max(full, l.quiet.to); });
  const k = lane.t.findIndex((t, j) => g.p[j] === 0 && lane.e[j] >= 0);
  const root = document.getElementById("timeline-svg"), box = root.getBoundingClientRect();
  const width = root.width.baseVal.value;
  const x = box.left + 190 + ((lane.t[k] + lane.e[k]) / 2 / full) * (width - 12 - 190);
  const zoomed = () => document.getElementById("timeline-svg");
  for (let i = 0; i < 18; i++) {
    zoomed().dispatchEvent(new WheelEvent("wheel", { bubbles: true, cancelable: true,
      deltaY: -100, clientX: x, clientY: box.top + 30 }));
  }
  let done = false;  // on the next frame, or a timer's turn if no frame comes (see PROBE)
  const finish = () => {
    if (done) return;
    done = true;
    const bars = [...document.querySelectorAll("text.bar-label")].map((t) => [
      t.textContent, t.getComputedTextLength(), t.previousElementSibling.width.baseVal.value]);
    const pre = document.createElement("pre");
    pre.id = "labels";
    pre.textContent = JSON.stringify({ bars: bars, quiet: quiet,
      zoom: document.getElementById("zoom-note").textContent,
      boxes: [...document.querySelectorAll("#edges-svg text.unit-label")]
        .map((t) => t.firstChild.textContent) });
    document.body.appendChild(pre);
  };
  requestAnimationFrame(finish);
  setTimeout(finish, 200);
});
</script>"""


def drawn_labels(page: Path) -> dict:
    probed = page.with_name("labels-" + page.name)
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", LABEL_PROBE + "</body>"),
                      encoding="utf-8")
    dom, log = chromium_dom(probed)
    found = re.search(r'<pre id="labels">(.*?)</pre>', dom, re.S)
    assert found, log[-2000:]
    return json.loads(html.unescape(found.group(1)))


@NEEDS_CHROMIUM
def test_bars_carry_their_unit_and_boxes_their_position(demo_run: Path, tmp_path: Path) -> None:
    """The demo's first step, zoomed onto its first forward span: the bars wide enough carry
    their unit's label (``3 (Block)``), and every label drawn fits its bar (measured by the
    browser). Unzoomed, a few-ms span of a ~2 s first step is too narrow for one."""
    page = tmp_path / "report.html"
    write_report(demo_run, page)
    drawn = drawn_labels(page)
    assert drawn["bars"], drawn
    for text, text_width, bar_width in drawn["bars"]:
        assert re.fullmatch(r"\d \(Block\)|<root>", text), text
        assert text_width <= bar_width, (text, text_width, bar_width)
    assert drawn["boxes"] and all(b.startswith("pos ") for b in drawn["boxes"]), drawn["boxes"]
    assert "pos 1 · 1 (Block)" in drawn["boxes"]


@NEEDS_CHROMIUM
def test_the_silence_before_an_unclean_end_is_drawn_with_its_length(scenario_runs: Path,
                                                                   tmp_path: Path) -> None:
    """killed-rank: rank 1 is SIGKILLed mid-step 2, rank 0 then crashes in a collective. Each
    lane of step 2 shows the time from its rank's last event to its end, with its length."""
    page = tmp_path / "report.html"
    write_report(scenario_runs / "killed-rank", page)
    drawn = drawn_labels(page)
    texts = sorted(text for text, _ in drawn["quiet"])
    assert len(texts) == 2, drawn
    # The survivor crashes when gloo sees its peer gone, or, on a slow machine, is still
    # blocked when the job's time runs out and is killed too.
    ends = r"(crashed \(RuntimeError|ended without a recorded ending)"
    assert all(re.match(r"silent \d+(\.\d)? (ms|s), then " + ends, t) for t in texts), texts
    assert all(width > 10 for _, width in drawn["quiet"])
