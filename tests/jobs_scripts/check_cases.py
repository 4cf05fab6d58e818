"""Jobs for the version-2 rules of checks 2, 3, 9 and the clean twins of checks 10-12.

``python check_cases.py --out DIR CASE...`` on 2 gloo ranks records each case into
``DIR/CASE`` (one process group for all of them); none of them ends in a mismatched
collective. ``CASE_live`` runs a case with the live checks raising before
``optimizer.step()``. Each rank writes ``DIR/CASE/result.rank<r>.json`` with what it
observed; what FSDP2 does in each case is in the test's docstring (``tests/test_checks_v2.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import fsdptrace
from fsdptrace.errors import LifecycleError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from divergence_job import Net, batch, skipped_unit  # noqa: E402
from harness import run_cases  # noqa: E402

STEPS = 2
LIVE = "_live"  # a case name ending so runs with raise_on_violation (checks 1-3 live)
MICRO_STEPS = 2
LIVE = "_live"  # a case name ending so runs with raise_on_violation (checks 1-3 live)


def sharded(**kwargs: Any) -> Net:
    torch.manual_seed(0)
    net = Net()
    for block in (net.a, net.b, net.c):
        fully_shard(block, **kwargs)
    fully_shard(net, **kwargs)
    return net


def bypass_kept_buffers(net: Net, optimizer: Any, rank: int, seen: dict[str, Any]) -> None:
    """On odd steps ``b`` is unsharded by hand and its weight used without its forward;
    ``zero_grad(set_to_none=False)`` keeps every buffer between steps."""
    for step in range(4):
        bypass = step % 2 == 1
        if bypass:
            net.b.unshard()
        h = net.a(batch())
        h = h + F.linear(h, net.b.fc.weight) if bypass else net.b(h)
        net.c(h).sum().backward()
        weight = net.b.fc.weight
        seen.setdefault("b_weight_after_backward", []).append(
            [type(weight).__name__, weight.grad is not None
             and bool(weight.grad.to_local().abs().sum() > 0 if hasattr(weight.grad, "to_local")
                      else weight.grad.abs().sum() > 0)])
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)


def chain(net: Net) -> None:
    net.a.set_modules_to_forward_prefetch([net.b])
    net.b.set_modules_to_forward_prefetch([net.c])


def _accumulate(net: Net, optimizer: Any, seen: dict[str, Any], *, last: bool) -> None:
    """Two micro-steps per step, ``reshard_after_backward`` False but for the last one's
    backward when ``last``."""
    chain(net)
    for _ in range(STEPS):
        for micro in range(MICRO_STEPS):
            net.set_reshard_after_backward(last and micro == MICRO_STEPS - 1)
            net(batch()).sum().backward()
        seen.setdefault("b_unsharded_at_boundary", []).append(
            bool(net.b._get_fsdp_state()._fsdp_param_group.is_unsharded))
        optimizer.step()
        optimizer.zero_grad()


def accumulate_unsharded(net: Net, optimizer: Any, rank: int, seen: dict[str, Any]) -> None:
    """Gradient accumulation with ``reshard_after_backward=False`` but for the last backward."""
    _accumulate(net, optimizer, seen, last=True)


def reshard_after_backward_left_off(net: Net, optimizer: Any, rank: int, seen: dict[str, Any]
                                    ) -> None:
    """As ``accumulate_unsharded``, but ``reshard_after_backward`` stays False."""
    _accumulate(net, optimizer, seen, last=False)


def dead_edge(net: Net, optimizer: Any, rank: int, seen: dict[str, Any]) -> None:
    """``a`` prefetches ``b`` and ``c`` in forward, and ``b`` prefetches ``c`` too."""
    net.a.set_modules_to_forward_prefetch([net.b, net.c])
    net.b.set_modules_to_forward_prefetch([net.c])
    for _ in range(STEPS):
        for _ in range(MICRO_STEPS):
            net(batch()).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def eval_before_step(net: Net, optimizer: Any, rank: int, seen: dict[str, Any]) -> None:
    """Units sharded with ``reshard_after_forward=False``; a no_grad forward runs between the
    backward and ``optimizer.step()`` (validation at the end of a step)."""
    for _ in range(STEPS):
        net(batch()).sum().backward()
        with torch.no_grad():
            net(batch())
        seen.setdefault("b_unsharded_at_boundary", []).append(
            bool(net.b._get_fsdp_state()._fsdp_param_group.is_unsharded))
        optimizer.step()
        optimizer.zero_grad()


def even_eval(net: Net, optimizer: Any, rank: int, seen: dict[str, Any]) -> None:
    """One training step, then 2 validation batches on every rank."""
    net(batch()).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for _ in range(2):
            net(batch())


def same_sync(net: Net, optimizer: Any, rank: int, seen: dict[str, Any]) -> None:
    """Two micro-steps, gradient sync off then on, on every rank; ``c``'s branch on both."""
    for micro in range(MICRO_STEPS):
        net.set_requires_gradient_sync(micro == MICRO_STEPS - 1)
        net(batch(), extra=micro == 0).sum().backward()
    optimizer.step()


CASES: dict[str, tuple[Callable[[Net, Any, int, dict[str, Any]], None], dict[str, Any]]] = {
    "skipped_unit": (skipped_unit, {}),
    "bypass_kept_buffers": (bypass_kept_buffers, {}),
    "accumulate_unsharded": (accumulate_unsharded, {}),
    "reshard_after_backward_left_off": (reshard_after_backward_left_off, {}),
    "dead_edge": (dead_edge, {}),
    "eval_before_step": (eval_before_step, {"reshard_after_forward": False}),
    "even_eval": (even_eval, {}),
    "same_sync": (same_sync, {}),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("cases", nargs="+",
                        choices=sorted(CASES) + [name + LIVE for name in sorted(CASES)])
    args = parser.parse_args(argv)

    def run_case(name: str, rank: int) -> None:
        live = name.endswith(LIVE)
        scenario, shard_kwargs = CASES[name.removesuffix(LIVE)]
        run_dir = args.out / name
        net = sharded(**shard_kwargs)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        seen: dict[str, Any] = {}
        try:
            with fsdptrace.attach(net, run_dir=run_dir, optimizer=optimizer,
                                  raise_on_violation=live):
                scenario(net, optimizer, rank, seen)
        except LifecycleError as error:  # both ranks raise at the same boundary
            seen["raised"] = {"step": int(error.findings["step"].iloc[0]),
                              "checks": sorted(set(error.findings["check"]))}
        (run_dir / f"result.rank{rank}.json").write_text(json.dumps(seen))

    run_cases(args.cases, run_case)


if __name__ == "__main__":
    main()
