"""``fsdptrace export RUN_DIR --chrome-trace FILE``: the run on a timeline, for Perfetto."""

from __future__ import annotations

from pathlib import Path

import click

from fsdptrace_cli.commands.analyze import JOBS, run_analysis


@click.command("export")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--chrome-trace", "chrome_trace", required=True,
              type=click.Path(allow_dash=True),
              help="Write Chrome Trace Event JSON to FILE ('-' for stdout).")
@JOBS
@click.pass_context
def command(ctx: click.Context, run_dir: Path, chrome_trace: str, jobs: int | None) -> None:
    """Export RUN_DIR as a Chrome trace: one process per rank, its units on a wall-clock
    timeline, all-gathers, bytes held, findings as instant events; the same as
    `fsdptrace analyze RUN_DIR --format chrome-trace -o FILE`. Open it in
    https://ui.perfetto.dev or chrome://tracing. Exit status: 0 written, 2 bad input.

    \b
    Example:
      fsdptrace export runs/a --chrome-trace runs/a.trace.json
    """
    code = run_analysis(run_dir, fmt="chrome-trace", output=chrome_trace, fail_on="never",
                        jobs=jobs)
    if chrome_trace != "-":  # as report says what it wrote; stdout stays the trace's own
        click.echo(f"wrote {chrome_trace}", err=True)
    ctx.exit(code)
