"""``fsdptrace export RUN_DIR --chrome-trace FILE``: the run on a timeline, for Perfetto."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

import click

from fsdptrace_cli.progress import rank_progress


@click.command("export")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--chrome-trace", "chrome_trace", required=True,
              type=click.File("w", encoding="utf-8", lazy=True),
              help="Write Chrome Trace Event JSON to FILE ('-' for stdout).")
def command(run_dir: Path, chrome_trace: TextIO) -> None:
    """Export RUN_DIR as a Chrome trace: one process per rank, one track per phase, findings
    as instant events. Open it in https://ui.perfetto.dev or chrome://tracing.

    \b
    Example:
      fsdptrace export runs/a --chrome-trace runs/a.trace.json
    """
    from fsdptrace import analyze, reader
    from fsdptrace.render.chrome_trace import write_chrome_trace
    from fsdptrace.trace import load

    reader.check_run_dir(run_dir)
    with rank_progress(len(reader.discover_ranks(run_dir)), "analyzing ranks") as advance:
        findings = analyze(run_dir, progress=advance)
    write_chrome_trace(load(run_dir), findings, chrome_trace)
