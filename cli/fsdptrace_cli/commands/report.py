"""``fsdptrace report RUN_DIR -o report.html``: one self-contained HTML file to share."""

from __future__ import annotations

import io
import os
from pathlib import Path

import click

from fsdptrace_cli.progress import rank_progress


def write_report(run_dir: Path, *, output: Path, max_steps: int, jobs: int) -> None:
    """Analyze RUN_DIR and write the HTML report; the page is rendered by the library."""
    from fsdptrace import analyze, reader
    from fsdptrace.render import html_report
    from fsdptrace.render.output import check_writable, write_text
    from fsdptrace.trace import load

    check_writable(output)
    reader.check_run_dir(run_dir)
    num_ranks = len(reader.discover_ranks(run_dir))
    with rank_progress(num_ranks, "analyzing ranks") as advance:
        findings = analyze(run_dir, jobs=jobs, progress=advance)
    trace = load(run_dir)
    # Render fully before touching the output, so a failure never leaves half a page behind.
    page = io.StringIO()
    html_report.render(trace, findings, page, run_dir=str(run_dir), max_steps=max_steps)
    write_text(output, page.getvalue())


@click.command("report")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "--output",
    "-o",
    type=click.Path(path_type=Path),
    default=Path("report.html"),
    show_default=True,
    help="Write the HTML page here.",
)
@click.option(
    "--max-steps",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Embed at most this many optimizer steps (those with findings first).",
)
@click.option(
    "--jobs",
    "-j",
    type=int,
    default=None,
    help="Processes for the per-rank analysis [default: available cores].",
)
def command(run_dir: Path, output: Path, max_steps: int, jobs: int | None) -> None:
    """Write a self-contained HTML report of RUN_DIR (works offline, one file).

    The page shows the verdict and the findings folded across ranks and steps, then for one
    optimizer step (selectable): a timeline per rank of unit forward/backward begins with the
    findings marked, the configured prefetch edges over the observed order, diverging orders
    side by side, and where each rank stopped. Exit status: 0 written, 2 bad input.

    \b
    Example:
      fsdptrace report runs/a -o report.html
      fsdptrace report runs/big --max-steps 3 -j 16 -o big.html
    """
    if jobs is None:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    write_report(run_dir, output=output, max_steps=max_steps, jobs=jobs)
    click.echo(f"wrote {output}", err=True)
