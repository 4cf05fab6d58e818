"""The boundary's bulk gradient reads against one-parameter-at-a-time reads, on real FSDP2.

``python grad_reads_job.py --out DIR`` on 2 gloo ranks. Two models (fp32; bf16 parameters
with fp32 reduce, where a no-sync micro-step keeps ``unsharded_accumulated_grad``) go through
the states a boundary can meet: before any backward, after a no-sync backward, after a syncing
one, after ``zero_grad(set_to_none=False)`` and after ``zero_grad()``. At each, every
parameter's presence and token are read both ways (``grad_reads`` and the reads the backend
made before it), and so is the boundary's ``grads_written`` for a baseline of that state.
The backend's reads of all units at once (``all_gradients``/``all_grad_tokens``, what the
boundary and the baseline call) are compared with its per-unit ones, too, also with the
parameter objects kept as a recorder's backend keeps them.
Each rank writes ``result.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import DIM, Block  # noqa: E402

from fsdptrace.record.backends.fsdp2 import grad_reads, grads  # noqa: E402
from fsdptrace.record.backends.fsdp2.params import managed_params  # noqa: E402
from fsdptrace.record.backends.fsdp2.state import param_groups  # noqa: E402
from fsdptrace.record.backends.fsdp2.units import FSDP2Backend  # noqa: E402


def reference_source(fsdp_param: Any) -> tuple[bool, str]:
    """What ``FSDP2Backend.gradients`` read per parameter before ``grad_reads``."""
    sharded = getattr(fsdp_param, "sharded_param", None)
    if getattr(sharded, "grad", None) is not None:
        return (True, "sharded")
    unsharded = fsdp_param.__dict__.get("_unsharded_param")
    if getattr(unsharded, "grad", None) is not None:
        return (True, "unsharded")
    if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
        return (True, "accumulated")
    return (False, "none")


def build(mixed: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), Block())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    for block in model:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def fsdp_params(model: nn.Module) -> list[Any]:
    return [p for m in model.modules() if hasattr(m, "_get_fsdp_state")
            for g in param_groups(m._get_fsdp_state()) for p in getattr(g, "fsdp_params", ())]


def compare(model: nn.Module, point: str, baseline: list[object] | None, *,
            reset: bool = False) -> dict[str, Any]:
    params = fsdp_params(model)
    fast_sources, slow_sources = grad_reads.sources(params), [reference_source(p) for p in params]
    fast_tokens, slow_tokens = grad_reads.tokens(params), [grads.grad_token(p) for p in params]
    result: dict[str, Any] = {
        "point": point, "sources": [s for _, s in slow_sources],
        "sources_agree": fast_sources == slow_sources, "tokens_agree": fast_tokens == slow_tokens,
        **_bulk_agrees(model, reset=reset),
    }
    # The baseline's shortcut: where every group's post-backward cleared what it keeps
    # (``grads.clears_kept``), the sharded gradients alone give every token.
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
              for g in param_groups(m._get_fsdp_state())]
    result["groups_cleared"] = all(grads.clears_kept(g) for g in groups)
    if result["groups_cleared"]:
        result["none_kept_agrees"] = grad_reads.cached_tokens(
            grad_reads.ParamObjects(params), none_kept=True) == slow_tokens
    if baseline is not None:
        # The boundary's shortcut: with no gradient at the baseline, written == has_grad.
        by_token = [b != n for b, n in zip(baseline, slow_tokens, strict=True)]
        result["written_by_token"] = by_token
        result["written_by_presence"] = [has for has, _ in slow_sources]
    return result


def _bulk_agrees(model: nn.Module, *, reset: bool) -> dict[str, bool]:
    """The backend's one read over all units against its reads unit by unit; and the same
    with the parameter objects kept (what a recorder's backend does), read twice (the second
    answers from what the first kept), and, with ``reset`` (parameters sharded, as FSDP2
    resets them), dropped by a ``reset_sharded_param``."""
    backend = FSDP2Backend()
    units = backend.discover_units([model])
    per_unit = [backend.gradients(u) for u in units], [backend.grad_tokens(u) for u in units]
    kept = FSDP2Backend()
    kept_units = kept.discover_units([model])
    patches = kept._kept.watch([p for u in kept_units for p in managed_params(u.handle)])
    try:
        reads = [(kept.all_gradients(kept_units), kept.all_grad_tokens(kept_units))
                 for _ in range(2)]
        first = kept._kept.objects.fsdp_params[0] if kept._kept.objects else None
        if reset and first is not None:
            first.reset_sharded_param()
        reset_forgets = not reset or (first is not None and kept._kept.objects is None)
        reads.append((kept.all_gradients(kept_units), kept.all_grad_tokens(kept_units)))
    finally:
        for patch in patches:
            patch.remove()
    return {"bulk_sources_agree": backend.all_gradients(units) == per_unit[0],
            "bulk_tokens_agree": backend.all_grad_tokens(units) == per_unit[1],
            "kept_sources_agree": all(r[0] == per_unit[0] for r in reads),
            "kept_tokens_agree": all(r[1] == per_unit[1] for r in reads),
            "kept_used": bool(patches), "reset_forgets": reset_forgets}


def run(mixed: bool) -> list[dict[str, Any]]:
    model = build(mixed)
    x = torch.randn(4, DIM)
    out = [compare(model, "before any backward", None)]
    model.set_requires_gradient_sync(False)
    model(x).sum().backward()
    out.append(compare(model, "after a no-sync backward", None))
    model.set_requires_gradient_sync(True)
    model(x).sum().backward()
    out.append(compare(model, "after a syncing backward", None))
    for p in model.parameters():
        p.grad = None
    empty = [grads.grad_token(p) for p in fsdp_params(model)]
    model(x).sum().backward()
    out.append(compare(model, "a step from no gradient", empty))
    for p in model.parameters():  # zero_grad(set_to_none=False)
        if p.grad is not None:
            p.grad.zero_()
    out.append(compare(model, "after zero_grad(set_to_none=False)", None))
    model.zero_grad()
    out.append(compare(model, "after zero_grad()", None, reset=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        result = {"fp32": run(mixed=False), "bf16": run(mixed=True)}
    finally:
        dist.destroy_process_group()
    (args.out / f"result.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
