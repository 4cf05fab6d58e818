"""How a unit's managed parameters are listed and named: FSDP2's own order, FSDP2's own names.

The one definition every table that codes parameters uses (``units.param_names``,
``gradients``, ``backward_grads``, ``grads_written``): a parameter's code is its position in
``[p for group in state._fsdp_param_groups for p in group.fsdp_params]``, the list FSDP2
reduce-scatters from. Not ``module.named_parameters()``: FSDP2 collects a unit's parameters
module by module in post-order (children before the module's own, ``_get_managed_states``), so a
block that adds ``self.bias2`` next to its children lists it *last* where ``named_parameters``
lists it first.

Names are what FSDP2's ``_init_fqns`` sets at lazy init (the first name under which the
parameter is reachable from the root: a tied parameter takes its first name), computed here
from the part root without waiting for lazy init: ``fully_shard`` already swapped each module's
parameter for ``fsdp_param.sharded_param``, so identity finds it. Names are relative to the
model part, like unit names.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fsdptrace.record.backends.fsdp2.state import param_groups


def managed_params(state: Any) -> list[Any]:
    """The unit's ``FSDPParam``s in FSDP2's order (all its parameter groups, in turn)."""
    return [p for group in param_groups(state) for p in getattr(group, "fsdp_params", ())]


def names_by_identity(part: nn.Module) -> dict[int, str]:
    """Each parameter of ``part`` by ``id``: its first name, as ``named_parameters`` dedups."""
    return {id(param): name for name, param in part.named_parameters()}


def param_name(fsdp_param: Any, names: dict[int, str], index: int) -> str:
    """One managed parameter's name: found by identity, else FSDP2's own FQN, else a position.

    The fallbacks only matter if a tool swapped the module's parameter after ``fully_shard``.
    """
    sharded = getattr(fsdp_param, "sharded_param", None)
    name = names.get(id(sharded)) if sharded is not None else None
    if name is None:
        name = getattr(fsdp_param, "_param_fqn", None) or _module_info_name(fsdp_param)
    return name or f"param[{index}]"


def unit_param_names(state: Any, names: dict[int, str]) -> list[str]:
    """Every managed parameter's name, in code order."""
    return [param_name(p, names, i) for i, p in enumerate(managed_params(state))]


def _module_info_name(fsdp_param: Any) -> str | None:
    info = getattr(fsdp_param, "_module_info", None)
    return getattr(info, "param_name", None)
