"""Reading a run dir never executes anything from it: no pickle, no eval, no torch.load."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import fsdptrace

PACKAGE = Path(fsdptrace.__file__).parent
# Everything on the read side: the stages from the run dir's format to the CLI.
READ_SIDE = [*(path for stage in ("store", "reading", "checks", "analysis", "views", "render",
                                  "watch") for path in sorted((PACKAGE / stage).rglob("*.py"))),
             *sorted((PACKAGE.parent / "cli" / "fsdptrace_cli").rglob("*.py"))]
# eval/exec as calls only: `--on-hang 'exec ./notify.sh'` in the watch command's help is text.
FORBIDDEN = re.compile(r"\b(pickle|cloudpickle|dill|marshal|torch\.load|read_pickle|yaml\.load|"
                       r"shelve)\b\s*[.(]|\b(eval|exec)\s*\(")


def test_read_side_never_deserializes_code() -> None:
    hits = [f"{path}:{number}: {line.strip()}"
            for path in READ_SIDE
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if FORBIDDEN.search(line) and not line.lstrip().startswith("#")]
    assert len(READ_SIDE) > 10 and not hits, "\n".join(hits)


class _Boom:
    """Unpickling this writes a file: proof that something ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.write_text, (self.marker, "executed"))


@pytest.mark.slow
def test_hostile_metadata_is_never_executed(scenario_runs: Path, tmp_path: Path) -> None:
    run = tmp_path / "clean"
    shutil.copytree(scenario_runs / "clean", run)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Boom(marker))
    for path in run.glob("*/rank=*/part-*.parquet"):
        table = pq.read_table(path)
        meta = dict(table.schema.metadata or {})
        meta[b"pandas"] = json.dumps({
            "index_columns": [{"kind": "range", "start": 0, "stop": 1, "step": 1,
                               "name": "__import__('os').system('touch " + str(marker) + "')"}],
            "columns": [{"name": "x", "pandas_type": "object", "numpy_type": "object",
                         "metadata": {"pickle": payload.hex()}}],
            "column_indexes": [], "pandas_version": "0; import os",
        }).encode()
        meta[b"ARROW:extension:metadata"] = payload
        pq.write_table(table.replace_schema_metadata(meta), path)
    try:
        fsdptrace.analyze(fsdptrace.load(run))
    except fsdptrace.RunDirError:
        pass  # refusing the file is fine; running its content is not
    assert not marker.exists()
