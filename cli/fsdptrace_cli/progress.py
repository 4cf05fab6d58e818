"""Progress bars for long work, on stderr and only where a person is watching."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import click

MIN_RANKS_FOR_BAR = 16


@contextlib.contextmanager
def rank_progress(total: int, label: str) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(done)``; draws a bar for many ranks on a terminal, else nothing."""
    if total < MIN_RANKS_FOR_BAR or not sys.stderr.isatty():
        yield lambda done: None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        state = {"done": 0}

        def advance(done: int) -> None:
            bar.update(done - state["done"])
            state["done"] = done

        yield advance
