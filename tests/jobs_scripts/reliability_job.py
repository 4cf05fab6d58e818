"""Reliability cases: real 2-rank FSDP2 jobs (gloo, CPU) that fail in the ways jobs fail.

Run through ``tests.jobs.start_ranks``. Each case trains ``examples/scenarios.py``'s tiny model
(with its prefetch edges) and writes ``<out>/<case>.rank<r>.json``: losses and final
parameters as exact hex, the fsdptrace warnings, and what the case observed. Cases:

- ``plain``: no fsdptrace at all (the reference for "recording never changes training");
- ``recorded``, ``raise``: recorded, the second with ``raise_on_violation=True``;
- ``disk-full``: the run dir is a tiny tmpfs the test mounted (``--run-root``), that fills up;
- ``not-a-dir``: the run dir lies under a regular file (ENOTDIR on the first write);
- ``broken-backward-record``, ``broken-part-hook``: recorder internals raise inside hooks;
- ``long``: many short steps, for the test to SIGKILL ranks at random points;
- ``hang``: rank 1 sleeps mid-backward of step 2 while rank 0 blocks in a collective; a
  watchdog thread keeps ``truth.rank<r>.json`` with the last unit each rank entered;
- ``signals``: in step 2, after the first forward, rank 0 gets SIGTERM and rank 1 SIGINT.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdptrace

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
import scenarios  # noqa: E402

HANG_STEP = 2


def _params_hex(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter's full value, hashed bit-exactly (gathered: a collective on all ranks)."""
    out = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = hashlib.sha256(full.detach().contiguous().numpy().tobytes()).hexdigest()
    return out


def _watch_last_unit(rec: Any, path: Path) -> None:
    """Keep, on disk, the last unit this rank entered, from memory (the ground truth)."""
    last: list[Any] = [None]
    original = rec.record_unit

    def record_unit(index: int, phase: int) -> None:
        original(index, phase)
        last[0] = [rec.step, rec.micro_step, ["forward", "backward"][phase],
                   rec.unit_names[index], rec._seq]

    rec.record_unit = record_unit

    def loop() -> None:
        while True:
            if last[0] is not None:
                temp = path.with_suffix(".tmp")
                temp.write_text(json.dumps(last[0]))
                os.replace(temp, path)
            time.sleep(0.05)

    threading.Thread(target=loop, daemon=True).start()


def _break(rec: Any, what: str, after: int) -> None:
    """Make one recorder entry point raise after ``after`` good calls."""
    calls = [0]
    original = getattr(rec, what)

    def broken(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError(f"planted failure in {what}")
        return original(*args)

    setattr(rec, what, broken)


def train(case: str, *, out: Path, run_root: Path, rank: int, steps: int) -> dict[str, Any]:
    sc = scenarios.Scenario()
    model, optimizer = scenarios.build(sc, rank)
    generator = torch.Generator().manual_seed(rank)
    run_dir = {"disk-full": run_root / "run", "not-a-dir": out / "a-file" / "run"}.get(
        case, out / case)
    if case == "not-a-dir":
        (out / "a-file").write_text("not a directory")
    flush = {"long": 0.05, "hang": 0.2, "signals": 60.0, "disk-full": 0.05}.get(case, 2.0)
    losses: list[str] = []
    observed: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Inside: a run dir that cannot hold the journal warns at attach.
        recorder = (nullcontext(None) if case == "plain" else fsdptrace.attach(
            model, run_dir=run_dir, optimizer=optimizer, raise_on_violation=case == "raise",
            flush_interval_s=flush))
        with recorder as rec:
            if case == "hang":
                _watch_last_unit(rec, out / f"truth.rank{rank}.json")
            if case == "broken-backward-record":
                _break(rec, "record_unit", after=8)  # fails in step 0's first backward
            if case == "broken-part-hook":
                _break(rec, "on_part_forward", after=1)  # fails at micro-step 1
            for step in range(steps):
                for micro in range(sc.micro_steps):
                    tokens = torch.randint(0, 32, (32,), generator=generator)
                    model.hang_hook = case == "hang" and rank == 1 and step == HANG_STEP
                    loss = _forward(model, tokens, hang=model.hang_hook)
                    if case == "signals" and step == 2 and micro == 0:
                        _signal_self(rec, out, rank)
                    loss.backward()
                    losses.append(loss.item().hex())
                optimizer.step()
                optimizer.zero_grad()
                if case == "long":
                    time.sleep(0.05)
    if rec is not None:
        observed["enabled"] = rec.enabled
        observed["bytes_written"] = rec.bytes_written
        observed["num_seq"] = rec._seq
    return {
        "losses": losses,
        "params": _params_hex(model),
        "warnings": [str(w.message) for w in caught if "fsdptrace" in str(w.message)],
        **observed,
    }


def _forward(model: Any, tokens: torch.Tensor, *, hang: bool) -> torch.Tensor:
    if hang:
        # Sleep when the gradient reaches layer 1's output: mid-backward, after the units
        # behind it began theirs. The other rank blocks in its next collective meanwhile.
        def sleep(grad: torch.Tensor) -> torch.Tensor:
            time.sleep(600)
            return grad

        def watch(module: Any, args: Any, output: torch.Tensor) -> None:
            output.register_hook(sleep)

        handle = model.layers[1].register_forward_hook(watch)
        try:
            return model(tokens).float().pow(2).mean()
        finally:
            handle.remove()
    return model(tokens).float().pow(2).mean()


def _signal_self(rec: Any, out: Path, rank: int) -> None:
    """Leave the last recorded seq for the test, then get stopped the way torchrun stops."""
    (out / f"signals.rank{rank}.json").write_text(json.dumps({"seq": rec._seq}))
    os.kill(os.getpid(), signal.SIGTERM if rank == 0 else signal.SIGINT)
    time.sleep(5)  # SIGINT becomes KeyboardInterrupt here; SIGTERM ends the process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--run-root", type=Path, default=Path("/nonexistent"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for case in args.cases:
            result = train(case, out=args.out, run_root=args.run_root, rank=rank,
                           steps=args.steps)
            (args.out / f"{case}.rank{rank}.json").write_text(json.dumps(result))
            print(f"done {case}", flush=True)
            dist.barrier()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        os._exit(130)
    dist.destroy_process_group()
    # Every case's result is on disk and every recorder closed (each case waits for its
    # writer's ``done``). Leave without the interpreter's C++ teardown: torch's gloo threads
    # sometimes abort it ("terminate called without an active exception", exit -6; seen in
    # CI after every case had passed), which is torch's, not the recording's.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
