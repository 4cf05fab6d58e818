"""Endings: a real 2-rank FSDP2 job (gloo, CPU) whose rank 1 stops inside a unit's forward.

Trains ``examples/scenarios.py``'s tiny model, recorded with ``fsdptrace.attach`` (no ``with``:
the exit guards alone record the ending). At step 2, micro-step 0, rank 1 enters
``layers.1``'s forward, writes ``<out>/truth.json`` (its last recorded event: step,
micro-step, phase, unit, seq) synchronously, then stops:

- ``hang``: sleeps (the test sends SIGTERM, SIGINT, SIGKILL or SIGABRT);
- ``raise``: raises ``RuntimeError("planted failure in layers.1")``, uncaught.

``--spawn`` runs both ranks under ``torch.multiprocessing.spawn`` instead of the test's launcher
or torchrun. ``--blocked``: rank 1 sleeps outside FSDP at step 2 while rank 0 blocks in a gloo
all-reduce; rank 0 writes ``<out>/blocked.pid`` just before it blocks (``--plain``: unrecorded).
``frozen`` (one rank, ``--run-dir`` on a filesystem the test freezes): at step 2 the rank writes
``<out>/ready`` and waits for ``<out>/go``, trains on, closes (``close_timeout_s=2``) and writes
how long ``close()`` took to ``<out>/close_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdptrace

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
import scenarios  # noqa: E402

STOP_STEP = 2
STOP_UNIT = "layers.1"


def _stop_in_forward(rec: Any, model: Any, case: str, out: Path) -> None:
    last: list[Any] = [None]
    original = rec.record_unit

    def record_unit(index: int, phase: int) -> None:
        original(index, phase)
        last[0] = [rec.step, rec.micro_step, ["forward", "backward"][phase],
                   rec.unit_names[index], rec._seq]

    rec.record_unit = record_unit

    def stop(module: Any, args: Any) -> None:
        if rec.step != STOP_STEP:
            return
        (out / "truth.json").write_text(json.dumps(last[0]))
        print("stopping", flush=True)
        if case == "raise":
            raise RuntimeError("planted failure in layers.1")
        time.sleep(600)

    # Registered after fsdptrace's (prepended) hook: the unit's entry is recorded first.
    model.layers[1].register_forward_pre_hook(stop)


def train(rank: int, case: str, out: Path, flush_s: float, plain: bool,
          run_dir: Path | None = None) -> None:
    sc = scenarios.Scenario()
    model, optimizer = scenarios.build(sc, rank)
    rec = None if plain else fsdptrace.attach(model, run_dir=run_dir or out / "run",
                                              optimizer=optimizer, flush_interval_s=flush_s,
                                              close_timeout_s=2.0)
    if rank == 1 and rec is not None and case in ("hang", "raise"):
        _stop_in_forward(rec, model, case, out)
    generator = torch.Generator().manual_seed(rank)
    for step in range(4):
        if case == "blocked" and step == STOP_STEP:
            _block(rank, out)
        if case == "frozen" and step == STOP_STEP:
            _wait_for_go(out)
        for _micro in range(sc.micro_steps):
            tokens = torch.randint(0, 32, (32,), generator=generator)
            model(tokens).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if rec is not None:
        started = time.monotonic()
        rec.close()
        if case == "frozen":
            (out / "close_s").write_text(f"{time.monotonic() - started:.3f}")


def _wait_for_go(out: Path) -> None:
    (out / "ready").write_text("")
    while not (out / "go").exists():
        time.sleep(0.02)


def _block(rank: int, out: Path) -> None:
    if rank == 1:
        time.sleep(600)
    (out / "blocked.pid").write_text(str(os.getpid()))
    dist.all_reduce(torch.ones(1))  # the main thread waits inside gloo, in C++


def _spawned(rank: int, case: str, out: str, flush_s: float) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo")
    train(rank, case, Path(out), flush_s, False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--flush", type=float, default=60.0)
    parser.add_argument("--spawn", action="store_true")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--run-dir", type=Path)
    parser.add_argument("case", choices=["hang", "raise", "blocked", "frozen"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.spawn:
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(args.case, str(args.out), args.flush), nprocs=2)
        return 0
    dist.init_process_group("gloo")
    train(dist.get_rank(), args.case, args.out, args.flush, args.plain, args.run_dir)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
