#!/usr/bin/env python3
"""Per-GPU serving cost of expert adapters on a MoE model under tensor parallelism, measured on ONE GPU: one GPU's
shard of a Qwen3-30B-A3B-shaped model at TP=N served at TP=1 by vLLM in-process (bf16, CUDA graphs, random
weights via ``--load-format dummy``, no tokenizer): hidden 2048, 48 layers, 128 experts with 8 per token, expert
intermediate 768/N, 32/N query heads and max(4/N, 1) KV heads of 128, vocabulary 151936/N (vLLM shards the
embedding and the LM head by vocabulary).

    PYTHONPATH=/tmp/site python3 -m bench.serve.moe_proxy --tp 4 --only lora --out lora.json
    python3 -m bench.serve.moe_proxy --shape tiny --prepare-only --out x.json     # CPU: the model and adapter only
    python3 -m bench.serve.moe_proxy report OUT/*.json --out table.md              # the table of such runs
    bash bench/serve/moe_proxy_run.sh tp4:lora tp4:bd ...                          # one engine per GPU at once

Engines (each in its own process, ``--only``), all adapters on q/k/v/o and both fused expert tensors:

  base   no LoRA
  lora   vLLM's own MoE LoRA at rank r (default 64): the per-GPU factors of vLLM's default LoRA at TP=N, whose
         replicated halves (gate_up's and q/k/v's A, down's and o's B) keep the whole rank on every GPU
  bd     the same layers at rank r/N, the per-GPU factors of a BD-LoRA adapter of rank r at TP=N (each GPU runs an
         independent rank r/N adapter of its own shard), served by the plugin (``--enable-bdlora``: its BD MoE LoRA
         layers; a one-GPU share is the N = 1 case)
  share  the rank r/N adapter through vLLM's own MoE LoRA (the kernels the plugin's layers run, without the plugin)

The tensor-parallel all-reduce after attention and experts is the base model's and the same for all three, so it
is left out. ``--fully-sharded-loras`` adds LoRA collectives that one GPU cannot show; its per-GPU adapter bytes are
in the JSON beside the others (``adapter_bytes_per_gpu``: computed from the factors' shapes at TP=N).

``--whole-model`` serves the whole model at TP=N on N GPUs instead (collectives included): ``lora`` the dense rank-r
adapter through vLLM's MoE LoRA, ``fully`` the same with ``--fully-sharded-loras``, ``bd`` a BD-LoRA adapter of rank
r with N blocks through ``--enable-bdlora``. Every LoRA engine also records the adapter's measured bytes per GPU (its
slot in the LoRA buffers, ``lora_memory``).
Per batch size (``--batches``): decode ms/step and steady step ms (``auto_proxy.decode_ms`` / ``step_ms``) with
prompts of 128 tokens, and TTFT of 1024-token prompts. Per-expert models need vLLM's mixed MoE LoRA format
(``enable_mixed_moe_lora_format``, ``is_3d_lora_weight``), set where the vLLM version has them.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(lora_memory) to TP workers

FULL = {"H": 2048, "L": 48, "E": 128, "topk": 8, "I": 768, "NH": 32, "NKV": 4, "HD": 128, "V": 151936}
TINY = {"H": 64, "L": 2, "E": 4, "topk": 2, "I": 32, "NH": 4, "NKV": 2, "HD": 16, "V": 1024}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def shard(full: dict, tp: int) -> dict:
    """One GPU's share of ``full`` at tensor-parallel size ``tp``."""
    return dict(full, I=full["I"] // tp, NH=full["NH"] // tp, NKV=max(full["NKV"] // tp, 1), V=full["V"] // tp)


def write_model(root: Path, sh: dict, name: str = "qwen3moe-shard") -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": sh["H"],
        "num_hidden_layers": sh["L"], "num_attention_heads": sh["NH"], "num_key_value_heads": sh["NKV"],
        "head_dim": sh["HD"], "intermediate_size": 6 * sh["I"], "moe_intermediate_size": sh["I"],
        "num_experts": sh["E"], "num_experts_per_tok": sh["topk"], "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "vocab_size": sh["V"], "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2}))
    return d


def factor_shapes(sh: dict, r: int) -> dict[str, tuple[tuple, tuple]]:
    """{PEFT module suffix: (lora_A shape, lora_B shape)} of one layer's dense rank-r adapter in PEFT's format: the
    attention projections', and the fused experts' flattened as PEFT stores them (``bdlora.moe.to_peft_layout``)."""
    h, e, i, q, kv = sh["H"], sh["E"], sh["I"], sh["NH"] * sh["HD"], sh["NKV"] * sh["HD"]
    from bdlora.moe import PEFT_TARGET_PARAMETERS, expert_key_prefixes

    pre = expert_key_prefixes(PEFT_TARGET_PARAMETERS)
    return {"self_attn.q_proj": ((r, h), (q, r)), "self_attn.k_proj": ((r, h), (kv, r)),
            "self_attn.v_proj": ((r, h), (kv, r)), "self_attn.o_proj": ((r, q), (h, r)),
            pre["gate_up_proj"]: ((e * r, h), (2 * i, e * r)), pre["down_proj"]: ((e * r, i), (h, e * r))}


