"""Torch FSDP2 (``fully_shard``) backend: units, prefetch edges, gradients, pending gathers.

FSDP2 has setters for prefetch but no getters, so this module reads private attributes
(``_states_to_forward_prefetch``, ``_fsdp_param_groups``, ``_all_gather_result``,
``_unsharded_param``...). Every read goes through ``getattr`` with a default: torch moves these
between releases, and a moved attribute must cost us data, never the job. Facts and their
experiments: ``shared/research/fsdp2_internals.md``.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from fsdptrace.record.backends.base import (
    GradientPresence,
    InstanceAttributePatch,
    PendingAllGather,
    Unit,
    unit_name,
    untracked_name,
)
from fsdptrace.record.backends.fsdp2 import collectives, grad_reads, grads, params, provenance
from fsdptrace.record.backends.fsdp2.state import fsdp_state, param_groups

if TYPE_CHECKING:
    from fsdptrace.record.recorder import Recorder

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch < 2.6 kept FSDP2 under _composable
    from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]

_graph_task_id = torch._C._current_graph_task_id
_PREFETCH_ATTR = {
    "forward": "_states_to_forward_prefetch",
    "backward": "_states_to_backward_prefetch",
}
_prefetch_lists = operator.attrgetter(*_PREFETCH_ATTR.values())
_gather_state = operator.attrgetter("_all_gather_result", "is_unsharded")

class _Answers(dict[tuple[bool, str], GradientPresence]):
    """One parameter's ``GradientPresence`` per (has_grad, source), each built once on demand."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def __missing__(self, source: tuple[bool, str]) -> GradientPresence:
        self[source] = presence = GradientPresence(self.label, *source)
        return presence


# What ``_params_of`` answers for a unit without managed parameters: one list, so that
# ``_all_params`` sees the same answer as unchanged (never mutated).
_NO_PARAMS: list[tuple[Any, _Answers]] = []


def _split(values: list[Any], counts: list[int]) -> list[list[Any]]:
    """``values`` cut into consecutive lists of ``counts`` items."""
    found = iter(values)
    return [list(itertools.islice(found, count)) for count in counts]


def has_fsdp2_units(parts: Sequence[nn.Module]) -> bool:
    return any(isinstance(m, FSDPModule) for part in parts for m in part.modules())


