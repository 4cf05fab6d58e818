"""A torchtitan training job (``torchtitan.train``, llama3, FSDP2) on CPU/gloo, 2 ranks.

    fsdptrace record --run-dir RUN -- torchrun --nproc-per-node 2 trainer_torchtitan.py \\
        --module __main__ --config CASE --dump_folder OUT [torchtitan options...]

This file is torchtitan's entry point (``torchtitan.train.main``, the same one
``torchrun -m torchtitan.train`` runs) with CPU shims, and the config registry that
``--module __main__ --config CASE`` loads from. Nothing here knows of fsdptrace. Written under
``$TITAN_ASSETS/rank<r>``: a tokenizer and a small text data set (no downloads).

The CPU shims, each for a failure measured with torchtitan 0.3.0 on torch 2.13 (docs/trainers.md
lists them for users):

- device: torchtitan picks it once, at import of ``torchtitan.tools.utils``, as
  ``_get_available_device_type() or "cuda"``; on a host without an accelerator
  ``torch.cuda.set_device`` then fails. That one call answers "cpu" while the module is imported
  (gloo becomes the backend), with a device module that also answers the CUDA-style calls of
  torchtitan's metrics (``_CpuDeviceModule``);
- ``torch.distributed.set_timeout`` (a later torch's API, called after step 1) is torch 2.13's
  ``_set_pg_timeout``;
- attention: FlexAttention has no backward on CPU and torchtitan refuses its ``sdpa`` backend for
  language models, so each layer gets torchtitan's own (maskless, causal)
  ``ScaledDotProductAttention``;
- reductions: torchtitan's ``set_gradient_divide_factor(1.0)`` makes FSDP2 reduce with
  ``PREMUL_SUM``, which gloo refuses; ``set_force_sum_reduction_for_comms(True)`` keeps SUM;
- ``spmd_backend="partial_dtensor"`` (the plain ``fully_shard`` path): the default
  ``spmd_types`` path failed in ``fully_shard`` on plain tensors.

torchtitan also imports ``triton`` unconditionally (its MoE kernels) without declaring it: the
``trainers`` extra installs triton, which imports without a GPU.

Cases (config functions below): ``clean`` (a tiny llama3 built like its ``debugmodel``: 2
layers, dim 16, 4 steps of 1 micro-step); ``bad_prefetch_then_crash`` (``clean`` with a
``ModelSpec.parallelize_fn``, where a torchtitan user changes sharding, that wires ``layers.1``
to forward-prefetch ``layers.0``, which runs before it, and makes rank 1 raise as its forward of
step 2 begins).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch._utils


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the CUDA-style calls torchtitan makes: its memory monitor's (name,
    capacity, peak statistics: the CPU keeps no allocator statistics) and a device index."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        """An index, as ``barrier(device_ids=...)`` wants (``torch.cpu``'s answer is "cpu")."""
        return 0

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE")
                                     * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def _import_torchtitan_on_cpu() -> None:
    """Let torchtitan choose the CPU as its device (see the module docstring for why)."""
    real_type = torch._utils._get_available_device_type
    real_module = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type: _CpuDeviceModule("torch.cpu")
    try:
        import torchtitan.tools.utils  # noqa: F401
    finally:
        torch._utils._get_available_device_type = real_type
        torch._utils._get_device_module = real_module


_import_torchtitan_on_cpu()
if not hasattr(torch.distributed, "set_timeout"):
    # torchtitan 0.3.0 calls this public API of a later torch after its first step; torch
    # 2.13 has the same function under a private name.
    torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout

from torchtitan.models.llama3 import config_registry, llama3_configs, model_registry  # noqa: E402
from torchtitan.train import main as torchtitan_main  # noqa: E402

DIM = 16
NUM_LAYERS = 2
SEQ_LEN = 32
NUM_STEPS = 4
CRASH_STEP = 2
WORDS = [f"w{i}" for i in range(60)]
SPECIAL = ["<unk>", "<bos>", "<eos>"]


def _write_assets(folder: Path) -> None:
    """A word-level tokenizer and a small text data set: torchtitan loads both from disk."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    (folder / "tokenizer").mkdir(parents=True, exist_ok=True)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer" / "tokenizer.json"))
    (folder / "tokenizer" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True,
                    "add_eos_token": True}))
    generator = torch.Generator().manual_seed(0)
    with open(folder / "data" / "data.jsonl", "w") as f:
        for _ in range(64):
            ids = torch.randint(len(WORDS), (40,), generator=generator).tolist()
            f.write(json.dumps({"text": " ".join(WORDS[i] for i in ids)}) + "\n")


def _tiny(attn_backend: str, tp_gemm_backend: str = "default") -> Any:
    """torchtitan's ``debugmodel`` flavor at test size: its own layer builder and inits (private
    to ``torchtitan.models.llama3``; the flavors' sizes are hard-coded), so the same units."""
    from torchtitan.models import llama3
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import ComplexRoPE

    vocab = len(SPECIAL) + len(WORDS)
    layers = llama3._build_llama3_layers(
        fuse_qkv=True, n_layers=NUM_LAYERS, dim=DIM, n_heads=2, hidden_dim=4 * DIM,
        rope=ComplexRoPE.Config(dim=DIM // 2, max_seq_len=SEQ_LEN, theta=500000,
                                scaling="llama"),
        attn_backend=attn_backend, tp_gemm_backend=tp_gemm_backend)
    for layer in layers:
        # FlexAttention has no backward on CPU ("FlexAttention does not support backward on
        # CPU"); torchtitan's maskless SDPA module (causal) runs there.
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return llama3.Llama3Model.Config(
        dim=DIM, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=DIM,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=vocab,
                              param_init=llama3._output_linear_init(DIM)),
        layers=layers,
    )


