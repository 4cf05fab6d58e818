"""Progress bars for long work, on stderr and only where a person is watching."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import click

MIN_RANKS_FOR_BAR = 16


@contextlib.contextmanager
def rank_progress(label: str) -> Iterator[Callable[[int, int], None]]:
    """Yields ``advance(done, total)`` for the library's ``progress=``: a bar on a terminal
    once ``total`` is many ranks, else nothing. The bar starts with the first call, so the
    command need not count the ranks itself."""
    if not sys.stderr.isatty():
        yield lambda done, total: None
        return
    with contextlib.ExitStack() as stack:
        bar: list[click._termui_impl.ProgressBar[int]] = []
        shown = [0]

        def advance(done: int, total: int) -> None:
            if total < MIN_RANKS_FOR_BAR:
                return
            if not bar:
                bar.append(stack.enter_context(
                    click.progressbar(length=total, label=label, file=sys.stderr)))
            bar[0].update(done - shown[0])
            shown[0] = done

        yield advance
