#!/usr/bin/env python3
"""BD-LoRA training on a 4-bit (QLoRA-style) base of a large Llama shape, without a checkpoint on disk.

A 70B model cannot be written as random safetensors and then quantized at load on one GPU in reasonable time, so
the base is built directly quantized, layer by layer, on the device:

1. ``LlamaForCausalLM`` is created on the meta device (no memory);
2. the non-quantized weights (embeddings, norms, lm_head) are materialized on the device in bf16 (random / ones)
   and the rotary embedding is rebuilt there;
3. each decoder layer's seven projections are replaced one at a time by a bitsandbytes ``Linear4bit`` whose weight
   is drawn as a random bf16 matrix on the device and quantized there (nf4, double quantization by default): the
   peak extra memory is one bf16 projection.

The model is then marked as a 4-bit model for PEFT and built exactly like ``bdlora train`` builds a k-bit job
(``bdlora.quant.enable_bdlora_on_kbit`` -> ``get_peft_model(spec.to_peft_config())`` -> ``check_bd_structure`` and
``bdlora.quant.check_kbit_bd`` -> ``init_block_a_like_lora``), and trained for a few steps with a plain loop (AdamW
over the adapter, bf16 autocast, non-reentrant gradient checkpointing by default) on random tokens: the numbers are
throughput and memory, not quality.

    python bench/train/bench_kbit.py --shape llama70b --nblocks 8 --r 64 --seq 2048 --steps 6 --out R.json   # H100
    python bench/train/bench_kbit.py --shape llama8b --out R8.json
    python bench/train/bench_kbit.py --shape tiny --device cpu --out /tmp/x.json                             # CPU smoke

Prints and writes one JSON object: shape, build time, tokens/s over the timed steps (after ``--warmup`` steps),
median step time, losses, peak memory (torch.cuda.max_memory_allocated: after the build and during training),
trainable parameters, device and versions.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=512),
    "llama8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=14336, vocab_size=128256),
    "llama70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                     intermediate_size=28672, vocab_size=128256),
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_quantized_llama(shape: dict, device: torch.device, *, quant_type: str = "nf4", double_quant: bool = True,
                          compute_dtype=torch.bfloat16, init_std: float = 0.02, seed: int = 0):
    """A random ``LlamaForCausalLM`` of ``shape`` whose projections are bitsandbytes ``Linear4bit`` layers quantized
    on ``device`` one at a time (see the module docstring); everything else bf16 on ``device``."""
    import bitsandbytes as bnb
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False, use_cache=False,
                      dtype=torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=torch.bfloat16) * init_std

    # 2. non-quantized weights
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            continue
        for pname, p in list(module.named_parameters(recurse=False)):
            if "norm" in type(module).__name__.lower() or pname == "weight" and p.dim() == 1:
                value = torch.ones(p.shape, device=device, dtype=torch.bfloat16)
            else:
                value = rand(*p.shape)
            module._parameters[pname] = torch.nn.Parameter(value, requires_grad=False)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg).to(device)  # inv_freq computed, not on meta
    # 3. projections, quantized one by one on the device
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for pname in PROJECTIONS:
                old = getattr(parent, pname, None)
                if old is None:
                    continue
                new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=False, compute_dtype=compute_dtype,
                                        compress_statistics=double_quant, quant_type=quant_type, device="meta")
                new.weight = bnb.nn.Params4bit(rand(old.out_features, old.in_features), requires_grad=False,
                                               compress_statistics=double_quant, quant_type=quant_type,
                                               quant_storage=torch.uint8, module=new).to(device)
                setattr(parent, pname, new)
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.device.type == "meta"]
    if left:
        raise RuntimeError(f"still on the meta device: {left[:5]}")
    # what transformers sets on a bitsandbytes-loaded model, and PEFT / bdlora read
    model.is_loaded_in_4bit = True
    model.is_quantized = True
    model.config.use_cache = False
    return model


def build_peft(model, nblocks: int, r: int, lora_alpha: float):
    """The k-bit half of ``bdlora.train.trainer.build_peft_model`` on an already built base."""
    from peft import get_peft_model

    from bdlora import BDLoraSpec
    from bdlora.quant import check_kbit_bd, enable_bdlora_on_kbit
    from bdlora.peft_model import check_bd_structure, init_block_a_like_lora

    spec = BDLoraSpec.from_preset("llama", nblocks=nblocks, r=r, lora_alpha=lora_alpha)
    expected = spec.matching_modules(model)
    enable_bdlora_on_kbit()
    peft_model = get_peft_model(model, spec.to_peft_config(task_type="CAUSAL_LM"))
    check_bd_structure(peft_model, spec, expected)
    n_layers = check_kbit_bd(peft_model, spec.nblocks)
    init_block_a_like_lora(peft_model)
    return peft_model, spec, n_layers


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--layers", type=int, help="override the shape's number of decoder layers")
    p.add_argument("--nblocks", type=int, default=8)
    p.add_argument("--r", type=int, default=64)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--quant-type", choices=("nf4", "fp4"), default="nf4")
    p.add_argument("--no-double-quant", action="store_true")
    p.add_argument("--no-grad-ckpt", action="store_true", help="no gradient checkpointing")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON object here too")
    a = p.parse_args(argv)

    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shape = dict(SHAPES[a.shape])
    if a.layers:
        shape["num_hidden_layers"] = a.layers
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    base = build_quantized_llama(shape, device, quant_type=a.quant_type, double_quant=not a.no_double_quant,
                                 seed=a.seed)
    if device.type == "cpu":
        from bdlora.quant import disable_cpu_inference_packing

        disable_cpu_inference_packing(base)
    model, spec, n_lora = build_peft(base, a.nblocks, a.r, a.lora_alpha)
    _sync(device)
    build_s = time.perf_counter() - t0
    mem_after_build = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if not a.no_grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    n_train = sum(q.numel() for q in params)
    opt = torch.optim.AdamW(params, lr=a.lr, fused=device.type == "cuda")
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    gen = torch.Generator(device="cpu").manual_seed(a.seed)
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(a.warmup + a.steps):
        ids = torch.randint(0, shape["vocab_size"], (a.batch, a.seq), generator=gen).to(device)
        _sync(device)
        t = time.perf_counter()
        with amp:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if step >= a.warmup:
            times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise SystemExit(f"step {step}: loss {losses[-1]}")
    tokens = a.batch * a.seq
    import bitsandbytes
    import peft
    import transformers

    res = {
        "bench": "bd-lora on a 4-bit base (built quantized layer by layer)", "shape": a.shape, **shape,
        "quant_type": a.quant_type, "double_quant": not a.no_double_quant, "nblocks": spec.nblocks, "r": spec.r,
        "lora_layers": n_lora, "trainable_params": n_train, "seq": a.seq, "batch": a.batch,
        "grad_ckpt": not a.no_grad_ckpt, "warmup_steps": a.warmup, "timed_steps": a.steps,
        "build_s": round(build_s, 2), "tokens_per_s": round(tokens * len(times) / sum(times), 1) if times else None,
        "median_step_s": round(statistics.median(times), 4) if times else None,
        "losses": [round(x, 4) for x in losses],
        "peak_mem_build_gib": round(mem_after_build, 2) if mem_after_build is not None else None,
        "peak_mem_train_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda" else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                     "bitsandbytes": bitsandbytes.__version__, "python": sys.version.split()[0]},
    }
    text = json.dumps(res)
    print(text, flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
