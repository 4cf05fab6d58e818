"""Shared pieces of the recorder benchmarks: interleaved timing, summaries, tables, models.

The benchmarks run on noisy shared CPUs, so every figure is a ratio of variants measured side
by side in one run: variants take turns in a rotating order, each turn is repeated, and the
summaries are the minimum (the least disturbed sample) and the median.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
from collections.abc import Sequence
from typing import TextIO

import torch
import torch.nn as nn


def rotated(variants: Sequence[str], rep: int) -> list[str]:
    """Variant order for repetition ``rep``: each variant runs first equally often."""
    shift = rep % len(variants)
    return list(variants[shift:]) + list(variants[:shift])


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sample."""
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def min_median(samples: Sequence[float]) -> tuple[float, float]:
    return min(samples), statistics.median(samples)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]],
                stream: TextIO = sys.stdout) -> None:
    """A GitHub-markdown table, so the output can be pasted into README.md as it is."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    print(f"\n{title}\n", file=stream)
    for index, row in enumerate(cells):
        padded = (c.ljust(w) for c, w in zip(row, widths, strict=True))
        print("| " + " | ".join(padded) + " |", file=stream)
        if index == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=stream)
    stream.flush()


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dir_bytes(path: str | os.PathLike[str], *, table: str | None = None) -> tuple[int, int]:
    """(apparent bytes, number of files) under a run dir, or under one table of it."""
    root = os.path.join(path, table) if table else os.fspath(path)
    total = count = 0
    for directory, _, files in os.walk(root):
        for name in files:
            total += os.path.getsize(os.path.join(directory, name))
            count += 1
    return total, count


class Block(nn.Module):
    """A transformer-ish residual MLP block: one FSDP unit."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Stack(nn.Module):
    """``num_layers`` blocks between an input and an output projection (the root unit)."""

    def __init__(self, num_layers: int, dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(num_layers))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def build_fsdp_stack(num_layers: int, dim: int, *, prefetch: bool = True
                     ) -> tuple[Stack, torch.optim.Optimizer]:
    """One FSDP unit per block plus the root; explicit one-ahead forward/backward prefetch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # One mesh for all units: fully_shard without one builds a new mesh per call (~0.1 s each).
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Stack(num_layers, dim)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if prefetch:
        layers = list(model.layers)
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 2])
            layer.set_modules_to_backward_prefetch(layers[max(i - 1, 0):i] if i else [])
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)