llama3_configs["tiny"] = _tiny


def _config(extra: Any = None) -> Any:
    """torchtitan's llama3 debug recipe, tiny and on local files, without checkpoints or CUDA
    graphs (``disable_cuda_graphs``: they need CUDA), float32 (fast on CPU)."""
    assets = _assets()
    config = config_registry.llama3_debugmodel()
    config.model_spec = model_registry("tiny", attn_backend="flex")
    config.model_spec.parallelize_fn = _parallelize(extra)
    config.hf_assets_path = str(assets / "tokenizer")
    config.dataloader.dataset_path = str(assets / "data")
    config.loss.loss_fn.global_vocab_size = len(SPECIAL) + len(WORDS)
    config.training.local_batch_size = 2
    config.training.seq_len = SEQ_LEN
    config.training.steps = NUM_STEPS
    config.training.disable_cuda_graphs = True
    config.training.mixed_precision_param = "float32"
    config.parallelism.spmd_backend = "partial_dtensor"
    config.checkpoint.enable = False
    config.validator.enable = False
    return config


def _assets() -> Path:
    """Per rank, so that the two ranks never write the same file."""
    return Path(os.environ["TITAN_ASSETS"]) / f"rank{os.environ['RANK']}"


def _parallelize(extra: Any = None) -> Any:
    """llama3's own parallelize function, made to reduce with plain sums, then ``extra(model)``
    on the sharded model (the ``ModelSpec.parallelize_fn`` hook is where a torchtitan user
    changes sharding and prefetch).

    Sums: torchtitan turns FSDP2's gradient division off (``set_gradient_divide_factor(1.0)``),
    which makes FSDP2 reduce-scatter with ``PREMUL_SUM``; gloo refuses it ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo"). ``set_force_sum_reduction_for_comms(True)`` makes FSDP2
    reduce with SUM and scale separately: the same gradients, the same collectives."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.models.llama3 import parallelize_llama

    def parallelize(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        model = parallelize_llama(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        if extra is not None:
            extra(model)
        return model

    return parallelize


def _wrong_prefetch(model: torch.nn.Module) -> None:
    model.layers["1"].set_modules_to_forward_prefetch([model.layers["0"]])


def _crash_on_rank_1(model: torch.nn.Module) -> None:
    """Rank 1 raises in its forward of step ``CRASH_STEP`` (0-based)."""
    num_forwards = [0]

    def count(module: torch.nn.Module, args: Any) -> None:
        if os.environ["RANK"] == "1" and num_forwards[0] == CRASH_STEP:
            raise RuntimeError("planted bad batch on rank 1")
        num_forwards[0] += 1

    # Before FSDP's own pre-forward hook on the root, so rank 1 issues no all-gather of that
    # step (zero-code recording attaches later, at the first forward, and prepends its hook too:
    # it records the root's entry, measured).
    model.register_forward_pre_hook(count, prepend=True)


def _both(*extras: Any) -> Any:
    def apply(model: torch.nn.Module) -> None:
        for extra in extras:
            extra(model)

    return apply


def clean() -> Any:
    return _config()


def bad_prefetch_then_crash() -> Any:
    return _config(_both(_wrong_prefetch, _crash_on_rank_1))


if __name__ == "__main__":
    _write_assets(_assets())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    sys.exit(torchtitan_main())
