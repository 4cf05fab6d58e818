"""Peak RSS reading each hostile journal segment (``hostile_corpus.JOURNAL_CASES``) with
``journal_read.read_segment`` in a fresh process under a 2 GB address-space cap.

    python tests/segment_memory.py       (PYTHONPATH picks which fsdptrace is measured)
"""

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.hostile_corpus import JOURNAL_CASES, build

CHILD = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from pathlib import Path
from fsdptrace.store import journal_read
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
path = Path(sys.argv[1]); table = path.name.split("-")[0]
try:
    rows = journal_read.read_segment(path, table); what = f"{rows.num_rows} rows"
except Exception as e:
    what = f"{type(e).__name__}: {str(e).split(': ', 1)[-1][:70]}"
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{peak >> 10} MiB (+{(peak - base) >> 10} MiB) {what}")
"""
for name in JOURNAL_CASES:
    with tempfile.TemporaryDirectory() as d:
        run = build(name, Path(d), seed=16)
        seg = next(run.glob("journal/rank=*/*.seg"))
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(seg)], capture_output=True, text=True
        )
        print(f"{name:28s} {(out.stdout or out.stderr).strip().splitlines()[-1][:150]}", flush=True)
