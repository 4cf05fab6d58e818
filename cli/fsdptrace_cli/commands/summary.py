"""``fsdptrace summary RUN_DIR``: what was recorded, per rank."""

from __future__ import annotations

from pathlib import Path

import click

from fsdptrace_cli.strings import python_strings

FORMATS = ("text", "json")  # ``fsdptrace.render.formats.SUMMARY_FORMATS``


@click.command("summary")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text",
              show_default=True, help="Output format (json: see the README for its shape).")
@python_strings()
def command(run_dir: Path, fmt: str) -> None:
    """Ranks, world size, steps and micro-steps, units, events, time span, and whether each
    rank closed cleanly.

    \b
    Example:
      fsdptrace summary runs/a
      fsdptrace summary runs/a --format json
    """
    from fsdptrace.render.formats import SUMMARY_FORMATS, write
    from fsdptrace.views.summary import summarize_run_dir

    write(SUMMARY_FORMATS[fmt].render, summarize_run_dir(run_dir))
