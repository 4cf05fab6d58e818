"""``fsdptrace summary RUN_DIR``: what was recorded, per rank."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("summary")
@click.argument("run_dir", type=click.Path(path_type=Path))
def command(run_dir: Path) -> None:
    """Ranks, world size, steps and micro-steps, units, events, time span, and whether each
    rank closed cleanly.

    \b
    Example:
      fsdptrace summary runs/a
    """
    from fsdptrace.allgather_summary import overview_line
    from fsdptrace.summary import overview, per_rank
    from fsdptrace.trace import load

    trace = load(run_dir)
    numbers = overview(trace)
    click.echo(f"run dir: {run_dir}")
    incomplete = numbers.pop("incomplete_steps")
    for key, value in numbers.items():
        click.echo(f"{key.replace('_', ' ')}: {value}")
    assert isinstance(incomplete, dict)
    click.echo("incomplete steps (rows dropped):" + ("" if incomplete else " none"))
    for rank, where in incomplete.items():
        click.echo(f"  rank {rank}: {where}")
    click.echo(f"all-gathers: {overview_line(trace.allgathers)}")
    table = per_rank(trace)
    click.echo("")
    click.echo(table.to_string(index=False))
