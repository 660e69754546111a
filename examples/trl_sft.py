#!/usr/bin/env python3
"""Train a BD-LoRA adapter with TRL's ``SFTTrainer`` directly, adding bdlora's BD-specific pieces.

For TRL users who keep their own script: ``BDLoraSpec.to_peft_config()`` is a PEFT ``LoraConfig`` with
``use_bdlora`` and the rsLoRA alpha that makes every block an independent rank r/N adapter; bdlora then checks the
built structure (exact module names, which factor is block-diagonal), re-initializes block-diagonal A factors like
a standard LoRA A of each shard, and writes the model card. The saved folder is what ``bdlora inspect`` and
``bdlora serve`` (vLLM with ``--enable-bdlora``) read. ``bdlora train`` does all of this from one YAML file.

    python examples/trl_sft.py --model MODEL_DIR_OR_CACHED_ID --data train.jsonl --out outputs/trl-bd --nblocks 4 --r 32

Data: TRL's forms (``prompt``/``completion``, ``messages``, ``text``), here read with ``datasets``.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def train(model: str, data: str, out: str, nblocks: int = 2, r: int = 8, max_steps: int = 20, lr: float = 2e-4,
          batch_size: int = 4) -> Path:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from bdlora import BDLoraSpec
    from bdlora.models import resolve_model
    from bdlora.train.config import TrainConfig
    from bdlora.train.trainer import check_bd_structure, init_block_a_like_lora, write_model_card

    model_dir, base_id = resolve_model(model)  # a folder, a cached hub id, or a bdlora shortcut
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    spec = BDLoraSpec.from_preset(base.config.model_type, nblocks=nblocks, r=r, lora_alpha=16)
    expected = spec.matching_modules(base)  # exact names (PEFT matches substrings) and divisible widths
    dataset = load_dataset("json", data_files=data, split="train")
    args = SFTConfig(output_dir=out, max_steps=max_steps, learning_rate=lr, per_device_train_batch_size=batch_size,
                     logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = SFTTrainer(model=base, args=args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=spec.to_peft_config(task_type="CAUSAL_LM"))
    check_bd_structure(trainer.model, spec, expected)  # PEFT built N-block factors where the spec says
    init_block_a_like_lora(trainer.model)  # each block starts as an independent rank r/N LoRA would
    trainer.model.peft_config["default"].base_model_name_or_path = base_id
    trainer.train()
    adapter = Path(out) / "adapter"
    trainer.model.save_pretrained(str(adapter))
    cfg = TrainConfig(model=model, nblocks=nblocks, r=r, train_file=data, data_format="auto", lr=lr,
                      batch_size=batch_size, max_steps=max_steps, output_dir=out)
    write_model_card(adapter, spec, cfg, base_id, steps=max_steps)
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
    print(f"saved {folder}; serve it with: bdlora serve {a.model} --lora-modules bd={folder}")


if __name__ == "__main__":
    main()
