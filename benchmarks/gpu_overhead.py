"""What recording costs a real CUDA FSDP2 job: step time, hook latency, the optimizer boundary.

Every other figure of the recorder is CPU/gloo, where a step is mostly gloo and the recorder
hides in the noise. On a GPU the training thread is the one launching kernels, and every µs a
hook adds is on that thread: if the thread is the bottleneck (small kernels, fast steps), the
step pays it. This script trains one process (world size 1: what a single-GPU machine allows)
on a decoder-only transformer with one ``fully_shard`` unit per block plus the root, explicit
one-ahead forward and backward prefetch, bf16 compute with fp32 reduce (``MixedPrecisionPolicy``)
and AdamW, and measures:

1. step time with and without ``fsdptrace.attach``, the two taking turns in blocks (a block is
   one untimed step then ``--steps`` timed ones; a step ends with ``torch.cuda.synchronize()``),
   as the ratio recorded ÷ not recorded of the minimum and of the median step;
2. the latency of each recorder hook on the training thread (wall clock around each call, the
   timers of ``recorder_overhead.py``), in a separate recorded block so the timers do not
   disturb (1): p50, p90, p99 and max;
3. the optimizer boundary: ``before_optimizer_step`` (gradient presence, pending all-gathers,
   what the step wrote) and the gradient baseline at each step's first micro-step.

    python benchmarks/gpu_overhead.py                      # one GPU, ~1.2B parameters, bf16
    python benchmarks/gpu_overhead.py --device cpu --quick # the CI smoke test, seconds
    python benchmarks/gpu_overhead.py --json out.json      # the figures as JSON too
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port, min_median, percentile, print_table, rotated  # noqa: E402
from recorder_overhead import HookTimer  # noqa: E402

OFF, ON = "no recording", "fsdptrace"


@dataclass(frozen=True)
class Config:
    """Defaults: ~1.2B parameters (20 blocks of dim 2048, vocabulary 32k), 8k tokens a step."""

    device: str = "cuda"
    dim: int = 2048
    layers: int = 20
    heads: int = 16
    vocab: int = 32768
    seq: int = 2048
    batch: int = 4
    micro_steps: int = 1
    reps: int = 6
    steps: int = 30
    latency_steps: int = 20
    warmup_steps: int = 3
    dtype: str = "bfloat16"


# The CPU smoke test: the same code path on a tiny model; each attach starts a writer
# process, so one block per variant.
QUICK = Config(device="cpu", dim=32, layers=3, heads=2, vocab=64, seq=16, batch=2,
               micro_steps=2, reps=1, steps=2, latency_steps=2, warmup_steps=1,
               dtype="float32")


class Block(nn.Module):
    """Pre-norm attention and MLP: one FSDP unit."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, -1).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    """Embedding and head in the root unit, one unit per block."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build(cfg: Config) -> tuple[Transformer, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    with torch.device(cfg.device):
        model = Transformer(cfg)
    mesh = init_device_mesh(cfg.device, (1,))
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.dtype),
                                  reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
        block.set_modules_to_backward_prefetch(blocks[i - 1:i] if i else [])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    return model, optimizer


