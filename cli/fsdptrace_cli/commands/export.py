"""``fsdptrace export RUN_DIR --chrome-trace FILE``: the run on a timeline, for Perfetto."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from fsdptrace_cli.progress import rank_progress


@click.command("export")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--chrome-trace", "chrome_trace", required=True,
              type=click.Path(allow_dash=True),
              help="Write Chrome Trace Event JSON to FILE ('-' for stdout).")
def command(run_dir: Path, chrome_trace: str) -> None:
    """Export RUN_DIR as a Chrome trace: one process per rank, one track per phase, findings
    as instant events. Open it in https://ui.perfetto.dev or chrome://tracing.

    \b
    Example:
      fsdptrace export runs/a --chrome-trace runs/a.trace.json
    """
    from fsdptrace import analyze, reader
    from fsdptrace.render.chrome_trace import write_chrome_trace
    from fsdptrace.render.output import STDOUT, check_writable, open_for_writing
    from fsdptrace.trace import load

    check_writable(chrome_trace)
    reader.check_run_dir(run_dir)
    with rank_progress(len(reader.discover_ranks(run_dir)), "analyzing ranks") as advance:
        findings = analyze(run_dir, progress=advance)
    trace = load(run_dir)
    if chrome_trace == STDOUT:
        write_chrome_trace(trace, findings, sys.stdout)
        return
    with open_for_writing(chrome_trace) as out:
        write_chrome_trace(trace, findings, out)
