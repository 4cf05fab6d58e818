"""The ``fsdptrace`` command: a thin click shell over the library.

Every error ends as one line on stderr, never a traceback: fsdptrace's own exceptions are bad
input; any other exception is a bug in fsdptrace, said so in one line (the traceback only with
``--debug``). Exit codes: ``fsdptrace_cli.exit_codes``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import warnings
from typing import Any

import click

from fsdptrace.errors import FsdptraceError, FsdptraceWarning
from fsdptrace.reading.untrusted import printable
from fsdptrace.version import __version__
from fsdptrace_cli.exit_codes import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE


def report_error(error: Exception, *, debug: bool = False) -> int:
    """One line on stderr for ``error`` and its exit code: fsdptrace's own errors are bad
    input; anything else is a bug, named as one (its traceback first, with ``--debug``)."""
    if isinstance(error, FsdptraceError):
        # Messages quote paths and names from the run dir: one printable line.
        click.echo(f"fsdptrace: error: {printable(error)}", err=True)
        return EXIT_BAD_INPUT
    if debug:
        click.echo("".join(traceback.format_exception(error)), err=True, nl=False)
    click.echo(f"fsdptrace: internal error: {type(error).__name__}: {printable(error)[:200]} "
               f"- a bug in fsdptrace {__version__}; please report it with this line (rerun "
               "with --debug for the traceback)", err=True)
    return EXIT_BAD_INPUT


def show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
    """fsdptrace's own warnings as one printable line each (no source location)."""
    if issubclass(category, FsdptraceWarning):
        click.echo(f"fsdptrace: warning: {printable(message)}", err=True)
    else:
        _show_warning(message, category, filename, lineno, file, line)


_show_warning = warnings.showwarning


class FsdptraceGroup(click.Group):
    """Turns every exception but click's own into one line and exit code 2, and each of
    fsdptrace's warnings into one line."""

    def invoke(self, ctx: click.Context) -> Any:
        # Not imported yet: nothing to forget.
        gaps = sys.modules.get("fsdptrace.reading.chunk_gaps")
        if gaps is not None:
            gaps.reset()  # a new command says its skipped chunks again
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always", FsdptraceWarning)  # the library dedupes
                warnings.showwarning = show_warning
                return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise  # click's own exits and usage errors keep their codes
        except BrokenPipeError:
            # Nothing more can be said on stdout; keep the exit's own flush from failing too.
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(EXIT_BROKEN_PIPE)
        except Exception as error:
            ctx.exit(report_error(error, debug=bool(ctx.params.get("debug"))))


@click.group(cls=FsdptraceGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fsdptrace")
@click.option("--debug", is_flag=True, help="Print the traceback of an internal error.")
def cli(debug: bool) -> None:
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
