"""Recorder test cases: small real FSDP2 jobs, each recorded into ``--out/<case>``.

Run on 2 CPU ranks (gloo) through ``tests.jobs.run_ranks``. Besides the cases below, any name
of ``examples/scenarios.py`` runs that scenario, so one launch (one process-group start) serves
a whole test module. Each case also writes ``<case>/result.rank<r>.json`` with the losses, the
fsdptrace warnings and whatever the case observed from inside the job, so tests can compare
what the recorder wrote with what really happened.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

import fsdptrace
from fsdptrace.record.backends.fsdp2.units import FSDP2Backend

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
import scenarios  # noqa: E402
from harness import DIM, Block, run_cases  # noqa: E402

Result = dict[str, Any]


class Net(nn.Module):
    """Optional embedding, ``num_layers`` blocks, optional head; ``head_method`` runs the head."""

    def __init__(
        self,
        *,
        num_layers: int = 2,
        embed: bool = True,
        head: bool = True,
        head_method: str = "forward",
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, DIM) if embed else None
        self.layers = nn.ModuleList(Block() for _ in range(num_layers))
        self.head = Block() if head else None
        self.head_method = head_method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h)
        if self.head is None:
            return h
        # Calling the module (not .forward) so that module hooks run as in real models.
        return self.head(h) if self.head_method == "forward" else self.head.project(h)


def sharded_net(**kwargs: Any) -> Net:
    """A ``Net`` with one unit per block and the root unit owning the rest."""
    torch.manual_seed(0)
    net = Net(**kwargs)
    for layer in net.layers:
        fully_shard(layer)
    fully_shard(net)
    return net


def train(
    parts: Sequence[nn.Module],
    *,
    run_dir: Path,
    steps: int = 2,
    micro_steps: int = 2,
    before_micro: Callable[[int, int], None] | None = None,
    before_step: Callable[[int], None] | None = None,
    setup: Callable[[Any], None] | None = None,
    record_steps: str | None = None,
    **attach_kwargs: Any,
) -> list[float]:
    """The common loop: attach, ``steps`` x ``micro_steps`` forward/backward, AdamW.

    The parts run one after the other, like pipeline stages held by one rank.
    """
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    with fsdptrace.attach(
        list(parts), run_dir=run_dir, optimizer=optimizer, steps=record_steps, **attach_kwargs
    ) as recorder:
        if setup is not None:
            setup(recorder)
        for step in range(steps):
            for micro in range(micro_steps):
                if before_micro is not None:
                    before_micro(step, micro)
                h = torch.randint(0, 16, (8,), generator=generator)
                for part in parts:
                    h = part(h)
                loss = h.pow(2).mean()
                loss.backward()
                losses.append(loss.item())
            if before_step is not None:
                before_step(step)
            optimizer.step()
            optimizer.zero_grad()
    return losses


# ----------------------------------------------------------------------------- cases
def case_two_parts(run_dir: Path) -> Result:
    """Two model parts on one rank, each its own root: both have a unit at ``layers.0``."""
    first = sharded_net(head=False)
    second = sharded_net(embed=False)
    return {"losses": train([first, second], run_dir=run_dir)}


def case_grouped(run_dir: Path) -> Result:
    """``fully_shard([embed, head])``: one unit over two modules (tied-weights style)."""
    torch.manual_seed(0)
    net = Net()
    for layer in net.layers:
        fully_shard(layer)
    fully_shard([net.embed, net.head])
    fully_shard(net)
    return {"losses": train([net], run_dir=run_dir)}


def case_forward_method(run_dir: Path) -> Result:
    """The head runs through ``project``, registered with ``register_fsdp_forward_method``."""
    torch.manual_seed(0)
    net = Net(head_method="project")
    for module in [*net.layers, net.head]:
        fully_shard(module)
    fully_shard(net)
    register_fsdp_forward_method(net.head, "project")
    return {"losses": train([net], run_dir=run_dir)}


def case_no_sync_boundary(run_dir: Path) -> Result:
    """Sync off for the layers in every micro-step: their gradients stay unsharded.

    ``param.grad`` is None for them at the boundary; the recorder must still see a gradient.
    """
    net = sharded_net()
    seen: list[bool] = []

    def before_micro(step: int, micro: int) -> None:
        for layer in net.layers:
            layer.set_requires_gradient_sync(False)

    def before_step(step: int) -> None:
        seen.extend(p.grad is None for layer in net.layers for p in layer.parameters())

    losses = train([net], run_dir=run_dir, before_micro=before_micro, before_step=before_step)
    return {"losses": losses, "layer_param_grad_is_none": seen}


def _pending_case(run_dir: Path, *, async_op: bool) -> Result:
    net = sharded_net()

    def before_micro(step: int, micro: int) -> None:
        net.set_is_last_backward(False)

    def before_step(step: int) -> None:
        net.layers[1].unshard(async_op=async_op)  # nobody waits for it before the step

    return {
        "losses": train([net], run_dir=run_dir, before_micro=before_micro, before_step=before_step)
    }


def case_pending_unshard(run_dir: Path) -> Result:
    """A stray blocking ``unshard()`` before the step: parameters gathered, never used."""
    return _pending_case(run_dir, async_op=False)


def case_pending_async_unshard(run_dir: Path) -> Result:
    """A stray ``unshard(async_op=True)`` before the step: the all-gather is never waited on."""
    return _pending_case(run_dir, async_op=True)


def case_step_window(run_dir: Path) -> Result:
    """Four optimizer steps, of which only steps 1 and 2 are recorded."""
    return {"losses": train([sharded_net()], run_dir=run_dir, steps=4, record_steps="1:3")}


def _run_with_failing_backend(run_dir: Path, method: str, *, fail_after: int) -> Result:
    """Make one FSDP2 backend read raise after ``fail_after`` good calls, and train as usual.

    Patched on the class before ``attach``: the hooks bind backend methods when installed.
    """
    original = getattr(FSDP2Backend, method)
    calls = [0]

    def flaky(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > fail_after:
            raise RuntimeError(f"planted failure in {method}")
        return original(self, *args, **kwargs)

    setattr(FSDP2Backend, method, flaky)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = train([sharded_net()], run_dir=run_dir)
    finally:
        setattr(FSDP2Backend, method, original)
    return {
        "losses": losses,
        "num_calls": calls[0],
        "warnings": [str(w.message) for w in caught if "fsdptrace" in str(w.message)],
    }


def case_healthy_backend(run_dir: Path) -> Result:
    """The baseline the failing-backend cases compare their losses with."""
    return _run_with_failing_backend(run_dir, "all_gradients", fail_after=10**9)


def case_failing_gradients(run_dir: Path) -> Result:
    """The boundary snapshot fails in step 1 (guarded read at ``optimizer.step``): the
    snapshot reads every unit's gradients in one ``all_gradients`` call per boundary."""
    return _run_with_failing_backend(run_dir, "all_gradients", fail_after=1)


