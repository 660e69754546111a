"""Where does BD-LoRA decode time go in vLLM? One process, one GPU, no server: stock BD layers vs the experimental
fused decode op (``--bdlora-fused-decode``), each with CUDA graphs and eager.

    python -m bench.serve.decode_probe --out probe.json [--layers 4] [--rank 64] [--nblocks 4] [--targets q_proj,...]

Builds a random Llama of Llama-3.1-8B layer width (hidden 4096, intermediate 14336, 32/8 heads, vocab 32000) with
``--layers`` decoder layers in bf16 and one PEFT BD-LoRA adapter on all 7 projections (or ``--targets``), then per
mode starts an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TP=1) and measures, after a warm-up:

* decode ms per token at batch 1 and at batch ``--batch`` (difference of two generations of different lengths over
  the extra tokens, so prefill and start-up cancel), for a base request and a LoRA request;
* the fused op's call counters during the timed LoRA generation (``fused:*`` = bdlora's kernel ran from Python):
  with CUDA graphs the op is captured once per graph size and a replay runs no Python, so counters that grow with
  the number of decode steps mean the op runs eagerly in graph mode;
* a torch.profiler table (host time) of a short LoRA generation.

``--layers 2,8`` (several counts) repeats all of it per layer count and fits, per mode, LoRA minus base decode time
= per_step + per_layer x layers (``fit``): what vLLM's LoRA path costs per decoder layer (the modules' kernels and
whatever surrounds them) and once per step (embedding / logits LoRA, metadata), the split serving numbers alone
cannot give.

Prints a table and writes JSON. Meant for the device machine (vLLM 0.26 bundle on PYTHONPATH); on a CPU-only
machine it exits with a message.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file (python bench/serve/x.py): the repository root makes bench.serve importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model runs in this process: counters, profiler

SHAPE = dict(hidden_size=4096, num_heads=32, num_kv_heads=8, intermediate_size=14336, vocab_size=32000)


def build(root: Path, layers: int, rank: int, nblocks: int, shape: dict, targets=None) -> tuple[Path, Path]:
    from bdlora.models import build_random_llama
    from bdlora.spec import BDLoraSpec
    from bench.serve.harness import make_peft_adapter

    model = build_random_llama(root / f"llama8b-width-l{layers}", num_layers=layers, dtype="bfloat16",
                               init_std=0.02, max_position_embeddings=4096, **shape)
    spec = BDLoraSpec.from_preset("llama", nblocks=nblocks, r=rank, lora_alpha=2 * rank, target_modules=targets)
    adapter = make_peft_adapter(model, root / f"bd-l{layers}", spec.to_peft_config(), seed=1, std=0.01)
    return model, adapter


def fit_overheads(rows: list[dict], batch: int) -> dict:
    """Per mode with results at >= 2 layer counts: least-squares fit of (LoRA - base) decode ms per step against
    the layer count, at batch 1 and at ``batch``: {mode: {"bs1": {"per_layer_us", "per_step_us"}, ...}}."""
    fits = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for tag, lora_key, base_key in (("bs1", "lora_bs1_ms", "base_bs1_ms"),
                                        (f"bs{batch}", f"lora_bs{batch}_ms", f"base_bs{batch}_ms")):
            pts = [(r["layers"], r[lora_key] - r[base_key]) for r in rows
                   if r["mode"] == mode and lora_key in r and base_key in r]
            if len({x for x, _ in pts}) < 2:
                continue
            mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
            slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
            fits.setdefault(mode, {})[tag] = {"per_layer_us": round(1000 * slope, 2),
                                              "per_step_us": round(1000 * (my - slope * mx), 2)}
    return fits


def decode_ms(llm, lora, n_req: int, short: int, long: int, prompt_len: int) -> float:
    """ms per decode step: (time of `long` tokens - time of `short` tokens) / (long - short), n_req requests."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 30000 + 100 for j in range(prompt_len)]} for i in range(n_req)]

    def run(n_tok: int) -> float:
        sp = SamplingParams(max_tokens=n_tok, ignore_eos=True, temperature=0.0)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
        return time.perf_counter() - t0

    run(short)  # warm-up of this batch size
    t_short = min(run(short) for _ in range(2))
    t_long = min(run(long) for _ in range(2))
    return 1000 * (t_long - t_short) / (long - short)


