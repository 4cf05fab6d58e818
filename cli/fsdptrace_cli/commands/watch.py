"""``fsdptrace watch RUN_DIR``: the hang verdict while a job hangs (also ``record --watch``)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from fsdptrace_cli.exit_codes import EXIT_FINDINGS, EXIT_OK

if TYPE_CHECKING:
    from fsdptrace.watch.loop import Hang, WatchSettings


def watch_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """The options ``watch`` and ``record --watch`` share."""
    options = [
        click.option("--hang-after", type=click.FloatRange(min=0, min_open=True),
                     metavar="SECONDS",
                     help="Hung when no rank recorded anything this long while a rank is "
                          "inside a pass or an eval forward [default: 5 times the slowest "
                          "micro-step seen, at least 10 s]."),
        click.option("--idle-after", type=click.FloatRange(min=0, min_open=True),
                     default=600.0, show_default=True, metavar="SECONDS",
                     help="Hung when every rank has waited between optimizer steps this long "
                          "(a checkpoint save, data loading, evaluation outside FSDP)."),
        click.option("--poll", "poll_s", type=click.FloatRange(min=0.05), default=1.0,
                     show_default=True, metavar="SECONDS", help="Seconds between polls."),
        click.option("--on-hang", default="report", show_default=True,
                     metavar="report|terminate|'exec CMD'",
                     help="After the verdict: nothing more; SIGTERM the ranks of this host "
                          "(their endings read terminated); or run CMD with the verdict as "
                          "JSON on stdin."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def settings(hang_after: float | None, idle_after: float, poll_s: float, on_hang: str
             ) -> WatchSettings:
    """The library's settings from the options (a bad --on-hang is a one-line error)."""
    from fsdptrace.watch.actions import parse_on_hang
    from fsdptrace.watch.loop import WatchSettings

    return WatchSettings(hang_after=hang_after, idle_after=idle_after, poll_s=poll_s,
                         on_hang=parse_on_hang(on_hang))


def run_watch(run_dir: Path, chosen: WatchSettings,
              stop: Callable[[], bool] = lambda: False) -> Hang | None:
    """The watcher on the terminal: the verdict on stdout, notes on stderr."""
    from fsdptrace.watch.loop import watch

    return watch(run_dir, chosen, out=sys.stdout, log=sys.stderr, stop=stop)


class BackgroundWatcher:
    """``record --watch``: the same watcher on a thread beside the job, stopped when it ends."""

    def __init__(self, run_dir: Path, chosen: WatchSettings) -> None:
        self._done = threading.Event()
        self.hang: Hang | None = None
        self._thread = threading.Thread(target=self._run, args=(run_dir, chosen),
                                        name="fsdptrace-watch", daemon=True)
        self._thread.start()

    def _run(self, run_dir: Path, chosen: WatchSettings) -> None:
        try:
            self.hang = run_watch(run_dir, chosen, stop=self._done.is_set)
        except Exception as error:  # the watcher never takes the job down with it
            click.echo(f"fsdptrace: watcher stopped: {type(error).__name__}: {error}",
                       err=True)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=30)


@click.command("watch")
@click.argument("run_dir", type=click.Path(path_type=Path, file_okay=False))
@watch_options
@click.pass_context
def command(ctx: click.Context, run_dir: Path, hang_after: float | None, idle_after: float,
            poll_s: float, on_hang: str) -> None:
    """Watch a live run's RUN_DIR; on a hang, print who stalled where while the ranks live.

    Reads files only (each rank's hot folder on its own host, else the run dir's journal
    mirror, at most one flush interval late) and never touches the training processes
    until a hang. Then it prints the verdict of `fsdptrace analyze --check stalled-rank`,
    writes it into RUN_DIR/watch/, asks this host's ranks for their stacks and does what
    --on-hang says. It returns when every rank ended.

    Exit status: 0 the run ended with no hang seen, 1 a hang, 2 bad input.

    \b
    Example:
      fsdptrace watch runs/a --hang-after 120
      fsdptrace watch runs/a --on-hang terminate
      fsdptrace watch runs/a --on-hang 'exec ./notify-slack.sh'
    """
    from fsdptrace.errors import RunDirError

    chosen = settings(hang_after, idle_after, poll_s, on_hang)
    if not run_dir.is_dir():
        raise RunDirError(f"run dir {run_dir} does not exist: start the job first, or give "
                          "the --run-dir it records into")
    hang = run_watch(run_dir.resolve(), chosen)
    ctx.exit(EXIT_FINDINGS if hang is not None else EXIT_OK)