def write_adapter(root: Path, name: str, r: int, sh: dict, seed: int = 0) -> Path:
    """A dense PEFT LoRA of rank r on attention and both expert tensors (random bf16 factors)."""
    import torch
    from safetensors.torch import save_file

    from bdlora.moe import PEFT_TARGET_PARAMETERS

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(sh["L"]):
        for suffix, (a, b) in factor_shapes(sh, r).items():
            key = f"base_model.model.model.layers.{layer}.{suffix}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(a, generator=g) * 0.01).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(b, generator=g) * 0.01).to(torch.bfloat16)
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(ATTENTION),
        "target_parameters": list(PEFT_TARGET_PARAMETERS), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
        "task_type": "CAUSAL_LM", "base_model_name_or_path": None}))
    return d


def write_bd_adapter(root: Path, name: str, r: int, sh: dict, nblocks: int, seed: int = 0) -> Path:
    """A BD-LoRA adapter (``nblocks`` blocks, rank r) on attention and both fused expert tensors of a model of shape
    ``sh``, as ``bdlora train`` writes one (random bf16 factors)."""
    import torch

    from bdlora.adapter import Adapter, AdapterConfig, add_experts, save_adapter
    from bdlora.layout import LoraFactors, packed_shapes
    from bdlora.moe import ExpertFactors
    from bdlora.moe import factor_shapes as expert_factor_shapes
    from bdlora.spec import BDLoraSpec

    h, e, i, q, kv = sh["H"], sh["E"], sh["I"], sh["NH"] * sh["HD"], sh["NKV"] * sh["HD"]
    spec = BDLoraSpec.from_preset("qwen3_moe", nblocks=nblocks, r=r, lora_alpha=2 * r)
    g = torch.Generator().manual_seed(seed)

    def rand(shape):
        return (torch.randn(shape, generator=g) * 0.01).to(torch.bfloat16)

    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    modules, experts = {}, {}
    for layer in range(sh["L"]):
        for proj, (d_in, d_out) in dims.items():
            layout = "column" if proj in spec.column_modules else "row"
            a, b = packed_shapes(layout, d_in, d_out, r, nblocks)
            modules[f"base_model.model.model.layers.{layer}.self_attn.{proj}"] = LoraFactors(
                rand(a), rand(b), layout, nblocks, spec.scale)
        for t, weight in (("gate_up_proj", (e, 2 * i, h)), ("down_proj", (e, h, i))):
            a, b = expert_factor_shapes(t, weight, nblocks, r)
            experts[f"base_model.model.model.layers.{layer}.mlp.experts.{t}"] = ExpertFactors(
                t, rand(a), rand(b), nblocks, spec.scale)
    return save_adapter(add_experts(Adapter(AdapterConfig.from_spec(spec), modules), experts), root / name)


