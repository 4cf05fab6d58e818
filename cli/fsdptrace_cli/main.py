"""The ``fsdptrace`` command: a thin click shell over the library.

Exit codes are mapped here and only here: 0 clean, 1 findings at or above ``--fail-on``,
2 bad input (one line on stderr, never a traceback).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from fsdptrace.errors import FsdptraceError
from fsdptrace.version import __version__

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_BAD_INPUT = 2


class FsdptraceGroup(click.Group):
    """Turns library errors into one-line messages and exit code 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FsdptraceError as error:
            click.echo(f"fsdptrace: error: {error}", err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except ValueError as error:
            click.echo(f"fsdptrace: error: {error}", err=True)
            ctx.exit(EXIT_BAD_INPUT)


@click.group(cls=FsdptraceGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fsdptrace")
def cli() -> None:
    """fsdptrace: a flight recorder and post-mortem analyzer for PyTorch FSDP2 jobs.

    \b
    Example:
      fsdptrace record --run-dir runs/a -- torchrun --nproc-per-node 2 train.py
      fsdptrace analyze runs/a
    """


def _register() -> None:
    from fsdptrace_cli.commands import COMMANDS

    for command in COMMANDS:
        cli.add_command(command)


_register()


def main() -> None:
    cli.main(prog_name="fsdptrace")


if __name__ == "__main__":
    sys.exit(main())
