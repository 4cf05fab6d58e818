"""``fsdptrace record -- COMMAND``: record a training job without changing its script."""

from __future__ import annotations

import os
from pathlib import Path

import click

from fsdptrace_cli.commands.analyze import FAIL_ON, run_analysis
from fsdptrace_cli.commands.watch import BackgroundWatcher, settings, watch_options


# Not ignore_unknown_options: an unknown option before `--` (a typo, a torchrun flag put on the
# wrong side) is click's "No such option" with its did-you-mean, before anything is created.
# Without interspersed arguments, everything from the command's first word on is its own.
@click.command("record", context_settings={"allow_interspersed_args": False})
@click.option("--run-dir", type=click.Path(path_type=Path, file_okay=False),
              help="Where to write the recording "
                   "[default: ./fsdptrace_runs/<timestamp>-<pid>-<random>, new each launch].")
@click.option("--force", is_flag=True,
              help="Replace the recording already in --run-dir (removed before the job starts).")
@click.option("--append", is_flag=True,
              help="Keep the recording already in --run-dir; record this launch beside it, "
                   "in RUN_DIR/launch-<n>.")
@click.option("--steps", metavar="SPEC",
              help="Record only these optimizer steps, e.g. 10:20, ::5 or 0,3,100:.")
@click.option("--raise", "raise_on_violation", is_flag=True,
              help="Check before each optimizer.step() and stop the job on an error.")
@click.option("--fail-on", type=click.Choice(FAIL_ON), default=None,
              help="Exit 1 when the analysis finds this severity or worse (a CI gate) "
                   "[default: the command's own exit status, whatever the findings].")
@click.option("--watch", "watch", is_flag=True,
              help="Watch the job while it runs: on a hang, print the stalled-rank verdict "
                   "while the ranks are alive (see `fsdptrace watch --help`).")
@watch_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def command(ctx: click.Context, run_dir: Path | None, force: bool, append: bool,
            steps: str | None, raise_on_violation: bool, fail_on: str | None, watch: bool,
            hang_after: float | None, idle_after: float, poll_s: float, on_hang: str,
            command: tuple[str, ...]) -> None:
    """Run COMMAND with every rank it starts recorded, then print the analysis.

    Works for `python train.py` and `torchrun ... train.py` alike, with no change to the
    script. A script that calls fsdptrace.attach itself writes to the same run dir: these
    options win over its own run_dir=, steps= and raise_on_violation= (one line says so).
    A --run-dir that already holds a recording is refused before anything runs, unless
    --force or --append.
    Exit status: the training command's own, whatever the findings (a job that trained fine
    is not reported failed to its scheduler). With --fail-on, a command that exited 0 gives
    the analysis's status instead: 1 for findings at or above that severity. 2 for
    fsdptrace's own errors (an unknown option, a bad --steps spec, a taken run dir).

    \b
    Example:
      fsdptrace record --run-dir runs/a -- torchrun --nproc-per-node 2 train.py
      fsdptrace record --run-dir runs/a --append -- python train.py   # runs/a/launch-001
      fsdptrace record --steps 100:110 -- python train.py --config big.yaml
      fsdptrace record --fail-on error -- python train.py   # CI: exit 1 on an error finding
      fsdptrace record --watch --on-hang terminate -- torchrun --nproc-per-node 8 train.py
    """
    from fsdptrace.errors import UsageError
    from fsdptrace.record.hot_sweep import sweep
    from fsdptrace.record.launch import record_env, run_recorded
    from fsdptrace.store.run_dirs import holds_recording, prepare_run_dir
    from fsdptrace.store.steps import parse_steps

    try:
        parse_steps(steps)  # a bad spec fails here, before the job starts
    except ValueError as error:
        raise UsageError(str(error)) from None
    if force and append:
        raise UsageError("--force and --append exclude each other: replace the recording, "
                         "or add this launch beside it")
    if run_dir is None and (force or append):
        raise UsageError("--force and --append need --run-dir (the default run dir is new)")
    chosen = settings(hang_after, idle_after, poll_s, on_hang) if watch else None
    mode = "force" if force else "append" if append else "new"
    existed = run_dir is not None and run_dir.exists() and not append
    run_dir = prepare_run_dir(run_dir, mode=mode).resolve()
    sweep()  # hot folders of jobs killed with their writers on this host (--force's too)
    click.echo(f"fsdptrace: recording to {run_dir}", err=True)
    env = record_env(run_dir, steps=steps, raise_on_violation=raise_on_violation)
    watcher = BackgroundWatcher(run_dir, chosen) if chosen is not None else None
    try:
        returncode = run_recorded(list(command), {**os.environ, **env})
    finally:
        if watcher is not None:
            watcher.stop()
    click.echo(f"fsdptrace: command exited with {returncode}; run dir {run_dir}", err=True)
    if not holds_recording(run_dir):
        # Recording is an observer: it never changes the command's own exit status.
        click.echo("fsdptrace: nothing was recorded (no FSDP2 forward ran?)", err=True)
        if not existed and not any(run_dir.iterdir()):
            run_dir.rmdir()  # made for this launch; left empty it would only mislead
        ctx.exit(returncode)
    analysis_code = run_analysis(run_dir, fmt="text", output=None, fail_on=fail_on or "never",
                                 jobs=1)
    ctx.exit(returncode if returncode != 0 or fail_on is None else analysis_code)
