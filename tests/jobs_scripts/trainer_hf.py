"""The transformers ``Trainer`` on FSDP2 (``fsdp_config={"fsdp_version": 2}``), as its users run it:

    fsdptrace record --run-dir RUN -- torchrun --nproc-per-node 2 trainer_hf.py CASE --out DIR

A tiny Llama built from its config (no download): 2 decoder layers, each a unit, and the root.
One epoch of 6 batches per rank with ``gradient_accumulation_steps=2`` (3 optimizer steps of 2
micro-steps), evaluation of 1 batch per rank after step 2 (``eval_steps=2``).

CPU shim (kept here on purpose): the Trainer hands its FSDP plugin to accelerate, which honours
it only for GPU-type setups; on CPU the state says ``MULTI_CPU`` and the model is silently
wrapped in DDP. ``CpuFsdpTrainer`` sets the two fields accelerate would set on GPU
(``distributed_type = FSDP`` and ``fsdp_plugin``) right after the Trainer creates its
accelerator; the Trainer's own FSDP2 path then runs unchanged.

Cases: ``clean``; ``bad_prefetch+crash`` (a ``TrainerCallback`` wires ``layers.1`` to
forward-prefetch ``layers.0``, which ran first, and another makes rank 1 raise in
``on_step_begin`` of step 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

VOCAB = 64
SEQ = 8
NUM_TRAIN_SAMPLES = 24  # 12 per rank, batch 2: 6 batches
NUM_EVAL_SAMPLES = 4  # 2 per rank: 1 batch


class CpuFsdpTrainer(Trainer):
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # The CPU shim (module docstring): what accelerate sets on GPU.
        plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        self.accelerator.state.distributed_type = DistributedType.FSDP
        self.accelerator.state.fsdp_plugin = plugin
        self.is_fsdp_enabled = True


class WrongPrefetch(TrainerCallback):
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        layers = model.model.layers
        layers[1].set_modules_to_forward_prefetch([layers[0]])


class CrashOnRank1(TrainerCallback):
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if args.process_index == 1 and state.global_step == 2:
            raise RuntimeError("planted bad batch on rank 1")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, num: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (num, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["clean", "bad_prefetch+crash"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=SEQ)
    model = LlamaForCausalLM(config)
    training = TrainingArguments(
        output_dir=str(args.out / "trainer"), per_device_train_batch_size=2,
        per_device_eval_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=1,
        eval_strategy="steps", eval_steps=2, learning_rate=1e-3, save_strategy="no",
        report_to=[], logging_strategy="no", use_cpu=True, dataloader_num_workers=0,
        fsdp="full_shard auto_wrap",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                     "reshard_after_forward": True},
        ddp_timeout=60,  # bounds the wait for a dead peer
    )
    plants = {"bad_prefetch": WrongPrefetch, "crash": CrashOnRank1}
    callbacks = [plants[fault]() for fault in args.case.split("+") if fault in plants]
    trainer = CpuFsdpTrainer(model=model, args=training, train_dataset=Tokens(NUM_TRAIN_SAMPLES, 0),
                             eval_dataset=Tokens(NUM_EVAL_SAMPLES, 1), callbacks=callbacks)
    trainer.train()
    rank = int(os.environ.get("RANK", 0))
    result = {"global_step": trainer.state.global_step,
              "distributed_type": str(trainer.accelerator.distributed_type),
              "model_type": type(trainer.model_wrapped).__name__}
    (args.out / f"result.rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
