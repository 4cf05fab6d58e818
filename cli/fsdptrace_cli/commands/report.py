"""``fsdptrace report RUN_DIR -o report.html``: one self-contained HTML file to share."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from fsdptrace_cli.commands.analyze import JOBS, run_analysis


@click.command("report")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--output", "-o", type=click.Path(path_type=Path), default=Path("report.html"),
              show_default=True, help="Write the HTML page here.")
@click.option("--max-steps", type=click.IntRange(min=1), default=8, show_default=True,
              help="Embed at most this many optimizer steps (those with findings first).")
@JOBS
@click.pass_context
def command(ctx: click.Context, run_dir: Path, output: Path, max_steps: int,
            jobs: int | None) -> None:
    """Write a self-contained HTML report of RUN_DIR (works offline, one file); the same as
    `fsdptrace analyze RUN_DIR --format html -o FILE`, with a page size.

    The page shows the verdict and the findings folded across ranks and steps, then for one
    optimizer step (selectable): a timeline per rank of its units with the findings marked,
    the configured prefetch edges over the observed order, diverging orders side by side,
    the parameter bytes each rank held, and where each rank stopped.
    Exit status: 0 written, 2 bad input.

    \b
    Example:
      fsdptrace report runs/a -o report.html
      fsdptrace report runs/big --max-steps 3 -j 16 -o big.html
    """
    from fsdptrace.render.formats import html

    code = run_analysis(run_dir, fmt="html", output=output, fail_on="never", jobs=jobs,
                        renderer=functools.partial(html, max_steps=max_steps))
    click.echo(f"wrote {output}", err=True)
    ctx.exit(code)
