"""``fsdptrace diff RUN_A RUN_B``: what changed in FSDP's structure between two runs."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from fsdptrace_cli.strings import python_strings

FORMATS = ("text", "json", "markdown")


@click.command("diff")
@click.argument("run_a", type=click.Path(path_type=Path))
@click.argument("run_b", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True,
              help="Report format.")
@click.option("--steps", metavar="SPEC",
              help="Compare the first complete micro-step within these optimizer steps "
                   "(e.g. 1, 2:4) [default: the first complete micro-step].")
@click.pass_context
@python_strings()
def command(ctx: click.Context, run_a: Path, run_b: Path, fmt: str, steps: str | None) -> None:
    """Compare RUN_B with RUN_A, a run of the same model that worked: units added, removed or
    renamed, each phase's first order difference, prefetch edges, settings, findings that
    appeared or disappeared, and bytes all-gathered.

    Exit status: 0 the same, 1 something changed, 2 bad input.

    \b
    Example:
      fsdptrace diff reference/run runs/after-upgrade
      fsdptrace diff runs/a runs/b --steps 1 --format json
    """
    from fsdptrace.render.diff_report import RENDERERS
    from fsdptrace.views.run_diff import diff

    result = diff(run_a, run_b, steps=steps)
    RENDERERS[fmt](result, sys.stdout)
    ctx.exit(0 if result.same else 1)
