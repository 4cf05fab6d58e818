"""Live-raising cases on real FSDP2: many cases in one process group, results as JSON.

Run on 2 CPU ranks (gloo) through ``tests.jobs.run_ranks``; each case records into
``--out/<case>``. Rank 0 prints one line ``RESULTS <json>`` mapping case name to what it
observed: whether ``optimizer.step()`` raised (type, message, at which step), whether any
parameter or optimizer state changed, and for the trainer-helper case what FSDP held after
each micro-step. Both ranks plant the same problem, so both raise at the same boundary and
the process group stays in step for the next case.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

import fsdptrace
from fsdptrace.record import policies

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
import scenarios  # noqa: E402

Result = dict[str, Any]
RAISING = ["wrong-forward-prefetch", "wrong-backward-prefetch", "missing-target",
           "bypassed-child", "pending-all-gather"]
CLEAN = ["clean", "clean-checkpoint-accumulation", "clean-reentrant-checkpoint"]
POLICY_MICRO_STEPS = 3


def _local_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter, read from FSDP's sharded parameters.

    ``model.parameters()`` is not it: a unit left gathered (the bypassed child, a stray
    ``unshard()``) exposes its unsharded parameters there.
    """
    shards = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    local = fsdp_param.sharded_param.to_local()
                    shards[fsdp_param._param_fqn] = local.detach().clone()
    return shards


def _changed(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, p in _local_params(model).items() if not torch.equal(p, before[n])]


def run_scenario(name: str, run_dir: Path, rank: int) -> Result:
    """``examples/scenarios.py``'s loop with live raising on, watching the optimizer step."""
    sc = replace(scenarios.SCENARIOS[name], raise_on_violation=True)
    model, optimizer = scenarios.build(sc, rank)
    generator = torch.Generator().manual_seed(rank)
    result: Result = {"raised": None, "steps_done": 0}
    before: dict[str, torch.Tensor] = {}
    try:
        with fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer,
                              raise_on_violation=True):
            for step in range(sc.steps):
                for micro in range(sc.micro_steps):
                    if sc.no_sync:
                        model.set_requires_gradient_sync(micro == sc.micro_steps - 1)
                    if sc.pending_all_gather:
                        model.set_is_last_backward(False)
                    if sc.bypassed_child:
                        model.adapter.unshard()
                    tokens = torch.randint(0, 32, (32,), generator=generator)
                    model(tokens).float().pow(2).mean().backward()
                if sc.pending_all_gather:
                    model.layers[1].unshard()
                before = _local_params(model)
                optimizer.step()
                optimizer.zero_grad()
                result["steps_done"] = step + 1
                if sc.eval_between_steps:
                    with torch.no_grad():
                        model(torch.randint(0, 32, (16,), generator=generator))
    except Exception as error:  # the case reports what was raised; the test judges it
        result["raised"] = {"type": type(error).__name__, "message": str(error),
                            "is_lifecycle_error": isinstance(error, fsdptrace.LifecycleError)}
    result["changed_by_last_step"] = _changed(model, before)
    result["optimizer_state_size"] = len(optimizer.state)
    return result


def run_policies(run_dir: Path, rank: int) -> Result:
    """The trainer helpers driving accumulation, checkpointed layers, live raising on."""
    sc = replace(scenarios.SCENARIOS["clean"], checkpoint="nonreentrant", steps=2,
                 micro_steps=POLICY_MICRO_STEPS)
    model, optimizer = scenarios.build(sc, rank)
    generator = torch.Generator().manual_seed(rank)
    observed: list[dict[str, Any]] = []
    with fsdptrace.attach(model, run_dir=run_dir, optimizer=optimizer, raise_on_violation=True):
        for _ in range(sc.steps):
            for micro in range(sc.micro_steps):
                policies.model_reshard([model], reshard_after_backward=False, micro_step=micro,
                                       num_micro_steps=sc.micro_steps)
                policies.configure_gradient_sync(
                    [model], requires_grad_sync=False, dp_shard_size=dist.get_world_size(),
                    dp_replicate_size=1, micro_step=micro, num_micro_steps=sc.micro_steps)
                tokens = torch.randint(0, 32, (32,), generator=generator)
                model(tokens).pow(2).mean().backward()
                observed.append(_fsdp_settings(model))
            optimizer.step()
            optimizer.zero_grad()
    return {"observed": observed}


def _fsdp_settings(model: scenarios.TinyModel) -> dict[str, Any]:
    """What FSDP itself holds after a backward: the flags the helpers set."""
    state = model.layers[0]._get_fsdp_state()
    group = state._fsdp_param_groups[0]
    return {
        "reduce_grads": bool(group.reduce_grads),
        "reshard_after_backward": bool(group.reshard_after_backward),
        "is_last_backward": bool(state._state_ctx.is_last_backward),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, Result] = {}
    try:
        for name in [*RAISING, *CLEAN]:
            results[name] = run_scenario(name, args.out / name, rank)
            dist.barrier()
        results["policies"] = run_policies(args.out / "policies", rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