def adapter_bytes_per_gpu(full: dict, tp: int, r: int) -> dict[str, int]:
    """bf16 bytes of one rank-r adapter's factors held by each GPU at TP=``tp``: vLLM's default LoRA (one factor of
    each pair replicated), ``--fully-sharded-loras`` (both sharded; collectives added) and BD-LoRA (r/N per GPU)."""
    sh, n = shard(full, tp), tp
    h, e, i, q, kv = sh["H"], sh["E"], sh["I"], sh["NH"] * sh["HD"], sh["NKV"] * sh["HD"]

    def layer(col_a: int, col_b: int, row_a: int, row_b: int, row_out: int) -> int:  # per-GPU elements, one layer
        col = (col_a * h + q * col_b) + 2 * (col_a * h + kv * col_b) + e * (col_a * h + 2 * i * col_b)  # q,k,v,gate_up
        row = (row_a * q + row_out * row_b) + e * (row_a * i + row_out * row_b)  # o, down
        return col + row

    default = layer(r, r, r, r, h)
    fully = layer(r // n, r, r, r, h // n) if n > 1 else default
    bd = layer(r // n, r // n, r // n, r // n, h)
    return {k: 2 * full["L"] * v for k, v in (("vllm_default", default), ("fully_sharded", fully), ("bd", bd))}


def write_engine_adapter(only: str, sh: dict, root: Path, r: int, tp: int, whole: bool) -> tuple[Path, int]:
    """(adapter folder, its rank) of engine ``only``: on a one-GPU shard the per-GPU factors (rank r, or r/N for
    ``bd`` and ``share``); on the whole model the dense rank-r adapter, or for ``bd`` a BD-LoRA adapter of N blocks."""
    if whole and only == "bd":
        return write_bd_adapter(root, f"bd_r{r}_n{tp}", r, sh, tp), r
    rank = r if only in ("lora", "fully") or whole else r // tp
    return write_adapter(root, f"dense_r{rank}", rank, sh), rank


def engine_kwargs(only: str, sh: dict, root: Path, r: int, tp: int, mem: float, whole: bool = False
                  ) -> tuple[dict, object]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.request import LoRARequest

    from bench.serve.auto_proxy import BATCHED_TOKENS, MAX_MODEL_LEN

    kw = dict(load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=64, max_num_batched_tokens=BATCHED_TOKENS, gpu_memory_utilization=mem,
              enable_prefix_caching=False)
    if whole:
        kw["tensor_parallel_size"] = tp
    if only == "base":
        return kw, None
    folder, rank = write_engine_adapter(only, sh, root, r, tp, whole)
    kw.update(enable_lora=True, max_lora_rank=rank, max_loras=1)
    extra = {}
    if only == "bd":  # the plugin hands its MoE LoRA layers per-expert factors itself
        kw["additional_config"] = {"bdlora": True}
    else:  # vLLM's own MoE LoRA reads PEFT's 3-D expert factors on per-expert models in its mixed format
        if "enable_mixed_moe_lora_format" in inspect.signature(EngineArgs).parameters:
            kw["enable_mixed_moe_lora_format"] = True
        if "is_3d_lora_weight" in inspect.signature(LoRARequest).parameters:
            extra["is_3d_lora_weight"] = True
        if only == "fully":
            kw["fully_sharded_loras"] = True
    return kw, LoRARequest(f"{only}_r{rank}", 1, str(folder), **extra)


ENGINE_LABELS = {"base": "no LoRA", "lora": "vLLM's LoRA (rank r)", "share": "vLLM's LoRA at rank r/N",
                 "fully": "`--fully-sharded-loras` (rank r)", "bd": "BD-LoRA, `--enable-bdlora` (rank r/N)"}


def report(results: list[dict]) -> str:
    """A markdown table of ``--only`` runs' JSON: per TP size and batch, each engine's steady decode step (median
    ms) and 1024-token TTFT, BD's decode against vLLM's LoRA, and each engine's adapter bytes per GPU."""
    lines = []
    for tp, whole in sorted({(r["tp"], bool(r.get("whole_model"))) for r in results}):
        runs = {r["engine"]: r for r in results if r["tp"] == tp and bool(r.get("whole_model")) == whole}
        engines = [e for e in ENGINE_LABELS if e in runs]
        head = runs[engines[0]]
        compared = {"bd", "lora"} <= set(runs)  # a column of BD's decode step against vLLM's LoRA
        served = (f"the whole model on {tp} GPUs" if whole else
                  f"one GPU's shard: {head['shard']['E']} experts {head['shard']['I']} wide, "
                  f"{head['shard']['NH']} query heads")
        lines += [f"TP={tp} ({served}), rank r={head['r']}, {head.get('device', '?')}, "
                  f"vLLM {head.get('vllm', '?')}, {head['date']}; decode step median ms / TTFT ms (1024 tokens):", "",
                  "| batch | " + " | ".join(ENGINE_LABELS[e] for e in engines)
                  + (" | BD / vLLM's LoRA, decode |" if compared else " |"),
                  "|---" * (len(engines) + 1 + compared) + "|"]
        batches = sorted({row["batch"] for e in engines for row in runs[e].get("rows", [])})
        for b in batches:
            cells, step = [], {}
            for e in engines:
                row = next((x for x in runs[e].get("rows", []) if x["batch"] == b), None)
                if row is None:
                    cells.append("not run")
                    continue
                step[e] = (row.get("step_ms") or {}).get("median") or row["decode_ms"]
                cells.append(f"{step[e]:.2f} / {row['ttft_ms']:.1f}")
            ratio = ([f"{step['bd'] / step['lora']:.3f}" if {"bd", "lora"} <= set(step) else "n/a"]
                     if compared else [])
            lines.append(f"| {b} | " + " | ".join(cells + ratio) + " |")
        per_gpu = head["adapter_bytes_per_gpu"]
        lines += ["", "Adapter bytes per GPU (computed): vLLM's default "
                  f"{per_gpu['vllm_default'] / 2**20:,.0f} MiB, `--fully-sharded-loras` "
                  f"{per_gpu['fully_sharded'] / 2**20:,.0f} MiB, BD-LoRA {per_gpu['bd'] / 2**20:,.0f} MiB."]
        measured = [f"{ENGINE_LABELS[e]} {max(runs[e]['slot_bytes_per_gpu']) / 2**20:,.0f} MiB" for e in engines
                    if runs[e].get("slot_bytes_per_gpu")]
        if measured:
            lines.append("Measured (the adapter's slot in the LoRA buffers, largest GPU): " + ", ".join(measured) + ".")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["report"]:
        rp = argparse.ArgumentParser(prog="moe_proxy report", description="the table of --only runs' JSON files")
        rp.add_argument("files", nargs="+")
        rp.add_argument("--out", default=None, help="also write the table here (markdown)")
        ra = rp.parse_args(argv[1:])
        results = []
        for f in ra.files:
            try:
                results.append(json.loads(Path(f).read_text()))
            except (OSError, json.JSONDecodeError) as e:
                rp.error(f"{f}: not a moe_proxy result ({e})")
        table = report(results)
        print(table)
        if ra.out:
            Path(ra.out).write_text(table + "\n")
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=4, help="the tensor-parallel size whose one-GPU shard is served")
    ap.add_argument("--whole-model", action="store_true",
                    help="serve the whole model at TP=--tp on that many GPUs (collectives included)")
    ap.add_argument("--shape", choices=["qwen3-30b-a3b", "tiny"], default="qwen3-30b-a3b")
    ap.add_argument("--only", choices=["base", "lora", "bd", "share", "fully"], default="base",
                    help="share: one GPU's shard only; fully (--fully-sharded-loras): --whole-model only")
    ap.add_argument("--r", type=int, default=64, help="the adapter's total rank (bd serves r / tp)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--mem", type=float, default=0.45, help="gpu_memory_utilization")
    ap.add_argument("--root", default="/tmp/bdlora-moe-proxy")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prepare-only", action="store_true", help="write the model folder and adapter, then stop")
    a = ap.parse_args(argv)
    full = FULL if a.shape != "tiny" else TINY
    if a.r % a.tp or full["I"] % a.tp or full["NH"] % a.tp:
        ap.error(f"--r {a.r}, the expert intermediate {full['I']} and the {full['NH']} heads must divide by --tp {a.tp}")
    if a.only == "share" and a.whole_model:
        ap.error("--only share is the rank r/N factors on one GPU's shard; on the whole model compare --only fully")
    if a.only == "fully" and not a.whole_model:
        ap.error("--only fully (--fully-sharded-loras) adds collectives one GPU's shard cannot show: add --whole-model")
    sh = full if a.whole_model else shard(full, a.tp)
    root = Path(a.root)
    model = write_model(root, sh, "qwen3moe-whole" if a.whole_model else "qwen3moe-shard")
    res = {"shape": a.shape, "tp": a.tp, "whole_model": a.whole_model, "shard": shard(full, a.tp), "r": a.r,
           "engine": a.only, "date": time.strftime("%Y-%m-%d"),
           "adapter_bytes_per_gpu": adapter_bytes_per_gpu(full, a.tp, a.r)}
    if a.prepare_only:
        res["adapter"] = (str(write_engine_adapter(a.only, sh, root, a.r, a.tp, a.whole_model)[0])
                          if a.only != "base" else None)
        Path(a.out).write_text(json.dumps(res, indent=1))
        return 0
    import vllm
    from vllm import LLM

    from bench.serve.auto_proxy import decode_ms, device_name, step_ms, ttft_ms

    kw, lora = engine_kwargs(a.only, sh, root, a.r, a.tp, a.mem, a.whole_model)
    t0 = time.perf_counter()
    llm = LLM(str(model), **kw)
    res.update(vllm=vllm.__version__, device=device_name(), startup_s=round(time.perf_counter() - t0, 1), rows=[])
    for b in [int(x) for x in a.batches.split(",")]:
        st = step_ms(llm, lora, b, vocab=sh["V"])
        row = {"batch": b, "decode_ms": decode_ms(llm, lora, b, vocab=sh["V"]),
               "step_ms": {k: st[k] for k in ("median", "p10", "p90", "steps")} if st else None,
               "ttft_ms": ttft_ms(llm, lora, b, 1024, vocab=sh["V"])}
        res["rows"].append(row)
        Path(a.out).write_text(json.dumps(res, indent=1))
        print(a.only, json.dumps(row), flush=True)
    if lora is not None:  # the adapter is in its slot after the requests above
        from bdlora.vllm_plugin.diagnostics import lora_memory

        try:
            res["slot_bytes_per_gpu"] = [m["slot"] for m in llm.collective_rpc(lora_memory, args=(1,))]
        except Exception as e:  # the timings above stand without it
            res["slot_bytes_error"] = repr(e)
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
