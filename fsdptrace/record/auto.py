"""Zero-code recording: attach to the FSDP2 root of a process that never calls ``attach``.

``fsdptrace record -- COMMAND`` sets ``$FSDPTRACE_RUN_DIR`` and puts ``bootstrap/`` on
``PYTHONPATH``; its ``sitecustomize`` calls ``install_auto_attach`` once torch is imported.
Two process-wide hooks then do what the one explicit line would:

- a global module forward pre-hook attaches a recorder at the first training (grad-enabled)
  forward of an FSDP root that nothing records yet, then removes itself. One root per
  process: a second root (a teacher model, a second pipeline stage) is not recorded; list
  them all in an explicit ``fsdptrace.attach([...])`` for that;
- a global optimizer step pre-hook closes the step (at the optimizer boundary: the pre-hook,
  or when a step's closure returns) of every live recorder that has no
  optimizer of its own and whose script does not number steps itself, so an explicit
  ``attach(model)`` without ``optimizer=`` still gets boundaries, and no recorder is closed
  twice per step.

An explicit ``attach`` on the same model wins: ``registry.forget`` closes the automatic one.
Any failure here disables zero-code recording with one warning; the job goes on.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Any

from fsdptrace.errors import LifecycleError
from fsdptrace.record.backends.fsdp2 import roots
from fsdptrace.store.env import RUN_DIR_ENV

if TYPE_CHECKING:
    import torch.nn as nn

    from fsdptrace.record.recorder import Recorder

# torch.utils.hooks.RemovableHandle for each installed global hook; empty when not installed.
_handles: dict[str, Any] = {}
_disabled = False
_attached: weakref.WeakSet[Recorder] = weakref.WeakSet()  # the recorders this module made


def install_auto_attach() -> bool:
    """Install the global hooks in this process when ``$FSDPTRACE_RUN_DIR`` is set.

    Imports torch. Returns whether the hooks are installed; calling it twice is harmless.
    """
    if not os.environ.get(RUN_DIR_ENV) or _disabled:
        return False
    if _handles:
        return True
    try:
        import torch.nn.modules.module as module_hooks
        import torch.optim.optimizer as optimizer_hooks

        _handles["optimizer"] = optimizer_hooks.register_optimizer_step_pre_hook(
            _optimizer_step_pre_hook
        )
        _handles["forward"] = module_hooks.register_module_forward_pre_hook(
            _module_forward_pre_hook
        )
    except Exception as error:
        _disable(f"cannot install hooks: {type(error).__name__}: {error}")
        return False
    return True


def install_on_torch_import() -> None:
    """Call ``install_auto_attach`` as soon as the process imports torch, or now if it has.

    ``sitecustomize`` runs before the script: importing torch there would cost every process
    the command starts (helpers, tools that never touch torch) and would import it before the
    script sets the variables torch reads at import time. Waiting for the script's own
    ``import torch`` costs nothing, and nothing FSDP can run before it.
    """
    if "torch" in sys.modules:
        install_auto_attach()
    elif not any(isinstance(f, _AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())


class _AfterTorchImport:
    """A one-shot import hook: finds torch with the other finders and wraps its loader."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        if self in sys.meta_path:  # another thread may have got here first
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return None
        spec.loader = _InstallAfterExec(spec.loader)
        return spec


class _InstallAfterExec(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # Put the real loader back first: tools read __loader__ (get_source, resources).
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        install_auto_attach()


def uninstall_auto_attach() -> None:
    """Remove the global hooks (recorders already attached keep recording)."""
    for handle in _handles.values():
        handle.remove()
    _handles.clear()


def _disable(reason: str) -> None:
    global _disabled
    if _disabled:
        return
    _disabled = True
    uninstall_auto_attach()
    for recorder in list(_attached):  # without the step hook their steps would run together
        recorder.disable(f"zero-code recording failed: {reason}")
    warnings.warn(
        f"fsdptrace: zero-code recording disabled: {reason}", RuntimeWarning, stacklevel=3
    )


# --------------------------------------------------------------------- forward: find the root
# (module, class) of every framework's unit class: torch FSDP2 and hyper_parallel's HSDP.
_UNIT_CLASSES = (("torch.distributed.fsdp", "FSDPModule"),
                 ("hyper_parallel.core.fully_shard.api", "HSDPModule"))


def _fsdp_module_classes() -> tuple[type, ...]:
    # No unit can exist before its framework's fully_shard module is imported; importing it
    # here, in every module call of a job that does not use it, would cost that job.
    found = (getattr(sys.modules.get(module), name, None) for module, name in _UNIT_CLASSES)
    return tuple(cls for cls in found if isinstance(cls, type))


def _module_forward_pre_hook(module: nn.Module, args: Any) -> None:
    try:
        fsdp_modules = _fsdp_module_classes()
        if not fsdp_modules or not isinstance(module, fsdp_modules):
            return
        _on_fsdp_forward(module)
    except Exception as error:  # recording must never break training
        _disable(f"forward pre-hook failed: {type(error).__name__}: {error}")


def _on_fsdp_forward(module: nn.Module) -> None:
    from fsdptrace.record import registry

    if not roots.is_root_training_forward(module):
        return
    _stop_watching_forwards()
    if registry.recorder_of(module) is not None:
        return  # the script attached explicitly
    _attach_root(module)


def _stop_watching_forwards() -> None:
    # The global hook takes every module call off nn.Module's no-hook fast path; once this
    # process's root is found it has nothing left to do.
    handle = _handles.pop("forward", None)
    if handle is not None:
        handle.remove()


def _attach_root(module: nn.Module) -> None:
    from fsdptrace.record.attach import attach

    recorder = attach(module)
    _attached.add(recorder)
    # nn.Module snapshots its pre-hooks before calling the first one, so the hooks attach just
    # registered on this module miss this call; do their work (tests pin that behaviour).
    if not recorder.on_part_forward(0):
        return
    if recorder.active:
        for unit in recorder.units:
            if (
                unit.part == 0
                and any(m is module for m in unit.modules)
                and (not recorder.backend.is_recompute(unit))
            ):
                recorder.record_unit(unit.index, 0)


# --------------------------------------------------------------------- optimizer: boundaries
def _optimizer_step_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> Any:
    try:
        from fsdptrace.record.optimizer_boundary import closure_step_args

        # A closure step's boundary is when its closure returns (its forward runs inside).
        return closure_step_args(args, kwargs, _close_live_steps)
    except LifecycleError:
        raise  # live checks stop the step on purpose
    except Exception as error:
        _disable(f"optimizer step pre-hook failed: {type(error).__name__}: {error}")
        return None


def _close_live_steps() -> None:
    try:
        from fsdptrace.record import registry

        for recorder in registry.live_recorders():
            if recorder.closes_step_at_any_optimizer():
                recorder.before_optimizer_step()
    except LifecycleError:
        raise
    except Exception as error:
        _disable(f"optimizer boundary failed: {type(error).__name__}: {error}")


