"""``fsdptrace analyze RUN_DIR``: merge the ranks, run the checks, print the report."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from fsdptrace_cli.exit_codes import for_analysis
from fsdptrace_cli.progress import rank_progress
from fsdptrace_cli.strings import python_strings

if TYPE_CHECKING:
    from fsdptrace.render.formats import Renderer

# The names of ``fsdptrace.render.formats.FORMATS`` and ``fsdptrace.analysis.result.FAIL_ON``,
# spelled here so that ``--help`` does not import pandas; tests/test_cli.py keeps them equal.
FORMATS = ("text", "json", "markdown", "html", "chrome-trace")
FAIL_ON = ("error", "warning", "never")
# --jobs of every command that analyzes (analyze, report, export).
JOBS = click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
                    help="Processes for the per-rank map step [default: available cores; this "
                         "one alone for a small run dir].")


@python_strings()
def run_analysis(run_dir: Path, *, fmt: str, output: Path | str | None,
                 checks: tuple[str, ...] = (), fail_on: str = "error", jobs: int | None = None,
                 scheduler: str | None = None, renderer: Renderer | None = None) -> int:
    """Parse done: analyze, render ``fmt`` (or ``renderer``), return the exit code.

    Shared by ``analyze``, ``report``, ``export`` and ``record``.
    """
    from fsdptrace.analysis.run import analyze
    from fsdptrace.render.formats import FORMATS as RENDERERS
    from fsdptrace.render.formats import write
    from fsdptrace.render.output import check_writable

    if output is not None:
        check_writable(output)  # before any work: a typo costs no analysis
    with rank_progress("analyzing ranks") as advance:
        analysis = analyze(run_dir, list(checks) or None, jobs=jobs, scheduler=scheduler,
                           progress=advance)
    write(renderer or RENDERERS[fmt].render, analysis, output)
    return for_analysis(analysis, fail_on)


@click.command("analyze")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True,
              help="Report format (html: what `fsdptrace report` writes; chrome-trace: what "
                   "`fsdptrace export` writes).")
@click.option("--output", "-o", type=click.Path(path_type=Path, allow_dash=True),
              help="Write the report to FILE instead of stdout.")
@click.option("--check", "checks", multiple=True, metavar="NAME",
              help="Run only this check (repeatable), e.g. --check prefetch-order.")
@click.option("--fail-on", type=click.Choice(FAIL_ON), default="error", show_default=True,
              help="Exit 1 when a finding of this severity or worse exists.")
@JOBS
@click.option("--scheduler", metavar="tcp://HOST:PORT",
              help="Run the per-rank map on this Dask scheduler (pip install 'fsdptrace[dask]').")
@click.pass_context
def command(ctx: click.Context, run_dir: Path, fmt: str, output: Path | None,
            checks: tuple[str, ...], fail_on: str, jobs: int | None,
            scheduler: str | None) -> None:
    """Merge the ranks of RUN_DIR, run every check, and print a report.

    Exit status: 0 no finding at or above --fail-on, 1 findings, 2 bad input.

    \b
    Example:
      fsdptrace analyze runs/a
      fsdptrace analyze runs/a --format json -o findings.json --fail-on warning
      fsdptrace analyze runs/a --check stalled-rank     # after a hang: who stopped where
    """
    ctx.exit(run_analysis(run_dir, fmt=fmt, output=output, checks=checks, fail_on=fail_on,
                          jobs=jobs, scheduler=scheduler))
