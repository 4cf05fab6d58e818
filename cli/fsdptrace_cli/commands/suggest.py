"""``fsdptrace suggest RUN_DIR``: the prefetch wiring that matches the observed order."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from fsdptrace_cli.strings import python_strings

FORMATS = ("text", "json")  # ``fsdptrace.render.formats.SUGGEST_FORMATS``


@click.command("suggest")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--model", default="model", show_default=True, metavar="NAME",
              help="Variable name of the model in the printed calls.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text",
              show_default=True, help="Output format (json: see the README for its shape).")
@python_strings()
def command(run_dir: Path, model: str, fmt: str) -> None:
    """Print the FSDP2 prefetch calls that match the order units ran in (each unit
    prefetches the next one of its phase), and what to add, remove or keep against the
    edges configured now.

    \b
    Example:
      fsdptrace suggest runs/a
      fsdptrace suggest runs/a --model self.model --format json
    """
    from fsdptrace.render.formats import SUGGEST_FORMATS, write
    from fsdptrace.views.suggest import suggest_run_dir

    write(functools.partial(SUGGEST_FORMATS[fmt].render, model=model),
          suggest_run_dir(run_dir))
