"""Regenerate ``sample_traces/``: one tiny real run dir per kind of problem fsdptrace finds.

    python examples/make_samples.py            # or: make samples

Records ``examples/scenarios.py`` on 2 real FSDP2 ranks (CPU, gloo) into a temporary folder,
checks every sample gives exactly its planted findings (``tests/expectations.py``, the same
expectations the test suite holds the analyzer to), and only then replaces
``sample_traces/<name>/``. Timestamps, pids and hosts change from one regeneration to the next;
the rows and the findings do not.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from itertools import groupby
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import fsdptrace  # noqa: E402
from tests.expectations import SAMPLE_STEPS, SAMPLES, problems  # noqa: E402
from tests.jobs import assert_ok, run_scenarios  # noqa: E402

SAMPLES_DIR = REPO / "sample_traces"
KILLED = "killed-rank"


def record(out: Path, names: list[str], *, steps: int) -> None:
    """Record ``names`` into ``out/<name>``: normal runs in one launch, the killed one apart.

    A killed rank ends its job, so it cannot share a launch; the survivor blocks in a
    collective until the launcher's deadline stops it, as in the test fixture.
    """
    flags = ["--steps", str(steps)]
    normal = [name for name in names if name != KILLED]
    if normal:
        assert_ok(run_scenarios(out, [*flags, *normal], timeout_s=600))
    if KILLED in names:
        run_scenarios(out, [*flags, KILLED], timeout_s=30)


def verify(out: Path, names: list[str], *, steps: int) -> list[str]:
    """What is wrong, per sample: each must give exactly its planted findings."""
    return [f"{name}: {problem}" for name in names
            for problem in problems(name, fsdptrace.analyze(out / name).findings, steps=steps)]


def compact(run_dir: Path) -> None:
    """Merge each writer's chunks of a table into its first chunk file.

    Every chunk carries a ~2 KB Parquet footer for a few dozen rows, so the recorder's one
    file per optimizer boundary would make the samples several times larger than their data.
    The rows, their order and the footer's schema metadata stay as recorded.
    """
    for folder in sorted({path.parent for path in run_dir.glob("*/rank=*/part-*.parquet")}):
        parts = sorted(folder.glob("part-*.parquet"))
        for _, group in groupby(parts, key=lambda path: path.name.rsplit("-", 1)[0]):
            files = list(group)
            merged = pa.concat_tables(pq.read_table(path) for path in files)
            for path in files:
                path.unlink()
            pq.write_table(merged, files[0], compression="zstd")


def install(out: Path, names: list[str], dest: Path) -> None:
    """Replace each ``dest/<name>`` with the fresh recording; other files in dest stay."""
    dest.mkdir(exist_ok=True)
    for name in names:
        target = dest / name
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(out / name), str(target))


def regenerate(names: list[str], dest: Path) -> list[str]:
    """Record, compact and check ``names``; install them only if every one is as expected."""
    with tempfile.TemporaryDirectory(prefix="fsdptrace-samples-") as tmp:
        out = Path(tmp)
        record(out, names, steps=SAMPLE_STEPS)
        for name in names:
            compact(out / name)
        wrong = verify(out, names, steps=SAMPLE_STEPS)
        if not wrong:
            install(out, names, dest)
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"samples to regenerate (default: all of {', '.join(SAMPLES)})")
    parser.add_argument("--dest", type=Path, default=SAMPLES_DIR)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(SAMPLES))
    if unknown:
        parser.error(f"unknown sample(s) {', '.join(unknown)}; choose from {', '.join(SAMPLES)}")
    names = args.names or list(SAMPLES)
    wrong = regenerate(names, args.dest)
    if wrong:
        print("nothing installed: the recordings differ from tests/expectations.py:\n  "
              + "\n  ".join(wrong), file=sys.stderr)
        return 1
    print(f"wrote {len(names)} samples to {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