def case_failing_hook(run_dir: Path) -> Result:
    """A read inside the per-unit forward hooks fails from micro-step 1 of step 0 on.

    Hot path: it would fire on every unit of every micro-step if not disabled at once.
    """
    return _run_with_failing_backend(run_dir, "is_recompute", fail_after=3)


def case_killed(run_dir: Path) -> Result:
    """Rank 1 is SIGKILLed at the start of step 2, with nothing converted to Parquet since.

    Rank 1 holds back for ``HOLD_S`` before step 2: rank 0 sits blocked in the root's first
    all-gather meanwhile, and its root entry must be on disk (in its journal) while it is
    blocked. Rank 1 then dies of SIGKILL: its steps 0-1 must read back from its journal.
    """
    net = sharded_net()
    rank = dist.get_rank()
    recorder: Any = None

    def setup(rec: Any) -> None:
        nonlocal recorder
        recorder = rec

    def before_micro(step: int, micro: int) -> None:
        if step == 2 and micro == 0:
            recorder.flush()
            if rank == 1:
                time.sleep(HOLD_S)
                os.kill(os.getpid(), signal.SIGKILL)

    train(
        [net],
        run_dir=run_dir,
        steps=4,
        setup=setup,
        before_micro=before_micro,
        flush_interval_s=0.02,
    )
    return {}


HOLD_S = 1.0


CASES: dict[str, Callable[[Path], Result]] = {
    "two-parts": case_two_parts,
    "grouped": case_grouped,
    "forward-method": case_forward_method,
    "no-sync-boundary": case_no_sync_boundary,
    "pending-unshard": case_pending_unshard,
    "pending-async-unshard": case_pending_async_unshard,
    "step-window": case_step_window,
    "healthy-backend": case_healthy_backend,
    "failing-gradients": case_failing_gradients,
    "failing-hook": case_failing_hook,
    "killed": case_killed,
}


def run_case(name: str, out: Path, rank: int) -> None:
    run_dir = out / name
    if name in CASES:
        result = CASES[name](run_dir)
    else:
        result = {"losses": scenarios.train(scenarios.SCENARIOS[name], run_dir, rank)}
    (run_dir / f"result.rank{rank}.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("cases", nargs="+", choices=sorted([*CASES, *scenarios.SCENARIOS]))
    args = parser.parse_args(argv)
    run_cases(args.cases, lambda name, rank: run_case(name, args.out, rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