def probe_mode(name: str, model: Path, adapter: Path, rank: int, fused, eager: bool, batch: int, profile: bool):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from bdlora.vllm_plugin import diagnostics as D
    from bench.serve import harness as T

    extra = {"bdlora": True}
    if fused is not None:
        extra["bdlora_fused_decode"] = fused
    t0 = time.perf_counter()
    llm = T.start_llm(model, dtype="bfloat16", enforce_eager=eager, max_model_len=2048, max_num_seqs=max(64, batch),
                      enable_lora=True, max_lora_rank=rank, max_loras=1, gpu_memory_utilization=0.4,
                      additional_config=extra)
    res = {"mode": name, "eager": eager, "fused": fused, "start_s": round(time.perf_counter() - t0, 1)}
    try:
        lora = LoRARequest("bd", 1, str(adapter))
        res["base_bs1_ms"] = decode_ms(llm, None, 1, 16, 144, 128)
        res["lora_bs1_ms"] = decode_ms(llm, lora, 1, 16, 144, 128)
        D.reset_fused_decode_counters()
        res[f"lora_bs{batch}_ms"] = decode_ms(llm, lora, batch, 8, 40, 64)
        res["base_bs%d_ms" % batch] = decode_ms(llm, None, batch, 8, 40, 64)
        D.reset_fused_decode_counters()
        sp = SamplingParams(max_tokens=65, ignore_eos=True, temperature=0.0)
        llm.generate([{"prompt_token_ids": list(range(100, 164))}], sp, lora_request=lora, use_tqdm=False)
        res["counters_64_decode_steps"] = D.read_fused_decode_counters()
        if profile:  # base and LoRA generations of 16 decode steps: which kernels (and host ops) LoRA adds
            from torch.profiler import ProfilerActivity, profile as prof_ctx

            res["profile"] = ""
            for tag, req in (("base", None), ("lora", lora)):
                with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    llm.generate([{"prompt_token_ids": list(range(100, 164))}], SamplingParams(
                        max_tokens=17, ignore_eos=True, temperature=0.0), lora_request=req, use_tqdm=False)
                ka = prof.key_averages()
                res["profile"] += (f"\n### {name} {tag}, 16 decode steps, layers={model.name}\n"
                                   + ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
                                   + "\n" + ka.table(sort_by="self_cuda_time_total", row_limit=25,
                                                      max_name_column_width=60))
    finally:
        T.stop_llm(llm)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="decode_probe.json")
    ap.add_argument("--layers", default="4", help="decoder layers; a comma list (e.g. 2,8) fits per-layer costs")
    ap.add_argument("--targets", help="comma list of adapted projections (default all 7: q,k,v,o,gate,up,down)")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--nblocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--modes", default="stock,fused,stock_eager,fused_eager")
    ap.add_argument("--profile", action="store_true", help="a torch.profiler table per mode")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on vLLM-CPU (checks the script only)")
    args = ap.parse_args(argv)
    every = {"max_tokens": 64}  # the kernel at batch 1 and at --batch (<= 64), not the serving default's cut-off
    modes = {"stock": (None, False), "fused": (every, False), "stock_eager": (None, True),
             "fused_eager": (every, True)}
    unknown = sorted(set(args.modes.split(",")) - set(modes))
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {', '.join(modes)}")
    try:
        layer_counts = [int(v) for v in args.layers.split(",")]
        assert layer_counts and min(layer_counts) >= 1
    except (ValueError, AssertionError):
        ap.error(f"--layers takes positive integers separated by commas, got {args.layers!r}")
    targets = args.targets.split(",") if args.targets else None
    import torch

    shape = SHAPE
    if args.cpu_smoke:
        shape = dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512, vocab_size=30200)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    elif not torch.cuda.is_available():
        print("decode_probe: no CUDA GPU here; run it on a GPU machine. Nothing measured.")
        return 0
    import vllm

    root = Path(tempfile.mkdtemp(prefix="bdlora-probe-"))
    atexit.register(shutil.rmtree, root, True)  # the probe's models and adapters: this run's scratch only
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out = {"vllm": vllm.__version__, "device": device, "args": vars(args), "modes": []}
    for layers in layer_counts:
        model, adapter = build(root, layers, args.rank, args.nblocks, shape, targets)
        for name in args.modes.split(","):
            fused, eager = modes[name]
            try:
                r = probe_mode(name, model, adapter, args.rank, fused, eager, args.batch, args.profile)
            except Exception as e:  # keep the other modes
                r = {"mode": name, "error": f"{type(e).__name__}: {e}"[:500]}
            r["layers"] = layers
            out["modes"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "profile"}), flush=True)
            if "profile" in r:
                print(r["profile"], flush=True)
            out["fit"] = fit_overheads([m for m in out["modes"] if "error" not in m], args.batch)
            Path(args.out).write_text(json.dumps(out, indent=1))
    if out.get("fit"):
        print("LoRA - base per decode step = per_step + per_layer x layers:", json.dumps(out["fit"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
