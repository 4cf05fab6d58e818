"""``fsdptrace record -- COMMAND``: record a training job without changing its script."""

from __future__ import annotations

import os
from pathlib import Path

import click

from fsdptrace_cli.commands.analyze import FAIL_ON, run_analysis


@click.command("record", context_settings={"ignore_unknown_options": True,
                                           "allow_interspersed_args": False})
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
@click.option("--fail-on", type=click.Choice(FAIL_ON), default="error", show_default=True,
              help="Exit 1 when the analysis finds this severity or worse.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def command(ctx: click.Context, run_dir: Path | None, force: bool, append: bool,
            steps: str | None, raise_on_violation: bool, fail_on: str,
            command: tuple[str, ...]) -> None:
    """Run COMMAND with every rank it starts recorded, then print the analysis.

    Works for `python train.py` and `torchrun ... train.py` alike, with no change to the
    script. A script that calls fsdptrace.attach itself writes to the same run dir: these
    options win over its own run_dir=, steps= and raise_on_violation= (one line says so).
    A --run-dir that already holds a recording is refused before anything runs, unless
    --force or --append.
    Exit status: the training command's own when it fails or when nothing was recorded,
    else the analysis's; 2 for fsdptrace's own errors (a bad --steps spec, a taken run dir).

    \b
    Example:
      fsdptrace record --run-dir runs/a -- torchrun --nproc-per-node 2 train.py
      fsdptrace record --run-dir runs/a --append -- python train.py   # runs/a/launch-001
      fsdptrace record --steps 100:110 -- python train.py --config big.yaml
    """
    from fsdptrace.errors import UsageError
    from fsdptrace.record.launch import record_env, run_recorded
    from fsdptrace.record.run_dirs import holds_recording, prepare_run_dir
    from fsdptrace.record.steps import parse_steps

    try:
        parse_steps(steps)  # a bad spec fails here, before the job starts
    except ValueError as error:
        raise UsageError(str(error)) from None
    if force and append:
        raise UsageError("--force and --append exclude each other: replace the recording, "
                         "or add this launch beside it")
    if run_dir is None and (force or append):
        raise UsageError("--force and --append need --run-dir (the default run dir is new)")
    mode = "force" if force else "append" if append else "new"
    existed = run_dir is not None and run_dir.exists() and not append
    run_dir = prepare_run_dir(run_dir, mode=mode).resolve()
    click.echo(f"fsdptrace: recording to {run_dir}", err=True)
    env = record_env(run_dir, steps=steps, raise_on_violation=raise_on_violation)
    returncode = run_recorded(list(command), {**os.environ, **env})
    click.echo(f"fsdptrace: command exited with {returncode}; run dir {run_dir}", err=True)
    if not holds_recording(run_dir):
        # Recording is an observer: it never changes the command's own exit status.
        click.echo("fsdptrace: nothing was recorded (no FSDP2 forward ran?)", err=True)
        if not existed and not any(run_dir.iterdir()):
            run_dir.rmdir()  # made for this launch; left empty it would only mislead
        ctx.exit(returncode)
    analysis_code = run_analysis(run_dir, fmt="text", output=None, fail_on=fail_on, jobs=1)
    ctx.exit(returncode if returncode != 0 else analysis_code)
