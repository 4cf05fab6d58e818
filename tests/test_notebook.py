"""``examples/explore_trace.ipynb`` runs top to bottom on the shipped sample and shows the finding.

Executed by a real Jupyter kernel from ``examples/``, not the repo root, because a notebook is
opened from wherever a person's Jupyter started: it must find ``sample_traces/`` by itself.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "examples" / "explore_trace.ipynb"


@pytest.fixture(scope="module")
def executed() -> nbformat.NotebookNode:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=120, kernel_name="python3",
                            allow_errors=True,
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    return client.execute()


def text_of(cell: nbformat.NotebookNode) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def test_no_cell_errors(executed: nbformat.NotebookNode) -> None:
    errors = [(cell["id"], output["ename"], output["evalue"])
              for cell in executed.cells if cell["cell_type"] == "code"
              for output in cell["outputs"] if output["output_type"] == "error"]
    assert errors == []
    assert all(cell["execution_count"] for cell in executed.cells
               if cell["cell_type"] == "code")


def test_findings_cell_shows_the_planted_prefetch_order(executed: nbformat.NotebookNode) -> None:
    (findings,) = [cell for cell in executed.cells if cell["id"] == "findings"]
    shown = text_of(findings)
    assert "prefetch-order" in shown
    assert "layers.2 prefetched layers.1" in shown
