"""Every output of an analysis, by name: one table, one signature, one way to write a file.

Each renderer is ``render(analysis, out)``: it draws what an ``Analysis`` holds (reading the
run's tables where a picture needs them) and computes no finding itself. The commands pick one
by ``--format``; a notebook can call any of them on ``fsdptrace.analyze``'s result. Outputs are
rendered whole on disk before the target is opened (``output.write_page``), so a render that
fails never leaves half a page behind, and a path that cannot be written is refused before any
work (``output.check_writable``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TextIO, TypeVar

from fsdptrace.analysis.result import Analysis
from fsdptrace.render import as_json, markdown, summary_text, text
from fsdptrace.render.output import STDOUT, write_page
from fsdptrace.views.suggest import Suggestion
from fsdptrace.views.summary import RunSummary

# What a renderer draws: an ``Analysis``, or for ``summary`` a ``RunSummary`` and for
# ``suggest`` a ``Suggestion``.
Drawn = TypeVar("Drawn")
Renderer = Callable[[Analysis, TextIO], None]


def html(analysis: Analysis, out: TextIO, *, max_steps: int | None = None) -> None:
    """The self-contained HTML report (``fsdptrace report``): at most ``max_steps`` optimizer
    steps embedded, those with findings first."""
    from fsdptrace.render import html_report
    from fsdptrace.render.text import run_dir_label

    html_report.render(analysis.trace, analysis.findings, out,
                       run_dir=run_dir_label(analysis),
                       max_steps=html_report.MAX_STEPS if max_steps is None else max_steps)


def chrome_trace(analysis: Analysis, out: TextIO) -> None:
    """Chrome Trace Event JSON for Perfetto and chrome://tracing (``fsdptrace export``): a
    run dir is read a rank at a time."""
    from fsdptrace.render import chrome_trace as chrome

    trace = analysis.trace_in_memory
    if trace is None and analysis.run_dir is not None:
        chrome.write_run_dir_chrome_trace(analysis.run_dir, analysis.findings, out)
    else:
        chrome.write_chrome_trace(analysis.trace, analysis.findings, out)


def suggestion_text(suggestion: Suggestion, out: TextIO, *, model: str = "model") -> None:
    """The prefetch calls matching the observed order, and the diff against the configured."""
    from fsdptrace.views.suggest import write_suggestion

    write_suggestion(suggestion, out, model=model, types=suggestion.module_types)


@dataclass(frozen=True)
class Format(Generic[Drawn]):
    """One output: how to render it and what a person gets."""

    render: Callable[[Drawn, TextIO], None]
    description: str


FORMATS: dict[str, Format[Analysis]] = {
    "text": Format(text.render, "the report a person reads: verdict, findings per check"),
    "json": Format(as_json.render, "every finding with its figures (fsdptrace/schemas/)"),
    "markdown": Format(markdown.render, "for an issue or a pull request"),
    "html": Format(html, "one self-contained page: findings, timeline, memory, orders"),
    "chrome-trace": Format(chrome_trace, "Trace Event JSON for Perfetto / chrome://tracing"),
}
# What ``fsdptrace summary`` and ``fsdptrace suggest`` print, through the same path.
SUMMARY_FORMATS: dict[str, Format[RunSummary]] = {
    "text": Format(summary_text.render, "the run in numbers, then one row per rank"),
    "json": Format(as_json.render_summary, "the same as fields (fsdptrace/schemas/)"),
}
SUGGEST_FORMATS: dict[str, Format[Suggestion]] = {
    "text": Format(suggestion_text, "the calls to paste, then the edge diff"),
    "json": Format(as_json.render_suggest, "the same as fields (fsdptrace/schemas/)"),
}


def write(render: Callable[[Drawn, TextIO], None], analysis: Drawn,
          output: str | os.PathLike[str] | TextIO | None = None) -> None:
    """Render ``analysis`` to ``output``: a path, ``"-"`` or ``None`` for stdout, or a stream.

    A path gets the page once it is rendered whole (``output.write_page``).
    """
    if output is None or output == STDOUT:
        render(analysis, sys.stdout)
    elif isinstance(output, (str, os.PathLike)):
        write_page(output, lambda out: render(analysis, out))
    else:
        render(analysis, output)


# ``render(analysis, path)`` without a format: by the file's name, else text.
_BY_SUFFIX = ((".trace.json", "chrome-trace"), (".json", "json"), (".html", "html"),
              (".htm", "html"), (".md", "markdown"))


def save(analysis: Analysis, output: str | os.PathLike[str] | TextIO | None = None, *,
         format: str | None = None) -> None:
    """``fsdptrace.write(analysis, ...)``: one output of ``FORMATS``, to a path (its format
    from the name where ``format`` is not given: ``.html``, ``.md``, ``.json``,
    ``.trace.json`` for a Chrome trace, else text), a stream, or stdout."""
    if format is None:
        name = os.fspath(output).lower() if isinstance(output, (str, os.PathLike)) else ""
        format = next((fmt for suffix, fmt in _BY_SUFFIX if name.endswith(suffix)), "text")
    if format not in FORMATS:
        from fsdptrace.errors import UsageError

        raise UsageError(f"unknown format {format!r}; one of {', '.join(FORMATS)}")
    if isinstance(output, (str, os.PathLike)):
        from fsdptrace.render.output import check_writable

        check_writable(output)
    write(FORMATS[format].render, analysis, output)


__all__ = ["FORMATS", "SUGGEST_FORMATS", "SUMMARY_FORMATS", "Format", "Renderer", "html",
           "save", "write"]
