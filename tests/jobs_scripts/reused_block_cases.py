"""A block reused at two depths (ALBERT style), recorded on real FSDP2 into ``--out/<case>``.

Run on 2 CPU ranks (gloo) through ``tests.jobs.run_ranks``; one launch records every case.
Forward runs ``embed, shared, mid, shared, late`` under the root: ``shared`` is one unit called
twice per pass. ``mid-prefetches-shared`` configures ``mid -> shared`` in forward, which the
second call of ``shared`` consumes; ``late-prefetches-shared`` configures ``late -> shared``,
after every call of ``shared``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdptrace

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from harness import DIM, Block, run_cases  # noqa: E402

VOCAB = 16
STEPS = 2
MICRO_STEPS = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.shared = Block()
        self.mid = Block()
        self.late = Block()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.embed(tokens))
        h = self.shared(self.mid(h))
        return self.head(self.late(h))


def sharded_net() -> Net:
    torch.manual_seed(0)
    net = Net()
    for unit in (net.embed, net.shared, net.mid, net.late):
        fully_shard(unit)
    fully_shard(net)
    return net


def train(net: Net, run_dir: Path) -> None:
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    with fsdptrace.attach(net, run_dir=run_dir, optimizer=optimizer):
        for _ in range(STEPS):
            for _ in range(MICRO_STEPS):
                tokens = torch.randint(0, VOCAB, (8,), generator=generator)
                net(tokens).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()


def case_mid_prefetches_shared(run_dir: Path) -> None:
    net = sharded_net()
    net.mid.set_modules_to_forward_prefetch([net.shared])
    train(net, run_dir)


def case_late_prefetches_shared(run_dir: Path) -> None:
    net = sharded_net()
    net.late.set_modules_to_forward_prefetch([net.shared])
    train(net, run_dir)


CASES: dict[str, Callable[[Path], None]] = {
    "mid-prefetches-shared": case_mid_prefetches_shared,
    "late-prefetches-shared": case_late_prefetches_shared,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args(argv)
    run_cases(args.cases, lambda name, rank: CASES[name](args.out / name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
