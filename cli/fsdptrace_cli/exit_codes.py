"""The exit codes of every command, mapped here and only here.

0: clean (or the output was written). 1: findings at or above ``--fail-on`` (for ``diff``:
something changed). 2: bad input, which is any of fsdptrace's own errors
(``fsdptrace.errors.FsdptraceError``), and also a bug in fsdptrace: CI reads 1 as "findings",
so an internal error must never exit 1. 141: stdout was closed by its reader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdptrace.analysis.result import Analysis

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_BAD_INPUT = 2
# The reader of stdout went away early (``fsdptrace analyze RUN | head``): no message, and the
# status of a process SIGPIPE ended, as shells report it.
EXIT_BROKEN_PIPE = 128 + 13


def for_analysis(analysis: Analysis, fail_on: str) -> int:
    """1 when ``analysis`` has a finding of ``fail_on``'s severity or worse, else 0."""
    return EXIT_FINDINGS if analysis.fails(fail_on) else EXIT_OK
