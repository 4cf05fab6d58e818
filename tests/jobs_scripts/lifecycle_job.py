"""A recorded process lives and dies as it would without fsdptrace (one rank, gloo, CPU).

Cases (``<out>/<case>.json`` holds what the case observed):

- ``fork``: attach, train a step, flush; hash every file of the run dir; ``os.fork()`` a child
  that trains a step and exits normally; hash again (the parent's files must not change);
- ``gc``: attach, train, close, ``del``: is the model garbage-collected (a weakref)?
- ``two-models``: attach two models into one run dir: the second is refused;
- ``reset``: a micro-step's forward, then ``reset_iter_state()`` instead of its backward (the
  micro-step is aborted), then whole steps and a close.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdptrace
from fsdptrace.store.schema import TABLES

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
import scenarios  # noqa: E402


def _step(model: Any, optimizer: Any) -> None:
    tokens = torch.randint(0, 32, (32,), generator=torch.Generator().manual_seed(0))
    model(tokens).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _hashes(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _wait_for_starter_parts(run_dir: Path, timeout_s: float = 20.0) -> None:
    """The parent's own writer process writes every table's first (empty) part soon after
    attach: wait for it, so only a write by the child could change the files."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(any((run_dir / table).glob("rank=0/part-*.parquet")) for table in TABLES):
            return
        time.sleep(0.05)


def _settled_hashes(run_dir: Path, quiet_s: float = 2.5, timeout_s: float = 30.0
                    ) -> dict[str, str]:
    """The run dir's hashes once the parent's own writer process has finished its passes
    (unchanged over more than its flush interval): on a loaded machine its pass over the
    flushed rows could otherwise land while the child runs and pass for the child's write."""
    deadline = time.monotonic() + timeout_s
    seen = _hashes(run_dir)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = _hashes(run_dir)
        if now == seen:
            return now
        seen = now
    return seen


def fork(out: Path) -> dict[str, Any]:
    model, optimizer = scenarios.build(scenarios.Scenario(), 0)
    rec = fsdptrace.attach(model, run_dir=out / "run", optimizer=optimizer)
    _step(model, optimizer)
    _step(model, optimizer)
    tokens = torch.randint(0, 32, (32,))
    model(tokens).float().pow(2).mean()  # a micro-step open, rows buffered, at the fork
    rec.flush()
    _wait_for_starter_parts(out / "run")
    before = _settled_hashes(out / "run")
    pid = os.fork()
    if pid == 0:  # the child trains on and exits normally (exit handlers run)
        _step(model, optimizer)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    after = _hashes(out / "run")
    rec.close()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return {"child_status": status, "same": before == after, "num_files": len(before),
            "changed": changed}


def collected(out: Path) -> dict[str, Any]:
    model, optimizer = scenarios.build(scenarios.Scenario(), 0)
    rec = fsdptrace.attach(model, run_dir=out / "run", optimizer=optimizer)
    _step(model, optimizer)
    rec.close()
    alive = weakref.ref(model)
    del model, optimizer, rec
    gc.collect()
    return {"collected": alive() is None}


def two_models(out: Path) -> dict[str, Any]:
    first, opt_first = scenarios.build(scenarios.Scenario(), 0)
    second, opt_second = scenarios.build(scenarios.Scenario(), 0)
    rec = fsdptrace.attach(first, run_dir=out / "run", optimizer=opt_first)
    try:
        fsdptrace.attach(second, run_dir=out / "run", optimizer=opt_second)
        refused = ""
    except fsdptrace.FsdptraceError as error:
        refused = str(error)
    again = fsdptrace.attach(first, run_dir=out / "run", optimizer=opt_first)  # same parts
    rec.close()
    again.close()
    return {"refused": refused}


def reset(out: Path) -> dict[str, Any]:
    model, optimizer = scenarios.build(scenarios.Scenario(), 0)
    rec = fsdptrace.attach(model, run_dir=out / "run", optimizer=optimizer)
    _step(model, optimizer)
    model(torch.randint(0, 32, (32,)))  # a forward whose backward never comes
    model.reset_iter_state()
    optimizer.zero_grad()
    _step(model, optimizer)
    _step(model, optimizer)
    rec.close()
    return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("case", choices=["fork", "gc", "two-models", "reset"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    run = {"fork": fork, "gc": collected, "two-models": two_models, "reset": reset}[args.case]
    (args.out / f"{args.case}.json").write_text(json.dumps(run(args.out)))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
