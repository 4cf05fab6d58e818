"""``views.suggest`` on real recordings: the wiring that matches the order, and the diff."""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd
import pytest

import fsdptrace
from fsdptrace.store import schema
from fsdptrace.views.suggest import (
    Suggestion,
    module_expression,
    most_common,
    prefetch_calls,
    proposed_edges,
    suggest,
    suggest_run_dir,
    write_suggestion,
)
from tests.trace_builder import ROOT, TraceBuilder, write_run_dir

LAYERS = ("<root>", "layers.0", "layers.1", "layers.2", "layers.3")
BACKWARD = ("<root>", "layers.3", "layers.2", "layers.1", "layers.0")


def actions(diff: pd.DataFrame) -> set[tuple[str, str, str, str]]:
    return set(diff.itertuples(index=False, name=None))


@pytest.mark.parametrize(("unit", "expected"), [
    ("<root>", "model"),
    ("layers.1", "model.layers[1]"),
    ("embed", "model.embed"),
    ("3", "model[3]"),
    ("part[1].layers.0", "model_parts[1].layers[0]"),
    ("part[2]", "model_parts[2]"),
    ("blocks.odd-name", "model.get_submodule('blocks.odd-name')"),
    ("embed,head", None),
    ("<untracked:Linear>", None),
])
def test_module_expression(unit: str, expected: str | None) -> None:
    assert module_expression(unit) == expected


def test_root_is_never_a_forward_target() -> None:
    edges = proposed_edges(("layers.0", "<root>", "layers.1"), ("layers.1", "<root>"))
    assert set(edges.itertuples(index=False, name=None)) == {
        ("<root>", "forward", "layers.1"),
        ("layers.1", "backward", "<root>"),
    }


def test_wrong_forward_prefetch_is_rewired(scenario_runs: Path) -> None:
    result = suggest(fsdptrace.load(scenario_runs / "wrong-forward-prefetch"))
    assert result.forward_order == LAYERS
    assert result.backward_order == BACKWARD
    assert actions(result.diff) == {
        ("<root>", "forward", "layers.0", "add"),
        ("layers.0", "forward", "layers.1", "keep"),
        ("layers.1", "forward", "layers.2", "keep"),
        ("layers.2", "forward", "layers.3", "add"),
        ("layers.2", "forward", "layers.1", "remove"),
        # The root has no backward targets: FSDP2 prefetched layers.3 from it by default.
        ("<root>", "backward", "layers.3", "implicit"),
        ("layers.1", "backward", "layers.0", "keep"),
        ("layers.2", "backward", "layers.1", "keep"),
        ("layers.3", "backward", "layers.2", "keep"),
    }


def test_wrong_backward_prefetch_is_rewired(scenario_runs: Path) -> None:
    diff = suggest(fsdptrace.load(scenario_runs / "wrong-backward-prefetch")).diff
    backward = diff[(diff["phase"] == "backward") & (diff["unit"] == "layers.1")]
    assert actions(backward) == {("layers.1", "backward", "layers.0", "add"),
                                 ("layers.1", "backward", "layers.2", "remove")}


def test_whole_text_output(scenario_runs: Path) -> None:
    out = io.StringIO()
    write_suggestion(suggest(fsdptrace.load(scenario_runs / "wrong-forward-prefetch")), out)
    assert out.getvalue() == """\
observed forward order: '<root>' -> 'layers.0' -> 'layers.1' -> 'layers.2' -> 'layers.3'
observed backward order: '<root>' -> 'layers.3' -> 'layers.2' -> 'layers.1' -> 'layers.0'

# prefetch matching the observed order (FSDP2):
model.set_modules_to_forward_prefetch([model.layers[0]])
model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])
model.layers[1].set_modules_to_forward_prefetch([model.layers[2]])
model.layers[2].set_modules_to_forward_prefetch([model.layers[3]])
model.layers[1].set_modules_to_backward_prefetch([model.layers[0]])
model.layers[2].set_modules_to_backward_prefetch([model.layers[1]])
model.layers[3].set_modules_to_backward_prefetch([model.layers[2]])

# against what is configured now:
+ forward  '<root>' -> 'layers.0'  (add)
  forward  'layers.0' -> 'layers.1'  (keep)
  forward  'layers.1' -> 'layers.2'  (keep)
+ forward  'layers.2' -> 'layers.3'  (add)
- forward  'layers.2' -> 'layers.1'  (remove)
  backward 'layers.1' -> 'layers.0'  (keep)
  backward 'layers.2' -> 'layers.1'  (keep)
  backward 'layers.3' -> 'layers.2'  (keep)

# FSDP2 already does these by default (implicit backward prefetch): nothing to add
  backward '<root>' -> 'layers.3'  (implicit)
"""