class FSDP2Backend:
    """Reads units, prefetch edges, gradients and pending all-gathers from torch FSDP2."""

    name = "fsdp2"
    watch_backward_in_recompute = True

    def __init__(self) -> None:
        self._name_by_state: dict[int, str] = {}
        # Per unit index, filled at first use after lazy init: (fsdp_param, answers) and
        # the parameter groups. FSDP2 builds both once, at fully_shard / lazy init.
        self._labelled_params: dict[int, list[tuple[Any, _Answers]]] = {}
        self._groups: dict[int, list[Any]] = {}
        self._fsdp_params: dict[int, tuple[list[Any], list[Any]]] = {}
        self._mesh_shapes: dict[int, tuple[int, ...] | None] = {}
        self._settings_sources: tuple[list[Any], list[Any]] | None = None
        self._all: tuple[list[Any], list[Any], list[_Answers], list[int]] | None = None
        # The parameter objects behind ``_all``, kept while the resets that replace them are
        # watched (``install_backward_grads``).
        self._kept = grad_reads.KeptObjects()
        # (parameters, sources, answers) of the last ``all_gradients``.
        self._answered: tuple[list[Any], list[tuple[bool, str]],
                              list[list[GradientPresence]]] | None = None
        self._all_done: tuple[Sequence[Unit], tuple[list[Any], list[_Answers],
                                                     list[int]]] | None = None
        self._all_groups: tuple[Sequence[Unit], tuple[list[Any], list[tuple[int, int]]]
                                ] | None = None

    def discover_units(self, parts: Sequence[nn.Module]) -> list[Unit]:
        units: list[Unit] = []
        for part_index, part in enumerate(parts):
            names = params.names_by_identity(part)
            for state, members in _states_of(part, skip=self._name_by_state):
                fqn = ",".join(f for f, _ in members)
                name = unit_name(part_index, fqn, num_parts=len(parts))
                units.append(self._make_unit(len(units), name, part_index, state, members,
                                             params.unit_param_names(state, names)))
        for unit in units:
            self._name_by_state[id(unit.handle)] = unit.name
        return units

    def _make_unit(self, index: int, name: str, part: int, state: Any,
                   members: list[tuple[str, nn.Module]], param_names: list[str]) -> Unit:
        num_elements = 0
        for fsdp_param in params.managed_params(state):
            shape = getattr(fsdp_param, "_orig_size", None)
            num_elements += int(torch.Size(shape).numel()) if shape is not None else 0
        fqn = ",".join(f for f, _ in members)
        return Unit(
            index=index,
            name=name,
            part=part,
            fqn=fqn,
            modules=tuple(m for _, m in members),
            handle=state,
            is_root=fqn == "",
            module_type=",".join(_original_type_name(m) for _, m in members),
            param_names=param_names,
            num_param_elements=num_elements,
        )

    def prefetch_targets(self, unit: Unit, phase: str) -> list[str]:
        targets = getattr(unit.handle, _PREFETCH_ATTR[phase], None) or ()
        names = []
        for target in targets:
            name = self._name_by_state.get(id(target))
            if name is None:
                modules = getattr(target, "_modules", None) or (target,)
                name = untracked_name(modules[0])
            names.append(name)
        return names

    def prefetch_key(self, units: Sequence[Unit]) -> list[tuple[Any, ...]] | None:
        """Every unit's prefetch target lists, read in one C-level pass (None: not readable).

        Compared with ``==`` against the copy kept by ``freeze_prefetch_key``, it says whether
        any edge changed without resolving a single name: the setters replace the lists, and
        an in-place edit changes their contents, both of which the comparison sees.
        """
        try:
            return list(map(_prefetch_lists, [u.handle for u in units]))
        except AttributeError:  # torch moved the attributes: callers take the slow path
            return None

    @staticmethod
    def freeze_prefetch_key(key: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """A copy of ``key`` that later edits of FSDP's lists cannot change."""
        return [tuple(list(targets or ()) for targets in lists) for lists in key]

    def gradients(self, unit: Unit) -> list[GradientPresence]:
        """Gradient presence per managed parameter, at every optimizer step for every unit.

        Labels are resolved once and each answer built once per parameter: a later boundary
        allocates nothing per parameter but the list. The gradients are read in bulk
        (``grad_reads``): this runs on the training thread for every parameter every step.
        """
        pairs = self._params_of(unit)
        found = grad_reads.sources(self._fsdp_params_of(unit, pairs))
        return [answers[source] for (_, answers), source in zip(pairs, found, strict=True)]

    def grad_tokens(self, unit: Unit) -> list[object]:
        return grad_reads.tokens(self._fsdp_params_of(unit, self._params_of(unit)))

    def all_gradients(self, units: Sequence[Unit]) -> list[list[GradientPresence]]:
        """``gradients`` of every unit from one bulk read of all their parameters."""
        fsdp_params, answers, counts = self._all_params(units)
        objects = self._kept.objects_of(fsdp_params)
        found = (grad_reads.sources(fsdp_params) if objects is None
                 else grad_reads.cached_sources(objects))
        # Most boundaries answer as the last one did: the answer objects are then not looked
        # up again (one cold dict per parameter, ~1 µs each after a backward at 256 units).
        last = self._answered
        if last is not None and last[0] is fsdp_params and last[1] == found:
            return last[2]
        presences = _split(list(map(dict.__getitem__, answers, found)), counts)
        self._answered = (fsdp_params, found, presences)
        return presences

    def all_grad_tokens(self, units: Sequence[Unit]) -> list[list[object]]:
        fsdp_params, _, counts = self._all_params(units)
        objects = self._kept.objects_of(fsdp_params)
        return _split(grad_reads.tokens(fsdp_params) if objects is None else
                      grad_reads.cached_tokens(objects, none_kept=self._kept.none_kept), counts)

    def _all_params(self, units: Sequence[Unit]) -> tuple[list[Any], list[_Answers], list[int]]:
        """Every unit's ``FSDPParam``s and answers in one list, and each unit's count; built
        again only when ``_params_of`` built anything again.

        Once every unit with parameters has them cached, nothing can change for this list of
        units, and no unit is looked at again: a lookup per unit cost ~2 µs after a backward
        at 256 units (cold ``Unit`` objects and dict entries).
        """
        done = self._all_done
        if done is not None and done[0] is units:
            return done[1]
        pairs = [self._params_of(unit) for unit in units]
        cached = self._all
        if cached is None or len(cached[0]) != len(pairs) or not all(
                map(operator.is_, cached[0], pairs)):
            flat = [pair for unit_pairs in pairs for pair in unit_pairs]
            cached = self._all = (pairs, [p for p, _ in flat], [a for _, a in flat],
                                  [len(unit_pairs) for unit_pairs in pairs])
        result = cached[1], cached[2], cached[3]
        if all(p is not _NO_PARAMS or not u.param_names for u, p in zip(units, pairs,
                                                                        strict=True)):
            self._all_done = (units, result)
        return result

    def _fsdp_params_of(self, unit: Unit, pairs: list[tuple[Any, _Answers]]) -> list[Any]:
        """The ``FSDPParam`` column of ``pairs``, built again only when ``_params_of`` did."""
        cached = self._fsdp_params.get(unit.index)
        if cached is None or cached[0] is not pairs:
            cached = self._fsdp_params[unit.index] = (pairs, [p for p, _ in pairs])
        return cached[1]

    def settings_row(self, unit: Unit) -> tuple[object, ...]:
        return grads.settings_row(unit.handle, self._mesh_shapes)

    def settings_key(self, units: Sequence[Unit]) -> list[Any] | None:
        """The group attributes behind every setting (one C-level pass) and each root's
        ``is_last_backward``; None before lazy init or if torch moved them."""
        if self._settings_sources is None:
            first = [g[0] for g in map(param_groups, [u.handle for u in units]) if g]
            by_id = {id(c): c for c in (getattr(u.handle, "_state_ctx", None) for u in units)
                     if c is not None}
            if not first or not by_id:
                return None
            self._settings_sources = (first, list(by_id.values()))
        groups, contexts = self._settings_sources
        try:
            return [*map(grads.group_settings, groups), *(c.is_last_backward for c in contexts)]
        except AttributeError:
            return None

    def install_backward_grads(self, rec: Recorder) -> list[Any]:
        managed = [p for unit in rec.units for p in params.managed_params(unit.handle)]
        groups = [g for unit in rec.units for g in param_groups(unit.handle)]
        return [*grads.install(rec, self._kept.note), *self._kept.watch(managed, groups)]

    def _params_of(self, unit: Unit) -> list[tuple[Any, _Answers]]:
        cached = self._labelled_params.get(unit.index)
        if cached is not None:
            return cached
        # The codes and names of ``unit.param_names`` (``params``): the tables agree by design.
        managed = params.managed_params(unit.handle)
        if not managed:  # not cached: FSDP2 may not have built them yet
            return _NO_PARAMS
        names = unit.param_names
        pairs = [(p, _Answers(names[i] if i < len(names) else f"param[{i}]"))
                 for i, p in enumerate(managed)]
        self._labelled_params[unit.index] = pairs
        return pairs

    def _groups_of(self, unit: Unit) -> list[Any]:
        groups = self._groups.get(unit.index)
        if groups is None:
            groups = param_groups(unit.handle)
            if groups:
                self._groups[unit.index] = groups
        return groups

    def pending_all_gathers(self, unit: Unit) -> list[PendingAllGather]:
        """Issued gathers not yet waited on, and gathered parameters held across the boundary.

        A blocking ``unshard()`` copies its result out at once, but the group then stays
        unsharded: at the next forward FSDP skips the all-gather and runs on the parameters
        gathered before ``optimizer.step()`` (stale by one update; measured).
        """
        pending = []
        for index, group in enumerate(self._groups_of(unit)):
            result = getattr(group, "_all_gather_result", None)
            if result is not None:
                work = getattr(result, "all_gather_work", None)
                state = "handle=set" if work is not None else "completed-not-consumed"
                pending.append(PendingAllGather("param_group", f"group[{index}]", state))
            elif getattr(group, "is_unsharded", False) is True:
                pending.append(PendingAllGather("param_group", f"group[{index}]",
                                                "unsharded-held"))
        return pending

    def all_pending_all_gathers(self, units: Sequence[Unit]) -> list[list[PendingAllGather]]:
        """``pending_all_gathers`` of every unit, their groups read in one pass: a call per
        unit cost ~2 µs at the boundary, most of it the call."""
        groups, places = self._groups_of_all(units)
        pending: list[list[PendingAllGather]] = [[] for _ in units]
        try:
            states = list(map(_gather_state, groups))
        except AttributeError:  # torch moved them: read each as ``pending_all_gathers`` does
            return [self.pending_all_gathers(unit) for unit in units]
        for (result, unsharded), (unit, index) in zip(states, places, strict=True):
            if result is not None:
                work = getattr(result, "all_gather_work", None)
                state = "handle=set" if work is not None else "completed-not-consumed"
                pending[unit].append(PendingAllGather("param_group", f"group[{index}]", state))
            elif unsharded is True:
                pending[unit].append(PendingAllGather("param_group", f"group[{index}]",
                                                      "unsharded-held"))
        return pending

    def _groups_of_all(self, units: Sequence[Unit]) -> tuple[list[Any], list[tuple[int, int]]]:
        """Every unit's groups in one list, with (position in ``units``, group index); kept,
        as ``_all_params``, once every unit with parameters has its groups."""
        done = self._all_groups
        if done is not None and done[0] is units:
            return done[1]
        per_unit = [self._groups_of(unit) for unit in units]
        places = [(position, index) for position, groups in enumerate(per_unit)
                  for index in range(len(groups))]
        result = [g for groups in per_unit for g in groups], places
        if all(groups or not u.param_names for u, groups in zip(units, per_unit, strict=True)):
            self._all_groups = (units, result)
        return result

    def is_recompute(self, unit: Unit) -> bool:
        # FSDP's own is_bw(): the unit's training state is not reliable inside checkpoint regions.
        return bool(_graph_task_id() != -1)

    def in_backward(self) -> bool:
        return bool(_graph_task_id() != -1)

    def install_provenance(self, rec: Recorder) -> list[InstanceAttributePatch]:
        return provenance.install(rec)

    def install_collectives(self, rec: Recorder) -> list[collectives.Installed]:
        return collectives.install(rec)

    def patch_forward_methods(
        self, unit: Unit, on_pre: Any, on_post: Any
    ) -> InstanceAttributePatch | None:
        """Wrap the state's ``_pre_forward``/``_post_forward`` instance attributes.

        ``register_fsdp_forward_method`` looks them up by attribute and bypasses module
        hooks; module hooks hold the bound methods captured at ``fully_shard`` time, so the
        wrapper sees only that path and nothing is counted twice.
        """
        state = unit.handle
        original_pre = getattr(state, "_pre_forward", None)
        original_post = getattr(state, "_post_forward", None)
        if original_pre is None or original_post is None:
            return None

        @functools.wraps(original_pre)
        def pre_forward(module: nn.Module, args: Any, kwargs: Any) -> Any:
            on_pre(module)
            return original_pre(module, args, kwargs)

        @functools.wraps(original_post)
        def post_forward(module: nn.Module, args: Any, output: Any) -> Any:
            on_post(module, output)
            return original_post(module, args, output)

        return InstanceAttributePatch(
            state, {"_pre_forward": pre_forward, "_post_forward": post_forward})


def _states_of(part: nn.Module, *, skip: dict[int, str]
               ) -> list[tuple[Any, list[tuple[str, nn.Module]]]]:
    """Each FSDP state of ``part`` (not in ``skip``) with its modules and their FQNs, in order.

    A grouped ``fully_shard([a, b])`` state owns several modules; a module reachable under two
    names (shared submodule) is listed once.
    """
    members: dict[int, list[tuple[str, nn.Module]]] = {}
    states: dict[int, Any] = {}
    for fqn, module in part.named_modules():
        state = fsdp_state(module) if isinstance(module, FSDPModule) else None
        if state is None or id(state) in skip:
            continue
        states[id(state)] = state
        members.setdefault(id(state), []).append((fqn, module))
    return [(states[key], value) for key, value in members.items()]


def _original_type_name(module: nn.Module) -> str:
    """The user's class name: ``fully_shard`` swaps in a dynamic ``FSDP<Name>`` subclass."""
    for cls in type(module).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls.__name__
    return type(module).__name__

