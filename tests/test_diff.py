"""``fsdptrace diff`` on real recordings: the shipped samples, and model variants recorded once.

The variants (a layer fewer, the layers renamed, one layer not resharded after forward) come
from one 2-rank FSDP2 job of ``tests/jobs_scripts/diff_variants.py``.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from fsdptrace_cli.main import cli

import fsdptrace
from fsdptrace.render.diff_report import render_text
from fsdptrace.views.run_diff import EdgeChange, OrderChange, SettingChange, UnitChange
from tests.jobs import REPO
from tests.recordings import Recordings

SAMPLES = REPO / "sample_traces"
CLEAN = SAMPLES / "clean"


def invoke(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, ["diff", *(str(a) for a in args)], catch_exceptions=False)


@pytest.fixture(scope="module")
def variants(recordings: Recordings) -> Path:
    """``diff_variants.py``'s run dirs, from the session's catalogue."""
    return recordings.catalogue("diff_variants")


def test_a_run_against_itself_is_the_same() -> None:
    result = invoke(CLEAN, CLEAN)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == (
        "fsdptrace diff: SAME: no change in FSDP structure or findings")


def test_a_changed_prefetch_edge_is_named() -> None:
    result = invoke(CLEAN, SAMPLES / "wrong-forward-prefetch")
    assert result.exit_code == 1
    assert "  - layers.2 -> layers.3 (forward), removed  [all ranks]\n" in result.output
    assert "  + layers.2 -> layers.1 (forward), added  [all ranks]\n" in result.output
    assert ("  + prefetch-order (error) layers.2 -> layers.1: appeared, 0 -> 8 findings\n"
            in result.output)


def test_first_order_difference_per_phase_and_rank() -> None:
    run = fsdptrace.diff(CLEAN, SAMPLES / "rank-divergence")
    assert not run.same
    assert run.orders == (
        OrderChange("forward", 2, "layers.1", "layers.2", 5, 5, ranks=(1,)),
        OrderChange("backward", 2, "layers.2", "layers.1", 5, 5, ranks=(1,)),
    )


def test_steps_choose_the_micro_step_compared() -> None:
    order_instability = SAMPLES / "order-instability"
    assert fsdptrace.diff(CLEAN, order_instability).orders == ()  # step 0 ran in order
    later = fsdptrace.diff(CLEAN, order_instability, steps="1")
    assert later.micro_step_a == later.micro_step_b == (1, 0)
    assert [o.phase for o in later.orders] == ["forward", "backward"]


def test_fixed_findings_disappear() -> None:
    run = fsdptrace.diff(SAMPLES / "missing-target", CLEAN)
    assert {(f.change, f.check) for f in run.findings} >= {("disappeared", "prefetch-order")}
    assert EdgeChange("removed", "layers.3", "forward", "adapter", (0, 1)) in run.prefetch


def test_units_removed(variants: Path) -> None:
    run = fsdptrace.diff(variants / "base", variants / "fewer")
    assert run.units == (
        UnitChange("removed", "layers.2", detail="Linear, 2 parameters, 72 elements",
                   ranks=(0, 1)),)
    assert run.settings == ()  # the removed unit's settings are part of its removal
    reverse = fsdptrace.diff(variants / "fewer", variants / "base")
    assert [(u.change, u.unit) for u in reverse.units] == [("added", "layers.2")]


def test_renamed_units_are_reported_once(variants: Path) -> None:
    result = invoke(variants / "base", variants / "renamed")
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0] == "fsdptrace diff: DIFFERENT: 3 changes"
    assert lines[4:] == ["", "Units (3)"] + [
        f"  likely renamed: layers.{i} -> blocks.{i} (same position {i + 1} and parameters)"
        "  [all ranks]" for i in range(3)]


def test_a_changed_setting(variants: Path) -> None:
    run = fsdptrace.diff(variants / "base", variants / "no-reshard")
    assert run.settings == (
        SettingChange("layers.1", "reshard_after_forward", "true", "false", (0, 1)),)
    assert [(b.phase, b.bytes_a > b.bytes_b) for b in run.allgather_bytes] == [("backward", True)]


def test_different_world_sizes_compare_the_most_common_rank() -> None:
    clean = fsdptrace.load(CLEAN)
    bigger = dataclasses.replace(clean, meta=clean.meta.assign(world_size=4))
    run = fsdptrace.diff(clean, bigger)
    assert not run.paired_by_rank and run.ranks == ()
    assert run.units == run.orders == run.prefetch == run.settings == run.allgather_bytes == ()
    # Edited metadata, not a real 4-rank run: the analysis misses ranks 2 and 3.
    assert {f.check for f in run.findings} == {"stalled-rank"}


def test_json_is_versioned_with_sections() -> None:
    result = invoke(CLEAN, SAMPLES / "config-divergence", "--format", "json")
    assert result.exit_code == 1
    doc = json.loads(result.output)
    assert doc["schema_version"] == 1 and doc["fsdptrace_version"] == fsdptrace.__version__
    assert doc["same"] is False
    assert {"change": "added", "unit": "layers.0", "phase": "forward", "target": "layers.2",
            "ranks": [1]} in doc["prefetch"]
    assert all(isinstance(doc[s], list) for s in
               ("units", "orders", "prefetch", "settings", "findings", "allgather_bytes"))


def test_markdown() -> None:
    result = invoke(CLEAN, SAMPLES / "wrong-forward-prefetch", "--format", "markdown")
    assert result.exit_code == 1
    assert result.output.startswith("# fsdptrace diff: DIFFERENT: 7 changes\n")
    assert "## Prefetch edges (2)\n" in result.output
    assert "- \\+ layers.2 -\\> layers.1 (forward), added (all ranks)\n" in result.output


def test_json_of_the_same_run() -> None:
    result = invoke(CLEAN, CLEAN, "--format", "json")
    assert result.exit_code == 0
    assert json.loads(result.output)["same"] is True


def test_unit_names_are_printed_safely() -> None:
    clean = fsdptrace.load(CLEAN)
    units = clean.units.copy()
    units["unit"] = units["unit"].astype(str).replace("adapter", "adapter\x1b]52;c;x\x07")
    run = fsdptrace.diff(clean, dataclasses.replace(clean, units=units))
    out = io.StringIO()
    render_text(run, out)
    assert "\x1b" not in out.getvalue() and "adapter\\x1b]52;c;x\\x07" in out.getvalue()


@pytest.mark.parametrize("args, fragment", [
    (["missing-dir", CLEAN], "missing-dir does not exist"),
    ([CLEAN, CLEAN, "--steps", "x"], "bad steps spec 'x'"),
    ([CLEAN, CLEAN, "--steps", "7"], "no complete micro-step within steps 7"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str | Path], fragment: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdptrace: error: ")
    assert fragment in lines[0]
