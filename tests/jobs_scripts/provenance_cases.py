"""All-gather provenance cases: small real FSDP2 jobs, each recorded into ``--out/<case>``.

Run on 2 CPU ranks (gloo) through ``tests.jobs.run_ranks``; one launch records every case.
Each case also writes ``<case>/result.rank<r>.json`` with the all-gathers FSDP really issued,
counted per unit by wrapping FSDP's ``foreach_all_gather`` inside this job (independently of
the recorder), so tests can compare what was recorded with what happened.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

import fsdptrace

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from harness import DIM, Block, run_cases  # noqa: E402

VOCAB = 16
STEPS = 2
MICRO_STEPS = 2
Result = dict[str, Any]


class Net(nn.Module):
    """Token embeddings, three blocks, a head; ``embed_twice`` re-embeds before the head."""

    def __init__(self, *, embed_twice: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.output = nn.Linear(DIM, VOCAB)
        self.embed_twice = embed_twice

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        if self.embed_twice:
            # A second call of the embeddings (a residual re-embedding, as in some
            # encoder-decoder models): its forward prefetch gathers layers.0 again.
            h = h + self.tok_embeddings(tokens)
        return self.output(h)


def sharded_net(**kwargs: Any) -> Net:
    torch.manual_seed(0)
    net = Net(**kwargs)
    fully_shard(net.tok_embeddings)
    for layer in net.layers:
        fully_shard(layer)
    fully_shard(net)
    return net


def chain(net: Net) -> None:
    """The textbook edges: each unit prefetches the next in forward, the previous in backward."""
    units = [net.tok_embeddings, *net.layers]
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1:i + 2])
        unit.set_modules_to_backward_prefetch(units[i - 1:i] if i > 0 else [])


def count_all_gathers(net: Net) -> Callable[[], dict[str, int]]:
    """Count FSDP's real all-gathers per unit by wrapping ``foreach_all_gather`` (job only)."""
    name_of = {}
    for fqn, module in net.named_modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is not None:
            for group in state()._fsdp_param_groups:
                name_of[id(group.fsdp_params[0])] = fqn or "<root>"
    counts: Counter[str] = Counter()
    original = _fsdp_param_group.foreach_all_gather

    def counting(fsdp_params: Any, *args: Any, **kwargs: Any) -> Any:
        counts[name_of.get(id(fsdp_params[0]), "?")] += 1
        return original(fsdp_params, *args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counting

    def done() -> dict[str, int]:
        _fsdp_param_group.foreach_all_gather = original
        return dict(counts)

    return done


def train(net: Net, run_dir: Path, *, before_step: Callable[[], None] | None = None,
          after_attach: Callable[[], None] | None = None) -> Result:
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    counted = count_all_gathers(net)
    losses = []
    with fsdptrace.attach(net, run_dir=run_dir, optimizer=optimizer):
        if after_attach is not None:
            after_attach()
        wrapped_while_attached = num_wrapped(net)
        for _ in range(STEPS):
            for _ in range(MICRO_STEPS):
                tokens = torch.randint(0, VOCAB, (8,), generator=generator)
                loss = net(tokens).pow(2).mean()
                loss.backward()
                losses.append(loss.item())
            if before_step is not None:
                before_step()
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": losses, "all_gathers": counted(),
            "wrapped_while_attached": wrapped_while_attached,
            "wrapped_after_close": num_wrapped(net)}


def param_groups_of(net: Net) -> list[Any]:
    groups = {id(g): g for m in net.modules() if hasattr(m, "_get_fsdp_state")
              for g in m._get_fsdp_state()._fsdp_param_groups}
    return list(groups.values())


def num_wrapped(net: Net) -> int:
    """Parameter groups carrying instance-level method wrappers (the recorder's, if any)."""
    return sum("unshard" in g.__dict__ for g in param_groups_of(net))


def case_clean_chained(run_dir: Path) -> Result:
    net = sharded_net()
    chain(net)
    return train(net, run_dir)


