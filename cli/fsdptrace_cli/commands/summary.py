"""``fsdptrace summary RUN_DIR``: what was recorded, per rank."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command("summary")
@click.argument("run_dir", type=click.Path(path_type=Path))
def command(run_dir: Path) -> None:
    """Ranks, world size, steps and micro-steps, units, events, time span, and whether each
    rank closed cleanly.

    \b
    Example:
      fsdptrace summary runs/a
    """
    from fsdptrace.render import summary_text
    from fsdptrace.trace import load

    summary_text.render(load(run_dir), sys.stdout, run_dir=str(run_dir))
