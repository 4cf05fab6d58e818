"""Where FSDP2 keeps a module's state and its parameter groups, across torch releases.

Plain ``getattr`` reads, no torch import: zero-code mode (``roots``) uses them before it knows
whether the process trains anything.
"""

from __future__ import annotations

from typing import Any


def fsdp_state(module: Any) -> Any:
    """The ``FSDPState`` behind a ``fully_shard`` module, or None."""
    getter = getattr(module, "_get_fsdp_state", None)
    return getter() if getter is not None else None


def param_groups(state: Any) -> list[Any]:
    """The state's parameter groups, across the single-group and list layouts of torch."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "__dict__", {}).get("_fsdp_param_group")
    return [group] if group is not None else []