def case_embed_twice(run_dir: Path) -> Result:
    """tok_embeddings prefetches layers.0 at each call; the second one waits into backward."""
    net = sharded_net(embed_twice=True)
    chain(net)
    return train(net, run_dir)


def case_redundant_prefetch(run_dir: Path) -> Result:
    """layers.0 already prefetches layers.2, so layers.1's prefetch of it is a no-op."""
    net = sharded_net()
    chain(net)
    net.layers[0].set_modules_to_forward_prefetch([net.layers[1], net.layers[2]])
    return train(net, run_dir)


def case_manual_unshard(run_dir: Path) -> Result:
    """A manual unshard() right before optimizer.step(): held across the boundary."""
    net = sharded_net()
    chain(net)
    return train(net, run_dir, before_step=lambda: net.layers[1].unshard())


def passthrough(fn: Callable[..., Any], calls: Counter[str]) -> Callable[..., Any]:
    """What memory trackers and profilers install: count the call, change nothing."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls["calls"] += 1
        return fn(*args, **kwargs)

    return wrapper


def embed_twice_wrapped(run_dir: Path, *, level: str, when: str) -> Result:
    """The embed-twice job with another tool's pass-through wrapper of FSDP's ``unshard``.

    ``level``: ``class`` (``FSDPParamGroup.unshard``), ``instance`` (each group's attribute)
    or ``prefetch`` (the class's static ``_prefetch_unshard``); ``when``: before or after
    ``attach``. The class is restored when the case ends.
    """
    net = sharded_net(embed_twice=True)
    chain(net)
    calls: Counter[str] = Counter()
    groups = param_groups_of(net)
    theirs: dict[int, Any] = {}
    saved = {name: FSDPParamGroup.__dict__[name] for name in ("unshard", "_prefetch_unshard")}

    def install() -> None:
        if level == "class":
            FSDPParamGroup.unshard = passthrough(FSDPParamGroup.unshard, calls)
        elif level == "prefetch":
            FSDPParamGroup._prefetch_unshard = staticmethod(  # type: ignore[method-assign]
                passthrough(FSDPParamGroup._prefetch_unshard, calls))
        else:
            for group in groups:
                theirs[id(group)] = group.unshard = passthrough(group.unshard, calls)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if when == "before":
                install()
            result = train(net, run_dir, after_attach=install if when == "after" else None)
        finally:
            for name, value in saved.items():
                setattr(FSDPParamGroup, name, value)
    result["wrapper_calls"] = calls["calls"]
    result["theirs_kept_after_close"] = all(
        g.__dict__.get("unshard") is theirs[id(g)] for g in groups) if theirs else None
    result["warnings"] = [str(w.message) for w in caught if "fsdptrace" in str(w.message)]
    return result


def case_direct_group_unshard(run_dir: Path) -> Result:
    """A script calls a parameter group's ``unshard()`` itself: no FSDP2 path issued it."""
    net = sharded_net()
    chain(net)
    group = net.layers[1]._get_fsdp_state()._fsdp_param_groups[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(net, run_dir, before_step=lambda: group.unshard())
    result["warnings"] = [str(w.message) for w in caught if "fsdptrace" in str(w.message)]
    return result


WRAPPED = {f"wrapped-{level}-{when}": functools.partial(embed_twice_wrapped, level=level,
                                                        when=when)
           for level in ("class", "instance", "prefetch") for when in ("before", "after")}

CASES: dict[str, Callable[[Path], Result]] = {
    "clean-chained": case_clean_chained,
    "embed-twice": case_embed_twice,
    "redundant-prefetch": case_redundant_prefetch,
    "manual-unshard": case_manual_unshard,
    "direct-group-unshard": case_direct_group_unshard,
    **WRAPPED,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args(argv)

    def run_case(name: str, rank: int) -> None:
        run_dir = args.out / name
        result = CASES[name](run_dir)
        (run_dir / f"result.rank{rank}.json").write_text(json.dumps(result))

    run_cases(args.cases, run_case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
