"""The optimizer boundary's mechanics in one process: which optimizer gets the hook, and when a
plain or closure step calls the boundary. The jobs that record real FSDP2 through these paths
are in test_trainers_closure.py (LBFGS), test_trainers_lightning.py and
test_trainers_accelerate.py (the wrappers inside their trainers)."""

from __future__ import annotations

import warnings

import pytest
import torch

from fsdptrace.record.optimizer_boundary import find_real_optimizer, hook_optimizer


def _sgd() -> tuple[torch.nn.Parameter, torch.optim.SGD]:
    param = torch.nn.Parameter(torch.ones(2))
    return param, torch.optim.SGD([param], lr=0.5)


def _closure(param: torch.nn.Parameter, seen: list[str]) -> object:
    def closure() -> torch.Tensor:
        seen.append("closure")
        param.grad = None
        loss = (param * param).sum()
        loss.backward()
        return loss

    return closure


def _watch(param: torch.nn.Parameter, seen: list[str]) -> object:
    """A boundary that records whether the update had happened when it ran."""
    return lambda: seen.append(f"boundary at {param.detach().tolist()}")


def test_plain_step_boundary_is_the_pre_hook() -> None:
    param, sgd = _sgd()
    seen: list[str] = []
    handle = hook_optimizer(sgd, _watch(param, seen))
    param.grad = torch.ones(2)
    sgd.step()
    assert seen == ["boundary at [1.0, 1.0]"] and param.tolist() == [0.5, 0.5]
    handle.remove()
    sgd.step()
    assert len(seen) == 1


@pytest.mark.parametrize("as_keyword", [False, True])
def test_closure_step_boundary_is_after_the_closure_before_the_update(as_keyword: bool) -> None:
    param, sgd = _sgd()
    seen: list[str] = []
    hook_optimizer(sgd, _watch(param, seen))
    closure = _closure(param, seen)
    loss = sgd.step(closure=closure) if as_keyword else sgd.step(closure)
    assert seen == ["closure", "boundary at [1.0, 1.0]"]
    assert float(loss.detach()) == 2.0 and param.tolist() == [0.0, 0.0]


def test_an_exception_at_the_boundary_stops_the_update() -> None:
    """Live raising: the boundary raises after the closure, and nothing is updated."""
    param, sgd = _sgd()

    def refuse() -> None:
        raise RuntimeError("unsafe")

    hook_optimizer(sgd, refuse)
    with pytest.raises(RuntimeError, match="unsafe"):
        sgd.step(_closure(param, []))
    assert param.tolist() == [1.0, 1.0]


def test_lightning_optimizer_is_unwrapped() -> None:
    pytest.importorskip("lightning", reason="the trainers extra is not installed")
    from lightning.pytorch.core.optimizer import LightningOptimizer

    _, sgd = _sgd()
    wrapper = LightningOptimizer(sgd)
    assert isinstance(wrapper, torch.optim.Optimizer)  # it imitates the class, not the state
    assert find_real_optimizer(wrapper) is sgd


def test_accelerated_optimizer_is_unwrapped() -> None:
    pytest.importorskip("accelerate", reason="the trainers extra is not installed")
    from accelerate.optimizer import AcceleratedOptimizer

    _, sgd = _sgd()
    # Built as accelerate builds it in prepare(), minus the state it reads for device placement.
    wrapper = AcceleratedOptimizer.__new__(AcceleratedOptimizer)
    wrapper.optimizer = sgd
    assert isinstance(wrapper, torch.optim.Optimizer)
    assert not hasattr(wrapper, "_optimizer_step_pre_hooks")  # what crashed attach() before
    assert find_real_optimizer(wrapper) is sgd


class _OwnWrapper:
    """A wrapper that keeps its optimizer where no trainer does."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self._wrapped = inner

    def step(self, closure: object = None) -> object:
        return self._wrapped.step(closure)


def test_unknown_wrapper_gets_its_step_wrapped_with_one_warning() -> None:
    param, sgd = _sgd()
    wrapper = _OwnWrapper(sgd)
    seen: list[str] = []
    with pytest.warns(RuntimeWarning, match="no torch optimizer found inside _OwnWrapper"):
        handle = hook_optimizer(wrapper, _watch(param, seen))
    wrapper.step(_closure(param, seen))
    assert seen == ["closure", "boundary at [1.0, 1.0]"] and param.tolist() == [0.0, 0.0]
    handle.remove()
    assert "step" not in vars(wrapper)


def test_an_object_without_step_is_refused_with_a_warning_not_an_error() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert hook_optimizer(object(), lambda: None) is None
    assert [str(w.message) for w in caught] == [
        "fsdptrace: cannot hook the optimizer (object has no step()): no optimizer boundaries "
        "will be recorded; call recorder.before_optimizer_step() before each update"]
