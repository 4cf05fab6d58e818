"""Jobs whose ranks do something different just before they stop: the hang verdict's cases.

``python verdict_job.py --out DIR --case CASE[,CASE...] [--clean]`` on 2 or 4 gloo ranks
records each case into ``DIR/<case>``. ``--clean`` runs the same job with every rank doing the
same (the clean twin; several clean twins share one launch). Each rank writes
``result.rank<r>.json`` (what it saw) as far as it got, and ``stopping.rank<r>`` just before
the place where a case hangs on purpose, so a test knows when to look.
What FSDP2 and gloo do in each case is in the tests' docstrings (tests/test_verdict_jobs.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdptrace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import DIM, Block  # noqa: E402

# A mismatched collective that gloo notices fails fast; one it cannot notice waits this long
# (the hang cases are ended by the test with a signal long before).
COLLECTIVE_TIMEOUT = timedelta(seconds=8)
HANG_TIMEOUT = timedelta(seconds=600)


class Experts(nn.Module):
    """A MoE-style layer: two experts, each its own unit; ``drop`` leaves expert 1 out."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor, drop: bool = False) -> torch.Tensor:
        out = self.experts[0](x)
        return out if drop else out + self.experts[1](x)


class Net(nn.Module):
    """``layers.0..3``, then ``moe``, then ``head``: seven units with the root."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(4)])
        self.moe = Experts()
        self.head = Block()

    def forward(self, x: torch.Tensor, *, skip: int | None = None, drop: bool = False,
                stall: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if index != skip:
                x = layer(x)
            if index == 1 and stall is not None:  # runs in backward, between layers 2 and 1
                x.register_hook(stall)
        return self.head(self.moe(x, drop=drop))  # type: ignore[no-any-return]


def sharded(*, reshard_after_forward: bool = True, head_unit: bool = True) -> Net:
    """``head_unit`` false: ``head`` is no unit of its own (the root's group holds it)."""
    torch.manual_seed(0)
    net = Net()
    for module in (*net.layers, *net.moe.experts, *([net.head] if head_unit else [])):
        fully_shard(module, reshard_after_forward=reshard_after_forward)
    fully_shard(net)
    return net


def batch() -> torch.Tensor:
    return torch.randn(4, DIM)


def stopping(out: Path, rank: int) -> None:
    (out / f"stopping.rank{rank}").write_text(str(time.time()))


def drop_expert(net: Net, optimizer: Any, rank: int, clean: bool, out: Path,
                seen: dict[str, Any]) -> None:
    """Rank 1 drops ``moe.experts.1`` in step 1, micro-step 0 (two micro-steps a step)."""
    for step in range(3):
        for micro in range(2):
            drop = not clean and rank == 1 and (step, micro) == (1, 0)
            net(batch(), drop=drop).sum().backward()
            seen["done"] = [step, micro]
        optimizer.step()
        optimizer.zero_grad()


def skip_layer(net: Net, optimizer: Any, rank: int, clean: bool, out: Path,
               seen: dict[str, Any]) -> None:
    """Rank 1 skips ``layers.2`` at step 1; a hang the test ends with a signal."""
    for step in range(3):
        if step == 1:
            stopping(out, rank)
        net(batch(), skip=2 if not clean and rank == 1 and step == 1 else None).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        seen["done"] = step


def _eval(net: Net, batches: int, seen: dict[str, Any]) -> None:
    with torch.no_grad():
        for index in range(batches):
            net(batch())
            seen["eval_batches"] = index + 1


def extra_eval(net: Net, optimizer: Any, rank: int, clean: bool, out: Path,
               seen: dict[str, Any]) -> None:
    """Two training steps, each followed by 2 eval batches; rank 0 runs a 3rd after step 1."""
    for step in range(2):
        net(batch()).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        _eval(net, 3 if not clean and rank == 0 and step == 1 else 2, seen)
    net(batch()).sum().backward()
    optimizer.step()
    seen["done"] = True


def eval_rank0(net: Net, optimizer: Any, rank: int, clean: bool, out: Path,
               seen: dict[str, Any]) -> None:
    """One training step, then validation (2 batches) on rank 0 only; then training again."""
    net(batch()).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    if clean or rank == 0:
        _eval(net, 2, seen)
    net(batch()).sum().backward()
    optimizer.step()
    seen["done"] = True


def nosync_stall(net: Net, optimizer: Any, rank: int, clean: bool, out: Path,
                 seen: dict[str, Any]) -> None:
    """Two micro-steps a step, the first without gradient sync; in step 1's first micro-step
    rank 1 blocks for good in the middle of its backward (a gradient hook between ``layers.2``
    and ``layers.1``). Units keep their parameters after forward (``reshard_after_forward``
    false), so a no-sync backward issues no collective and rank 0 finishes it alone."""
    for step in range(3):
        for micro in range(2):
            net.set_requires_gradient_sync(micro == 1)
            stall = not clean and rank == 1 and (step, micro) == (1, 0)
            net(batch(), stall=(lambda grad: _block_forever(out, rank)) if stall else None
                ).sum().backward()
            seen["done"] = [step, micro]
        optimizer.step()
        optimizer.zero_grad()


def _block_forever(out: Path, rank: int) -> None:
    stopping(out, rank)
    while True:
        time.sleep(1)


def dead_edge(net: Net, optimizer: Any, rank: int, clean: bool, out: Path,
              seen: dict[str, Any]) -> None:
    """``layers.1`` prefetches ``layers.2`` in forward; three micro-steps, resharding after
    backward only in the last, so ``layers.2`` enters micro-steps 1 and 2 unsharded (by
    design). Not ``--clean``: ``layers.0`` prefetches ``layers.2`` too, so in micro-step 0
    ``layers.1``'s edge finds it gathered by another unit."""
    layers = net.layers
    layers[1].set_modules_to_forward_prefetch([layers[2]])
    if not clean:
        layers[0].set_modules_to_forward_prefetch([layers[2]])
    for micro in range(3):
        net.set_reshard_after_backward(micro == 2)
        net(batch()).sum().backward()
        seen["done"] = micro
    optimizer.step()
    optimizer.zero_grad()


def skip_backward(net: Net, optimizer: Any, rank: int, clean: bool, out: Path,
                  seen: dict[str, Any]) -> None:
    """Rank 1 finds its loss bad in step 1 and goes on to the next batch without a backward
    (nor an optimizer step): a common guard against NaN losses, when only one rank sees it."""
    for step in range(3):
        loss = net(batch()).sum()
        if not clean and rank == 1 and step == 1:
            seen["skipped"] = step
            continue
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seen["done"] = step


def extra_micro_step(net: Net, optimizer: Any, rank: int, clean: bool, out: Path,
                     seen: dict[str, Any]) -> None:
    """Two micro-steps a step, but rank 0 accumulates three in step 1 (uneven data)."""
    for step in range(3):
        for micro in range(3 if not clean and rank == 0 and step == 1 else 2):
            net(batch()).sum().backward()
            seen["done"] = [step, micro]
        optimizer.step()
        optimizer.zero_grad()


def _plain_steps(net: Net, optimizer: Any, seen: dict[str, Any], *, last: int = 2) -> None:
    """Steps 0 to ``last``, one micro-step each."""
    for step in range(last + 1):
        net(batch()).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        seen["done"] = step


def early_stop(net: Net, optimizer: Any, rank: int, clean: bool, out: Path,
               seen: dict[str, Any]) -> None:
    """Three steps, but rank 1 decides on its own (an early-stopping rule on its local loss)
    to stop after step 1, and leaves the loop: its recording closes cleanly."""
    _plain_steps(net, optimizer, seen, last=1 if not clean and rank == 1 else 2)


def wrap_differs(net: Net, optimizer: Any, rank: int, clean: bool, out: Path,
                 seen: dict[str, Any]) -> None:
    """Three plain steps; on rank 1 ``head`` was not wrapped as a unit of its own (a wrapping
    policy that decided differently on one rank: ``sharded(head_unit=False)``)."""
    _plain_steps(net, optimizer, seen)


CASES: dict[str, Callable[..., None]] = {
    "drop_expert": drop_expert, "skip_layer": skip_layer, "extra_eval": extra_eval,
    "eval_rank0": eval_rank0, "nosync_stall": nosync_stall, "dead_edge": dead_edge,
    "skip_backward": skip_backward, "extra_micro_step": extra_micro_step,
    "early_stop": early_stop, "wrap_differs": wrap_differs,
}
HANGS = {"skip_layer", "nosync_stall"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", required=True, help="one case, or several (comma-separated) "
                        "that end cleanly; each records into OUT/<case>")
    parser.add_argument("--clean", action="store_true")
    args = parser.parse_args()
    cases = args.case.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; known: {sorted(CASES)}")
    hangs = bool(set(cases) & HANGS) and not args.clean
    dist.init_process_group("gloo", timeout=HANG_TIMEOUT if hangs else COLLECTIVE_TIMEOUT)
    rank = dist.get_rank()
    failed = False
    for case in cases:
        failed = _run_case(case, rank, args.clean, args.out / case)
        if failed:
            break
        dist.barrier()  # no rank runs ahead into the next case's collectives
    if not failed:
        dist.destroy_process_group()


def _run_case(case: str, rank: int, clean: bool, out: Path) -> bool:
    """One case in its own run dir; True when a collective failed (the group is broken)."""
    out.mkdir(parents=True, exist_ok=True)
    net = sharded(reshard_after_forward=case != "nosync_stall",
                  head_unit=clean or case != "wrap_differs" or rank != 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    seen: dict[str, Any] = {"error": None}
    try:
        with fsdptrace.attach(net, run_dir=out, optimizer=optimizer):
            CASES[case](net, optimizer, rank, clean, out, seen)
    except Exception as error:  # a mismatched collective: what the test judges is recorded
        seen["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    finally:
        (out / f"result.rank{rank}.json").write_text(json.dumps(seen))
    return seen["error"] is not None


if __name__ == "__main__":
    main()
