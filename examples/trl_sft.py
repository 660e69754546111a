#!/usr/bin/env python3
"""Train a BD-LoRA adapter with TRL's ``SFTTrainer`` directly, adding bdlora's BD-specific pieces.

For TRL users who keep their own script: ``BDLoraSpec.to_peft_config()`` is a PEFT ``LoraConfig`` with
``use_bdlora`` and the rsLoRA alpha that makes every block an independent rank r/N adapter, and
``bdlora.prepare_bd_model`` checks what PEFT built (exact module names, which factor is block-diagonal) and starts
every block-diagonal A like a standard LoRA A of its shard. The saved folder is what ``bdlora inspect`` and
``vllm serve --enable-bdlora`` read. ``bdlora train`` does all of this from one YAML file. Runs on whatever device
TRL picks (a GPU when there is one, in bf16 where it supports it).

    python examples/trl_sft.py --model HuggingFaceTB/SmolLM2-135M-Instruct --data train.jsonl --out outputs/trl-bd \
        --nblocks 3 --r 12

Data: TRL's forms (``prompt``/``completion``, ``messages``, ``text``), here read with ``datasets``.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def train(model: str, data: str, out: str, nblocks: int = 2, r: int = 8, max_steps: int = 20, lr: float = 2e-4,
          batch_size: int = 4) -> Path:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from bdlora import BDLoraSpec, prepare_bd_model

    base = AutoModelForCausalLM.from_pretrained(model)  # a hub id (downloaded as usual) or a local folder
    tokenizer = AutoTokenizer.from_pretrained(model)
    spec = BDLoraSpec.from_preset(base.config.model_type, nblocks=nblocks, r=r, lora_alpha=16)
    dataset = load_dataset("json", data_files=data, split="train")
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    args = SFTConfig(output_dir=out, max_steps=max_steps, learning_rate=lr, per_device_train_batch_size=batch_size,
                     logging_steps=1, report_to="none", save_strategy="no", bf16=bf16, disable_tqdm=True)
    trainer = SFTTrainer(model=base, args=args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=spec.to_peft_config(task_type="CAUSAL_LM"))
    prepare_bd_model(trainer.model, spec)  # PEFT built exactly this BD-LoRA; every block starts as a shard LoRA
    trainer.train()
    adapter = Path(out) / "adapter"
    trainer.model.save_pretrained(str(adapter))  # a PEFT folder: base_model_name_or_path is the id given above
    return adapter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="outputs/trl-bd")
    ap.add_argument("--nblocks", type=int, default=2)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=20)
    a = ap.parse_args()
    folder = train(a.model, a.data, a.out, a.nblocks, a.r, a.max_steps)
    print(f"saved {folder}; serve it with: vllm serve {a.model} --enable-lora --enable-bdlora "
          f"--tensor-parallel-size {a.nblocks} --lora-modules bd={folder}")


if __name__ == "__main__":
    main()