class Trainer:
    """One optimizer step of ``micro_steps`` forward+backward on random tokens, synchronized."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.model, self.optimizer = build(cfg)
        generator = torch.Generator(device=cfg.device).manual_seed(0)
        self.tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), device=cfg.device,
                                    generator=generator)

    def step(self) -> float:
        start = time.perf_counter()
        inputs, targets = self.tokens[:, :-1], self.tokens[:, 1:]
        for _ in range(self.cfg.micro_steps):
            logits = self.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.cfg.device)
        return time.perf_counter() - start


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def recording(name: str, trainer: Trainer, run_dir: Path) -> Iterator[Any]:
    import fsdptrace

    if name == OFF:
        yield None
        return
    with fsdptrace.attach(trainer.model, run_dir=run_dir, optimizer=trainer.optimizer) as rec:
        yield rec


def measure_steps(trainer: Trainer, tmp: Path) -> dict[str, list[float]]:
    cfg = trainer.cfg
    times: dict[str, list[float]] = {OFF: [], ON: []}
    for rep in range(cfg.reps):
        for name in rotated([OFF, ON], rep):
            with recording(name, trainer, tmp / f"steps-{rep}"):
                trainer.step()  # the first step after attach pays one-off costs
                times[name].extend(trainer.step() for _ in range(cfg.steps))
    return times


def measure_latency(trainer: Trainer, tmp: Path) -> dict[str, list[int]]:
    from fsdptrace.record import snapshots

    timer = HookTimer()
    baseline = snapshots.take_grad_baseline
    snapshots.take_grad_baseline = timer.timed("gradient baseline (first micro-step)", baseline)
    try:
        with recording(ON, trainer, tmp / "latency") as rec:
            timer.install(rec)
            for _ in range(trainer.cfg.latency_steps):
                trainer.step()
    finally:
        snapshots.take_grad_baseline = baseline
    return timer.samples


def run(cfg: Config) -> dict[str, Any]:
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if cfg.device == "cuda":
        torch.cuda.set_device(0)  # before NCCL starts, so its communicator uses this device
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        trainer = Trainer(cfg)
        num_params = sum(p.numel() for p in trainer.model.parameters())
        for _ in range(cfg.warmup_steps):
            trainer.step()
        with tempfile.TemporaryDirectory(prefix="fsdptrace-gpu-") as tmp:
            times = measure_steps(trainer, Path(tmp))
            latency = measure_latency(trainer, Path(tmp))
        memory = torch.cuda.max_memory_allocated() if cfg.device == "cuda" else 0
    finally:
        dist.destroy_process_group()
    device_name = torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu"
    return {"config": asdict(cfg), "device_name": device_name, "num_params": num_params,
            "max_memory_allocated": memory, "times": times, "latency": latency}


def report(results: dict[str, Any]) -> None:
    cfg = Config(**results["config"])
    times = results["times"]
    base_min, base_median = min_median(times[OFF])
    rows = []
    for name in (OFF, ON):
        low, median = min_median(times[name])
        rows.append([name, len(times[name]), low * 1e3, median * 1e3, low / base_min,
                     median / base_median])
    print_table(
        f"Step time, {results['device_name']}, world size 1, {results['num_params'] / 1e9:.2f}B "
        f"parameters, {cfg.layers + 1} units, {cfg.dtype}, batch {cfg.batch} x seq {cfg.seq}, "
        f"{cfg.micro_steps} micro-step(s)/step, {cfg.reps} alternated blocks x {cfg.steps} steps",
        ["variant", "steps", "min ms", "median ms", "min ÷ min(no rec)",
         "median ÷ median(no rec)"], rows)
    rows = [[kind, len(samples), *(percentile(samples, q) / 1e3 for q in (50, 90, 99)),
             max(samples) / 1e3] for kind, samples in results["latency"].items() if samples]
    print_table(f"Recorder calls on the training thread, µs ({cfg.latency_steps} steps; the "
                "optimizer boundary and the baseline are the per-step gradient snapshots)",
                ["call", "calls", "p50", "p90", "p99", "max"], rows)
    if results["max_memory_allocated"]:
        print(f"\nmax_memory_allocated: {results['max_memory_allocated'] / 2**30:.1f} GiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (CI)")
    for field in ("dim", "layers", "heads", "seq", "batch", "micro_steps", "reps", "steps",
                  "latency_steps"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    overrides = {k: v for k, v in vars(args).items() if k in Config.__dataclass_fields__
                 and v is not None and k != "device"}
    cfg = replace(cfg, device=args.device, **overrides)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("gpu_overhead: no CUDA device here; use --device cpu (with --quick for a tiny "
              "model)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the CPU run is a smoke test; a GPU run launches from one thread
    started = time.perf_counter()
    results = run(cfg)
    report(results)
    print(f"\n(total {time.perf_counter() - started:.1f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
