"""``fsdptrace analyze RUN_DIR``: merge the ranks, run the checks, print the report."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from fsdptrace_cli.progress import rank_progress

FORMATS = ("text", "json", "markdown")
FAIL_ON = {"error": ("error",), "warning": ("error", "warning"), "never": ()}


def exit_code(findings: object, fail_on: str) -> int:
    import pandas as pd

    assert isinstance(findings, pd.DataFrame)
    return 1 if findings["severity"].isin(FAIL_ON[fail_on]).any() else 0


def run_analysis(run_dir: Path, *, fmt: str, output: Path | None, checks: tuple[str, ...],
                 fail_on: str, jobs: int, scheduler: str | None = None) -> int:
    """Analyze and render; returns the exit code (shared with ``fsdptrace record``)."""
    from fsdptrace import analyze, reader
    from fsdptrace.analysis import incomplete_ranges
    from fsdptrace.checks import resolve
    from fsdptrace.render import as_json, markdown, text
    from fsdptrace.render.output import check_writable, open_for_writing
    from fsdptrace.summary import overview
    from fsdptrace.trace import load

    if output:
        check_writable(output)
    reader.check_run_dir(run_dir)
    num_ranks = len(reader.discover_ranks(run_dir))
    with rank_progress(num_ranks, "analyzing ranks") as advance:
        if scheduler:
            from fsdptrace.distributed import analyze_distributed

            findings = analyze_distributed(run_dir, scheduler, list(checks) or None,
                                           progress=advance)
        else:
            findings = analyze(run_dir, list(checks) or None, jobs=jobs, progress=advance)
    ranks = reader.discover_ranks(run_dir)
    meta = load(run_dir, ranks=ranks[:1] or None)
    world_size = meta.world_size if len(meta.meta) else len(ranks)
    context = {"run_dir": str(run_dir), "num_ranks": len(ranks), "world_size": world_size}
    out = open_for_writing(output) if output else sys.stdout
    try:
        if fmt == "json":
            summary = overview(load(run_dir)) if num_ranks <= 64 else {}
            summary["num_findings"] = len(findings)
            as_json.render(findings, out, run_dir=str(run_dir), ranks=ranks,
                           world_size=world_size, summary=summary,
                           checks=resolve(list(checks) or None))
        elif fmt == "markdown":
            markdown.render(findings, out, **context)
        else:
            text.render(findings, out, **context, incomplete=incomplete_ranges(run_dir))
    finally:
        if output:
            out.close()
    return exit_code(findings, fail_on)


@click.command("analyze")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True,
              help="Report format.")
@click.option("--output", "-o", type=click.Path(path_type=Path),
              help="Write the report to FILE instead of stdout.")
@click.option("--check", "checks", multiple=True, metavar="NAME",
              help="Run only this check (repeatable), e.g. --check prefetch-order.")
@click.option("--fail-on", type=click.Choice(list(FAIL_ON)), default="error", show_default=True,
              help="Exit 1 when a finding of this severity or worse exists.")
@click.option("--jobs", "-j", type=int, default=None,
              help="Processes for the per-rank map step [default: available cores].")
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
    """
    if jobs is None:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    ctx.exit(run_analysis(run_dir, fmt=fmt, output=output, checks=checks, fail_on=fail_on,
                          jobs=jobs, scheduler=scheduler))
