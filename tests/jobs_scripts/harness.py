"""What every batched job script shares: the process group around a list of cases, and a block.

One launch runs many cases (each rank's process group starts once, ~2-4 s on CPU), with a
barrier after each case so no rank runs ahead into the next case's collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

DIM = 8


@contextmanager
def process_group() -> Iterator[int]:
    """This rank's number in the job's gloo group, torn down on leaving.

    A group already started by a catalogue launch (``catalogue.py``, several scripts' cases in
    one process group) is joined instead, and left for that launch to tear down.
    """
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")
    try:
        yield dist.get_rank()
    finally:
        if owned:
            dist.destroy_process_group()


def run_cases(names: Iterable[str], run_case: Callable[[str, int], None]) -> None:
    """Run ``run_case(name, rank)`` for each case on the job's gloo group (``process_group``)."""
    with process_group() as rank:
        for name in names:
            run_case(name, rank)
            print(f"done {name}", flush=True)
            dist.barrier()


class Block(nn.Module):
    """A residual block small enough that a job of a dozen units runs in a second."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """A second entry point, for ``register_fsdp_forward_method``."""
        return self.fc(x)
