"""Zero-code mode's question to FSDP2: is this forward a training forward of an FSDP2 root?

``record/auto.py`` asks it from a global module pre-hook in every process ``fsdptrace record``
starts, so this module imports nothing heavy and never imports FSDP itself.
"""

from __future__ import annotations

from typing import Any

from fsdptrace.record.backends.fsdp2.state import fsdp_state


def is_root_training_forward(module: Any) -> bool:
    """True at a grad-enabled forward, outside backward, of a module no FSDP root contains.

    Eval and no-grad warm-up forwards are not recorded anyway: waiting for the first training
    forward lets a script attach explicitly after its warm-up. Recompute runs inside
    backward, never a first forward. ``_is_root`` is None until FSDP's lazy init and False
    for a unit inside a root already initialised: a unit run outside its root is no root.
    """
    import torch

    if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
        return False
    return getattr(fsdp_state(module), "_is_root", None) is not False
