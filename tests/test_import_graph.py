"""The house stays without import circles, and its lower stages never import the higher ones.

Measured by ``tests/import_graph.py`` (``python tests/import_graph.py`` prints the figures):
every import among fsdptrace/ and cli/ modules, module-level, inside functions and under
``TYPE_CHECKING`` alike. A circle of lazy or type-only imports loads fine and still means no
module of it can be read or tested alone, so all three kinds count.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.import_graph import (
    FUNCTION,
    KINDS,
    MODULE,
    TYPE_ONLY,
    arrows,
    circles,
    edges,
    imported_names,
    module_files,
)

# The stages, lowest first: the order of the folders in fsdptrace/ (docs/architecture.md). A
# stage imports only its own and lower ones, at module level, inside functions and for types.
# The recorder sits above the checks because its live option (``attach(raise_on_finding=...)``)
# *is* the checks run on this rank's rows before the optimizer step; below them all, the run
# dir's format, which the recorder writes and every reader reads.
STAGES = (
    ("base", ("fsdptrace.errors", "fsdptrace.version")),
    ("store", ("fsdptrace.store",)),
    ("reading", ("fsdptrace.reading",)),
    ("checks", ("fsdptrace.checks",)),
    ("record", ("fsdptrace.record",)),
    ("analysis", ("fsdptrace.analysis",)),
    ("views", ("fsdptrace.views",)),
    ("render", ("fsdptrace.render",)),
    ("watch", ("fsdptrace.watch",)),
    ("facade", ("fsdptrace",)),
    ("cli", ("fsdptrace_cli",)),
)
# What the training process must never load: what reads run dirs back and pandas (a job that
# only records never pays for them); its live option only inside the functions that run when
# it is on, or for types.
LIVE = "fsdptrace.record.live"
TRAINING_NEVER_LOADS = ("fsdptrace.reading", "fsdptrace.checks", "fsdptrace.analysis",
                        "fsdptrace.views", "fsdptrace.render", "fsdptrace.watch",
                        "fsdptrace_cli", "pandas")


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def stage_of(module: str) -> int:
    """The index in STAGES of the stage that holds ``module`` (the longest prefix wins)."""
    best = max(((len(prefix), level) for level, (_, prefixes) in enumerate(STAGES)
                for prefix in prefixes if _under(module, (prefix,))), default=None)
    assert best is not None, f"{module} is in no stage: add its folder to STAGES"
    return best[1]


def test_every_module_sits_in_one_stage_folder() -> None:
    """No loose module at the top: each one's folder says which stage it belongs to."""
    loose = [m for m, path in module_files().items() if m.count(".") == 1
             and m.startswith("fsdptrace.") and path.name != "__init__.py"
             and m not in ("fsdptrace.errors", "fsdptrace.version")]
    assert loose == []
    for module in module_files():
        stage_of(module)


def test_a_lower_stage_never_imports_a_higher_one() -> None:
    upward = [f"{a.source} -> {a.target} ({a.kind}, line {a.line})" for a in arrows()
              if stage_of(a.target) > stage_of(a.source)]
    assert upward == [], "imports from a lower stage up:\n" + "\n".join(upward)


def test_no_import_circle_of_any_kind() -> None:
    found = arrows()
    every = circles(edges(found, KINDS))
    ties = [f"{a.source} -> {a.target} ({a.kind}, line {a.line})" for a in found
            if any(a.source in c and a.target in c for c in every)]
    assert every == [], "import circles:\n" + "\n".join(ties)


def test_record_never_imports_the_analysis_side() -> None:
    leaks = [a for a in imported_names() if a.source.startswith("fsdptrace.record")
             and _under(a.target, TRAINING_NEVER_LOADS)
             and (a.source != LIVE or a.kind == MODULE)]
    assert leaks == []


def test_the_live_option_is_where_the_recorder_meets_the_checks() -> None:
    """The exception above is real (the live checks are the same code as the analyzer's)."""
    live = {a.target for a in imported_names() if a.source == LIVE and a.kind != MODULE}
    assert "fsdptrace.checks.per_rank_findings" in live


def test_the_stage_order_can_fail() -> None:
    """The direction test above is not vacuous: a store module importing a check is caught."""
    assert stage_of("fsdptrace.store.schema") < stage_of("fsdptrace.checks.kernel.keys")
    assert stage_of("fsdptrace_cli.main") == len(STAGES) - 1
    assert stage_of("fsdptrace.watch.loop") > stage_of("fsdptrace.render.text")


def test_the_graph_sees_each_kind_of_import_and_their_circles(tmp_path: Path) -> None:
    """A made-up package whose only circle is one function-level and one type-only import:
    the measure must see it, or the tests above could not fail."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("import os\n\ndef f():\n    from pkg import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\n\nfrom pkg import c\n\n"
        "if TYPE_CHECKING:\n    from pkg.a import f\n")
    (package / "c.py").write_text("from . import b as _b\n")
    modules = {f"pkg.{p.stem}": p for p in package.glob("[abc].py")}
    found = {(a.source, a.target, a.kind) for a in arrows(modules)}
    assert found == {("pkg.a", "pkg.b", FUNCTION), ("pkg.b", "pkg.c", MODULE),
                     ("pkg.b", "pkg.a", TYPE_ONLY), ("pkg.c", "pkg.b", MODULE)}
    assert circles(edges(arrows(modules), (MODULE,))) == [["pkg.b", "pkg.c"]]
    assert circles(edges(arrows(modules), KINDS)) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_bootstrap_spells_the_run_dir_variable_as_env_does() -> None:
    """The one copy of an environment name outside ``fsdptrace.store.env``: the zero-code
    bootstrap runs where fsdptrace may not import, so it cannot import the name (read here,
    not run)."""
    from fsdptrace.record.launch import BOOTSTRAP_DIR
    from fsdptrace.store import env

    tree = ast.parse((BOOTSTRAP_DIR / "sitecustomize.py").read_text())
    spelled = {node.targets[0].id: node.value.value for node in tree.body
               if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
               and isinstance(node.value, ast.Constant)}
    assert spelled["RUN_DIR_ENV"] == env.RUN_DIR_ENV


def test_every_module_is_measured() -> None:
    modules = module_files()
    assert "fsdptrace.record.recorder" in modules and "fsdptrace_cli.main" in modules
    assert len(modules) > 100
