#!/usr/bin/env python3
"""The single-job trainer (``bdlora train``) against the plain PEFT bf16 loop a user would write, side by side.

One process per run (fresh GPU memory statistics). The model is a random-weight Llama of the chosen shape written
once as bf16 safetensors; the data is plain text records whose lengths follow the engine benchmark's job mix
(about 30-250 tokens, batches of 8), so both sides see the same token counts per batch. The plain loop is
``bench/train/peft_bf16_loop.py`` (a copy of the measured anchor script), run with the same shape, rank and N.

    python bench/train/bench_trainer.py --shape llama8b --out results.jsonl            # trainer vs loop
    python bench/train/bench_trainer.py --lora-backends peft,cublas ...                # the trainer's BD layers
    python bench/train/bench_trainer.py --lora-backends cublas,cublas+liger ...        # + Liger kernels
    python bench/train/bench_trainer.py --lora-backends auto,auto+compile ...          # + torch.compile
    python bench/train/bench_trainer.py --shape llama8b --seq 2048 --grad-ckpt ...     # long sequences

Each run appends one JSON line to ``--out``: which side, tokens/s over the timed steps (real, unpadded tokens),
median step time, peak GPU memory (torch.cuda.max_memory_allocated), device and versions.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    "llama8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                    vocab_size=32000),
    "llama70b": dict(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, intermediate_size=28672,
                     vocab_size=32000),
    "smollm2": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                    vocab_size=49152),
    "tiny": dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512, vocab_size=512),
}
HERE = Path(__file__).resolve().parent


def build_model(shape: str, path: Path) -> Path:
    from bdlora.models import build_random_llama

    if not (path / "config.json").is_file():
        import torch

        build_random_llama(path, **SHAPES[shape], dtype="bfloat16", max_position_embeddings=4096,
                           device="cuda" if torch.cuda.is_available() else None)
    return path


def build_data(path: Path, tokenizer_dir: Path, n: int, min_len: int, max_len: int, seed: int = 0) -> Path:
    """Plain-text records of min_len..max_len tokens (exact: sampled from the tokenizer's own vocabulary)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rng = random.Random(seed)
    words = [w for w in tok.get_vocab() if w.isalpha() and w.isascii() and len(w) > 1][:400] or ["a"]
    with open(path, "w") as f:
        for _ in range(n):
            target = rng.randint(min_len, max_len)
            text = " ".join(rng.choice(words) for _ in range(target))
            ids = tok(text, add_special_tokens=False)["input_ids"][: target - 1]
            f.write(json.dumps({"text": tok.decode(ids)}) + "\n")
    return path


def length_grouped_sampling() -> dict:
    """transformers' length-grouped sampler (batches of similar lengths: less padding), under the name of the
    installed release (``train_sampling_strategy`` from transformers 5.18, ``group_by_length`` before)."""
    from dataclasses import fields

    from transformers import TrainingArguments

    if "train_sampling_strategy" in {f.name for f in fields(TrainingArguments)}:
        return {"train_sampling_strategy": "group_by_length"}
    return {"group_by_length": True}


def run_trainer(a) -> dict:
    import torch

    from bdlora.train.config import TrainConfig
    from bdlora.train.trainer import run_training

    extras = "".join(f"-{name}" for name, on in (("liger", a.liger), ("compile", a.compile),
                                                  ("grouped", a.group_by_length), ("packing", a.packing),
                                                  ("cudnn", a.cudnn_attention), ("synced", a.synced),
                                                  ("masked", a.masked_attention),
                                                  ("walks", a.module_walks),
                                                  (f"pad{a.pad_multiple}", a.pad_multiple)) if on)
    out = Path(a.workdir) / f"trainer-{a.tag}-{a.lora_backend}{extras}"
    cfg = TrainConfig(model=str(a.model), precision="bf16", nblocks=a.nblocks, r=a.rank, lora_alpha=16,
                      train_file=str(a.data), data_format="text", eval_fraction=0.0, max_length=a.max_len + 8,
                      lr=1e-4, scheduler="constant", warmup_steps=0, batch_size=a.batch, grad_accum=1,
                      max_steps=a.warmup + a.steps, log_every=a.log_every, output_dir=str(out), report_to=[],
                      progress=False,
                      overwrite_output_dir=True,  # this script's scratch folder: a repeat or a second run trains anew
                      gradient_checkpointing=a.grad_ckpt, gradient_checkpointing_every_n_layers=a.grad_ckpt_every,
                      # unset: bdlora train's default (packed batches through varlen flash attention on a GPU)
                      attn_implementation="sdpa" if a.masked_attention else None, packing=a.packing,
                      pad_multiple=a.pad_multiple,
                      training_args={"dataloader_num_workers": 0, "torch_compile": a.compile,
                                     **(length_grouped_sampling() if a.group_by_length else {}),
                                     # transformers' token count read back every step, the batch copied blocking
                                     **({"include_num_input_tokens_seen": "non_padding",
                                         "accelerator_config": {"non_blocking": False}} if a.synced else {})},
                      use_liger_kernel=a.liger, cudnn_attention=a.cudnn_attention,
                      load_in_4bit=a.load_in_4bit,
                      lora_backend=a.lora_backend)
    # +walks: the Trainer's own walks of every module per step (train(), zero_grad(), parameters()); the record says
    # which ran
    from bdlora.train.module_walks import CachedModuleWalks

    listed, install = [], CachedModuleWalks.install
    CachedModuleWalks.install = (lambda self, model: False) if a.module_walks else \
        (lambda self, model: listed.append(install(self, model)) or listed[-1])
    if a.sync_debug and torch.cuda.is_available():
        # every operation that makes the host wait for the GPU warns once per source line (the model's loading
        # included): where a step synchronizes
        import warnings

        warnings.simplefilter("default")
        torch.cuda.set_sync_debug_mode("warn")
    from transformers import Trainer

    from peft_bf16_loop import profile_summary

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA]) if a.profile else None

    started = time.time()
    with profiled_calls(prof, Trainer, "training_step", a.warmup, a.profile) if prof else contextlib.nullcontext():
        res = run_training(cfg, validate_adapter=False)
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "tokens_seen" in r and "train_loss" in r]
    t = {r["step"]: (r["time"], r["tokens_seen"]) for r in recs}
    s0, s1 = a.warmup, a.warmup + a.steps
    dt, dtok = t[s1][0] - t[s0][0], t[s1][1] - t[s0][1]
    steps = sorted(t)
    step_times = [(t[b][0] - t[a_][0]) / (b - a_) for a_, b in zip(steps, steps[1:]) if a_ >= s0]
    return {"side": "bdlora trainer", "pad_multiple": a.pad_multiple, "tok_per_s": round(dtok / dt, 1),
            "step_s_median": round(sorted(step_times)[len(step_times) // 2], 4),
            "step_s": [round(x, 4) for x in step_times],
            # from the run's start (loading included) to the end of the warm-up steps: where compilation shows
            "warmup_s": round(t[s0][0] - started, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
            "final_loss": res.train_loss, "module_walks_listed": bool(listed and listed[-1]),
            "profile": profile_summary(prof, a.profile, Path(a.out).with_suffix(f".{out.name}.prof.txt"))
            if prof else None}


@contextlib.contextmanager
def profiled_calls(prof, cls, method: str, skip: int, count: int):
    """``prof`` (a torch.profiler.profile) runs over calls skip+1 .. skip+count of ``cls.method`` in this process (the
    Trainer's training steps: forward, backward and, between them, the optimizer steps and the Trainer's own
    per-step work; the engine's rounds in bench_engine): the steady steps, without loading, warm-up or the final
    evaluation. Yields the number of calls profiled so far; restores the method after."""
    import torch

    inner, n, done = getattr(cls, method), [0], [0]

    def wrapped(self, *args, **kwargs):
        n[0] += 1
        if n[0] == skip + 1:
            prof.__enter__()
        out = inner(self, *args, **kwargs)
        if skip < n[0] <= skip + count:
            done[0] += 1
            if n[0] == skip + count:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                prof.__exit__(None, None, None)
        return out

    setattr(cls, method, wrapped)
    try:
        yield done
    finally:
        setattr(cls, method, inner)
        if 0 < done[0] < count:  # the run ended first
            prof.__exit__(None, None, None)


def spread(values: list[float]) -> dict:
    """Repeated measurements as median, min, max and their count (this script's and bench_engine's --repeats)."""
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def paired_over_loop(records: list[dict]) -> dict:
    """--repeats: per trainer side, each repeat's tok/s over the loop's of the same repeat (measured in one sequence,
    so drift of the machine between repeats cancels out), as :func:`spread`."""
    loop = {r["repeat"]: r["tok_per_s"] for r in records if r["side"] == "plain PEFT loop" and "tok_per_s" in r}
    out = {}
    for side in dict.fromkeys(r["side"] for r in records if r["side"] != "plain PEFT loop"):
        ratios = [r["tok_per_s"] / loop[r["repeat"]] for r in records
                  if r["side"] == side and "tok_per_s" in r and loop.get(r["repeat"])]
        if ratios:
            out[side] = spread(ratios)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    ap.add_argument("--side", default="both", choices=["both", "trainer", "loop"])
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--nblocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq", type=int, default=None, help="fixed sequence length (default: 30-250 tokens)")
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--grad-ckpt-every", type=int, default=1,
                    help="with --grad-ckpt: the trainer recomputes every n-th decoder layer only (the loop: every one)")
    ap.add_argument("--packing", action="store_true")
    ap.add_argument("--log-every", type=int, default=1,
                    help="the trainer's log_every (its step times come from the logs; every log reads the loss and "
                         "the gradient norm back from the GPU): --warmup and --steps must be multiples of it")
    ap.add_argument("--sync-debug", action="store_true",
                    help="torch.cuda.set_sync_debug_mode('warn') in the trainer runs: each source line that makes "
                         "the host wait for the GPU is printed once (stderr)")
    ap.add_argument("--pad-multiple", type=int, default=None,
                    help="the trainer's pad_multiple (batches rounded up to a multiple of this many tokens)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every side this many times in turn (loop, trainers, loop, ...): each repeat's "
                         "trainer/loop ratio, median / min / max, is printed last (one call's figures move 10-30%%)")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="torch.profiler over K steps after the warm-up, each side (a run of its own: profiling slows "
                         "the steps): host and GPU seconds and launches per step in the JSON, op tables beside --out")
    ap.add_argument("--load-in-4bit", action="store_true", help="the trainer on a bitsandbytes nf4 base (trainer only)")
    ap.add_argument("--lora-backends", default="auto",
                    help="trainer runs, one per lora_backend (comma list of auto / cublas / peft); BACKEND+liger runs "
                         "with use_liger_kernel: true, the others with false (Liger Kernel through transformers: "
                         "fused RMSNorm, SwiGLU, RoPE and linear cross-entropy); +compile adds "
                         "training_args.torch_compile (e.g. auto+liger+compile), +regional the same with "
                         "accelerate's regional compilation (ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1: the "
                         "repeated decoder layer compiled once), +grouped transformers' length-grouped sampler, "
                         "+packing packing: true, +cudnn cudnn_attention: true (sdpa may "
                         "pick cuDNN attention), +padN pad_multiple N (e.g. auto+liger+pad64), +synced the host "
                         "waiting for the GPU every step as transformers' defaults do (its token count read back, "
                         "the batch copied blocking), +walks the Trainer walking every module for train(), "
                         "zero_grad() and the clipping's parameters() each step (transformers' own; bdlora train "
                         "takes them from lists), +masked attn_implementation: sdpa (packed rows under "
                         "transformers' block-causal mask instead of varlen flash attention)")
    ap.add_argument("--lora-backend", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--liger", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--group-by-length", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cudnn-attention", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--synced", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--module-walks", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--masked-attention", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default="/tmp/bdlora-bench-trainer")
    ap.add_argument("--out", default="bench_trainer.jsonl")
    ap.add_argument("--tag", default="run")
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.min_len, a.max_len = (a.seq, a.seq) if a.seq else (30, 250)
    if a.warmup % a.log_every or a.steps % a.log_every:
        ap.error("--warmup and --steps must be multiples of --log-every")
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    base = {"shape": a.shape, "rank": a.rank, "nblocks": a.nblocks, "batch": a.batch, "seq": a.seq or "30-250",
            "grad_ckpt": a.grad_ckpt, "grad_ckpt_every": a.grad_ckpt_every, "packing": a.packing,
            "log_every": a.log_every,
            "pad_multiple": a.pad_multiple,
            "load_in_4bit": a.load_in_4bit, "timed_steps": a.steps, "warmup_steps": a.warmup,
            "profile_steps": a.profile, "date": time.strftime("%Y-%m-%d")}
    if a.model is None:  # parent: prepare model + data once, then one child process per side
        model = build_model(a.shape, work / f"model-{a.shape}")
        n = (a.warmup + a.steps + 2) * a.batch
        data = build_data(work / f"data-{a.min_len}-{a.max_len}.jsonl", model, n, a.min_len, a.max_len)
        trainers = [f"trainer:{b}" for b in a.lora_backends.split(",")]
        sides = ["loop", *trainers] if a.side == "both" else trainers if a.side == "trainer" else ["loop"]
        records = []
        for repeat, side in ((r, side) for r in range(max(1, a.repeats)) for side in sides):
            backend, *extras = side.partition(":")[2].split("+")
            regional = "regional" in extras  # accelerate's regional compilation: the repeated decoder layer once
            liger, compile_, grouped = "liger" in extras, "compile" in extras or regional, "grouped" in extras
            cudnn, packing, synced = "cudnn" in extras, "packing" in extras, "synced" in extras
            walks, masked = "walks" in extras, "masked" in extras
            pad = next((x[3:] for x in extras if x.startswith("pad") and x[3:].isdigit()), None)
            label = ("plain PEFT loop" if side == "loop" else f"bdlora trainer (lora_backend {backend}"
                     + (", Liger kernels" if liger else "") + (", torch_compile" if compile_ else "")
                     + (" of the repeated layer (regional)" if regional else "")
                     + (", length-grouped batches" if grouped else "") + (", packing" if packing else "")
                     + (", cuDNN attention" if cudnn else "") + (f", pad_multiple {pad}" if pad else "")
                     + (", synchronised every step" if synced else "")
                     + (", the Trainer's own module walks" if walks else "")
                     + (", sdpa's block-causal mask" if masked else "") + ")")
            if side == "loop":
                cmd = [sys.executable, str(HERE / "peft_bf16_loop.py"), "--shape", a.shape, "--rank", str(a.rank),
                       "--nblocks", str(a.nblocks), "--steps", str(a.steps), "--warmup", str(a.warmup),
                       "--batch", str(a.batch), "--min-len", str(a.min_len), "--max-len", str(a.max_len)]
                if a.grad_ckpt:
                    cmd.append("--grad-ckpt")
                if a.profile:
                    cmd += ["--profile", str(a.profile),
                            "--profile-out", str(Path(a.out).with_suffix(".loop.prof.txt"))]
            else:
                cmd = ([sys.executable, __file__, *sys.argv[1:], "--side", "trainer", "--model", str(model),
                        "--data", str(data), "--lora-backend", backend] + (["--liger"] if liger else [])
                       + (["--compile"] if compile_ else []) + (["--group-by-length"] if grouped else [])
                       + (["--packing"] if packing else [])
                       + (["--cudnn-attention"] if cudnn else []) + (["--pad-multiple", pad] if pad else [])
                       + (["--synced"] if synced else []) + (["--module-walks"] if walks else [])
                       + (["--masked-attention"] if masked else []))
            env = {**os.environ, **({"ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "1"} if regional else {})}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = next((l for l in reversed(proc.stdout.splitlines()) if l.startswith("{")), None)
            rec = {**base, "side": label, "repeat": repeat}
            if a.sync_debug and side != "loop":
                rec["sync_debug"] = str(Path(a.out).with_suffix(f".sync{len(records)}.txt"))
                Path(rec["sync_debug"]).write_text(proc.stderr)
            if proc.returncode or line is None:
                rec["error"] = (proc.stderr or proc.stdout)[-1500:]
            else:
                rec.update(json.loads(line))
                rec["side"] = label
            print(json.dumps(rec), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            records.append(rec)
        if a.repeats > 1:
            print(json.dumps({"paired_over_the_loop": paired_over_loop(records)}), flush=True)
        return 0
    import torch
    import transformers
    import peft

    rec = run_trainer(a)
    rec.update(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__,
               transformers=transformers.__version__, peft=peft.__version__)
    print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
