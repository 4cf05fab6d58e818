"""The verdict a watcher prints: ``fsdptrace analyze --check stalled-rank`` on the same data,
through the same code (``analysis.analyze`` and the text and JSON renderers)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdptrace.analysis.run import analyze
from fsdptrace.checks.stalled_rank import NAME as STALLED_RANK
from fsdptrace.errors import FsdptraceError
from fsdptrace.render import as_json, text


@dataclass(frozen=True)
class StalledVerdict:
    """The analysis's text as ``analyze`` prints it, and its JSON document (``None`` with
    ``error`` when the run dir could not be analyzed yet)."""

    text: str
    document: dict[str, Any] | None
    error: str | None = None


def stalled_verdict(run_dir: Path) -> StalledVerdict:
    """Analyze ``run_dir`` for stalled-rank now, while its ranks are alive."""
    try:
        analysis = analyze(run_dir, [STALLED_RANK], jobs=1)
    except FsdptraceError as error:
        return StalledVerdict(f"no verdict: {error}\n", None, str(error))
    out = io.StringIO()
    text.render(analysis, out)
    document = io.StringIO()
    as_json.render(analysis, document)
    return StalledVerdict(out.getvalue(), json.loads(document.getvalue()))