def test_untracked_target_is_removed(scenario_runs: Path) -> None:
    result = suggest(fsdptrace.load(scenario_runs / "missing-target"))
    assert ("layers.3", "forward", "adapter", "remove") in actions(result.diff)
    assert "adapter" not in result.forward_order


def test_most_common_order_wins_over_an_unstable_step(scenario_runs: Path) -> None:
    result = suggest(fsdptrace.load(scenario_runs / "order-instability"))
    assert result.forward_order == LAYERS


@pytest.mark.parametrize("read", ["loaded", "rank by rank"])
def test_a_tie_goes_to_the_lowest_rank(scenario_runs: Path, read: str) -> None:
    # rank 1 runs layers 0, 2, 1, 3 in every micro-step: as many orders as rank 0.
    run_dir = scenario_runs / "rank-divergence"
    result = suggest(fsdptrace.load(run_dir)) if read == "loaded" else suggest_run_dir(run_dir)
    assert result.forward_order == LAYERS


def test_most_common_is_the_first_seen_among_equals() -> None:
    assert most_common({"b\x1fa": 2, "a\x1fb": 3, "c": 3}) == ("a", "b")
    assert most_common({}) == ()


def test_killed_rank_cut_off_is_not_an_order(scenario_runs: Path) -> None:
    result = suggest(fsdptrace.load(scenario_runs / "killed-rank"))
    assert result.forward_order == LAYERS
    assert result.backward_order == BACKWARD


def test_grouped_unit_is_data_not_a_call() -> None:
    diff = pd.DataFrame([("embed,head", "forward", "layers.0", "add"),
                         ("layers.0", "forward", "embed,head", "remove")],
                        columns=["unit", "phase", "target", "action"])
    empty = diff.iloc[0:0, :3]
    calls = prefetch_calls(Suggestion((), (), empty, empty, diff))
    assert calls[0].startswith("unwired_forward_prefetch = ('embed,head', ['layers.0'])  # ")
    assert calls[1] == "model.layers[0].set_modules_to_forward_prefetch([])"


HOSTILE = "a,b\n__import__('os').system('echo pwned') #\x1b]52;c;AAAA\x07"


def test_hostile_names_stay_string_literals() -> None:
    """A name that would end a comment or carry escapes stays inside a Python literal."""
    diff = pd.DataFrame([(HOSTILE, "forward", "layers.0", "add"),
                         ("layers.0", "forward", HOSTILE, "keep")],
                        columns=["unit", "phase", "target", "action"])
    empty = diff.iloc[0:0, :3]
    out = io.StringIO()
    write_suggestion(Suggestion((HOSTILE, "layers.0"), (), empty, empty, diff), out)
    text = out.getvalue()
    assert "\x1b" not in text and "\n__import__" not in text
    for line in text.splitlines():
        if "__import__" in line:
            assert repr(HOSTILE) in line, line
    calls = text.split("# prefetch matching the observed order (FSDP2):\n")[1].split("\n\n")[0]
    compile(calls, "<paste>", "exec")  # valid Python that calls nothing of the name's


@pytest.mark.parametrize("unit", ["layers.\u0661", "layers.\u00b2", "import.x", "\ufb01"])
def test_odd_identifiers_use_get_submodule(unit: str) -> None:
    assert module_expression(unit) == f"model.get_submodule({unit!r})"


def test_a_rank_hung_in_an_eval_forward_keeps_its_last_pass(tmp_path: Path) -> None:
    """Every rank ran step 1 whole, then an eval forward before its optimizer step, and hung
    there: step 1's passes are complete (the stops are eval forwards), so their orders count,
    on the loaded trace and read rank by rank alike. Read without the eval forwards, every rank
    seemed stopped in step 1's backward, that order was dropped, and the tie of step 0 (two
    ranks each way) went to the order rank 0 ran first."""
    units = [ROOT, "a", "b", "c"]
    usual, swapped = [ROOT, "c", "b", "a"], [ROOT, "b", "c", "a"]
    b = TraceBuilder(world_size=4)
    for rank in range(4):
        b.meta(rank)
        for index, name in enumerate(units):
            b.unit(rank, name, is_root=index == 0)
        for step, backward in enumerate([usual if rank < 2 else swapped, swapped]):
            b.marker(rank, step, 0, schema.MARKER_MICRO_STEP)
            b.run(rank, step, 0, schema.FORWARD, units)
            b.run(rank, step, 0, schema.BACKWARD, backward)
            if step == 0:
                b.marker(rank, 0, 0, schema.MARKER_OPTIMIZER_STEP)
        b.eval_forward(rank, 1, ROOT)
    run_dir = write_run_dir(b.build(), tmp_path / "run")
    assert suggest(fsdptrace.load(run_dir)).backward_order == tuple(swapped)
    assert suggest_run_dir(run_dir).backward_order == tuple(swapped)
