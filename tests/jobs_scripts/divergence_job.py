"""Jobs whose ranks diverge in what the checks of version 2 read: gradients, eval, settings.

``python divergence_job.py --out DIR SCENARIO`` on 2 gloo ranks records into ``DIR``. Some
scenarios end in a collective the ranks no longer agree on; a short process-group timeout
and the launcher's deadline keep every one bounded. Each rank writes ``result.rank<r>.json``
(what it observed) as far as it got; what FSDP2 does in each is in the test's docstring.
"""

from __future__ import annotations

import argparse
import json
import sys
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

# Long enough for a 2-core box under load, short enough that a mismatched collective fails
# inside the test's budget instead of waiting 30 minutes.
COLLECTIVE_TIMEOUT = timedelta(seconds=6)


class Branchy(Block):
    """A block with a branch some forwards take (conditional parameter use)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        h = super().forward(x)
        return h + self.extra(h) if extra else h


class Net(nn.Module):
    """Three blocks; ``skip`` leaves ``b`` out, ``extra`` takes ``c``'s branch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = Block(), Block(), Branchy()

    def forward(self, x: torch.Tensor, *, skip: bool = False, extra: bool = False
                ) -> torch.Tensor:
        h = self.a(x)
        if not skip:
            h = self.b(h)
        return self.c(h, extra=extra)  # type: ignore[no-any-return]


def sharded() -> Net:
    torch.manual_seed(0)
    net = Net()
    for block in (net.a, net.b, net.c):
        fully_shard(block)
    fully_shard(net)
    return net


def batch() -> torch.Tensor:
    return torch.randn(4, DIM)


def skipped_unit(net: Net, optimizer: Any, rank: int, seen: dict[str, Any]) -> None:
    """``b`` skipped on odd steps, ``zero_grad(set_to_none=False)`` keeping its buffers."""
    for step in range(4):
        net(batch(), skip=step % 2 == 1).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        seen.setdefault("b_grad_after_zero_grad", []).append(net.b.fc.weight.grad is not None)


def one_rank_param_in_no_sync(net: Net, optimizer: Any, rank: int, seen: dict[str, Any]
                              ) -> None:
    """Rank 1 alone runs ``c.extra`` in a no-sync micro-step; the next one syncs."""
    net.set_requires_gradient_sync(False)
    net(batch(), extra=rank == 1).sum().backward()
    seen["no_sync_done"] = True
    net.set_requires_gradient_sync(True)
    net(batch()).sum().backward()
    seen["sync_done"] = True


def one_rank_param_told_unused(net: Net, optimizer: Any, rank: int, seen: dict[str, Any]
                               ) -> None:
    """As ``one_rank_param_in_no_sync``, the ranks told ``set_reduce_scatter_unused_params``."""
    net.set_reduce_scatter_unused_params(True)
    one_rank_param_in_no_sync(net, optimizer, rank, seen)
    optimizer.step()


def uneven_eval(net: Net, optimizer: Any, rank: int, seen: dict[str, Any]) -> None:
    """One training step, then 2 validation batches on rank 0 and 3 on rank 1."""
    net(batch()).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for index in range(2 + rank):
            net(batch())
            seen["eval_batches"] = index + 1


def one_rank_skips_sync(net: Net, optimizer: Any, rank: int, seen: dict[str, Any]) -> None:
    """Two micro-steps without gradient sync but the last one on rank 0: rank 0 alone syncs."""
    for micro in range(2):
        net.set_requires_gradient_sync(micro == 1 and rank == 0)
        net(batch()).sum().backward()
        seen["micro_steps"] = micro + 1
    optimizer.step()
    seen["optimizer_steps"] = 1


SCENARIOS: dict[str, Callable[[Net, Any, int, dict[str, Any]], None]] = {
    "skipped_unit": skipped_unit,
    "one_rank_param_in_no_sync": one_rank_param_in_no_sync,
    "one_rank_param_told_unused": one_rank_param_told_unused,
    "uneven_eval": uneven_eval,
    "one_rank_skips_sync": one_rank_skips_sync,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    rank = dist.get_rank()
    net = sharded()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    seen: dict[str, Any] = {"error": None}
    result = args.out / f"result.rank{rank}.json"
    try:
        with fsdptrace.attach(net, run_dir=args.out, optimizer=optimizer):
            SCENARIOS[args.scenario](net, optimizer, rank, seen)
    except Exception as error:  # a mismatched collective: what the test judges is recorded
        seen["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    finally:
        result.write_text(json.dumps(seen))
    if seen["error"] is None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
