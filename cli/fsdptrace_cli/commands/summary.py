"""``fsdptrace summary RUN_DIR``: what was recorded, per rank."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command("summary")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="Output format (json: see the README for its shape).")
def command(run_dir: Path, fmt: str) -> None:
    """Ranks, world size, steps and micro-steps, units, events, time span, and whether each
    rank closed cleanly.

    \b
    Example:
      fsdptrace summary runs/a
      fsdptrace summary runs/a --format json
    """
    from fsdptrace.render import as_json, summary_text
    from fsdptrace.trace import load

    trace = load(run_dir)
    if fmt == "json":
        as_json.dump(as_json.summary_document(trace, run_dir=str(run_dir)), sys.stdout)
    else:
        summary_text.render(trace, sys.stdout, run_dir=str(run_dir))
