"""``fsdptrace suggest RUN_DIR``: the prefetch wiring that matches the observed order."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command("suggest")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--model", default="model", show_default=True, metavar="NAME",
              help="Variable name of the model in the printed calls.")
def command(run_dir: Path, model: str) -> None:
    """Print the FSDP2 prefetch calls that match the order units ran in (each unit
    prefetches the next one of its phase), and what to add, remove or keep against the
    edges configured now.

    \b
    Example:
      fsdptrace suggest runs/a
      fsdptrace suggest runs/a --model self.model
    """
    from fsdptrace.suggest import suggest, write_suggestion
    from fsdptrace.trace import load

    write_suggestion(suggest(load(run_dir)), sys.stdout, model=model)
