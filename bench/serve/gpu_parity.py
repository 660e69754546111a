"""GPU parity check of the BD-LoRA plugin (vLLM 0.26 on 2 GPUs, or any supported vLLM/TP):

    python -m bench.serve.gpu_parity --tp 2 --out parity.json

Builds the tiny random Llama (hidden 256, 4 heads, 2 KV heads) and PEFT-written adapters (BD N=2 r=8, BD N=2 r=16, BD
N=4 r=16, dense r=8, an lm_head-only r=8) in a temp dir, serves them all at once with vLLM + the plugin
(``additional_config {"bdlora": True}``) at the given TP degree, in eager mode and with CUDA graphs, and compares
every request of one mixed batch (base + all adapters), and two BD adapters' requests each alone (batch 1: decode
steps of one token), with HF + PEFT on CPU in float32 (teacher forced): greedy token equality and the max |logprob|
difference. Greedy tokens must be equal, except at a near-tie: a request whose first
differing token had HF's own margin (its choice over the engine's, in logprob) below the logprob tolerance still
passes, listed under ``near_tie_flips`` (with a float16 engine against a float32 reference such a tie can go either
way); its later tokens are still checked through the logprob bound, teacher forced on the engine's tokens. In eager
mode it also counts LoRA collectives in the workers (must be 0) and reports the per-rank adapter bytes. Prints a
summary and writes JSON; exit status 0 iff every check passed. A first batch of the BD adapters alone checks the
logits' lm_head LoRA term: skipped while no slot has lm_head factors, run on its first call and again once the lm_head
adapter is in a slot (``logits_lora``, ``logits_ok``).

The engine runs bdlora's kernels per token count (``--enable-bdlora``'s default: the GPU's tuning file; ``--tuning
JSON`` replaces its keys, e.g. small cut-offs so that the tiny model's batches take every path; ``--backend torch``
the kernels' torch fallback); each TP rank then also checks that they ran (path counters; in graph mode only the
capture and eager-size runs are counted) and a per-layer self-check (``diagnostics.fused_decode_self_check``: the
ops against vLLM's punica path on random inputs with CUDA-graph-style padding rows, the int32 token -> slot map, and
for folded layers the shared weight and the fold op against the base GEMM plus punica's result). ``--stock`` serves
with ``{"bdlora": {"kernels": false}}`` (vLLM's kernels at the BD rank) instead.
Use ``--tag`` to keep separate JSON files.

Needs the plugin's entry point to be visible (``pip install --no-deps -e .`` in the checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 55], [101, 202, 303, 404, 45, 46, 47]]


def build(root: Path) -> tuple[Path, dict]:
    from peft import LoraConfig

    from bdlora.models import build_random_llama
    from bdlora.spec import BDLoraSpec
    from bdlora.vllm_plugin.testing import make_peft_adapter

    model = build_random_llama(root / "tiny-llama", init_std=0.05)
    all7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    configs = {
        "bd2_r8": BDLoraSpec(nblocks=2, r=8, lora_alpha=16).to_peft_config(),
        "bd2_r16": BDLoraSpec(nblocks=2, r=16, lora_alpha=16).to_peft_config(),
        "bd4_r16": BDLoraSpec(nblocks=4, r=16, lora_alpha=16).to_peft_config(),
        "dense_r8": LoraConfig(r=8, lora_alpha=16, target_modules=all7),
        "lm_head_r8": LoraConfig(r=8, lora_alpha=16, target_modules=["lm_head"]),  # only the logits' LoRA term
    }
    adapters = {n: make_peft_adapter(model, root / n, c, seed=i + 1) for i, (n, c) in enumerate(configs.items())}
    return model, adapters


def run_mode(model, adapters, tp: int, eager: bool, dtype: str, max_tokens: int, kernels=None,
             tie_tol: float = 0.0, max_lora_rank: int = 16, bd_options=None) -> dict:
    from vllm.lora.request import LoRARequest

    from bdlora.vllm_plugin import diagnostics as D
    from bdlora.vllm_plugin import testing as T

    extra = {"bdlora": {**(bd_options or {}), "kernels": kernels if kernels is not None else False}}
    t0 = time.time()
    llm = T.start_llm(model, tensor_parallel_size=tp, enable_lora=True, max_lora_rank=max_lora_rank,
                      max_loras=len(adapters) + 1, additional_config=extra, enforce_eager=eager,
                      dtype=dtype, gpu_memory_utilization=0.3)
    startup = time.time() - t0
    try:
        ids = {n: i + 1 for i, n in enumerate(adapters)}
        names = [None] + list(adapters)
        jobs = [(PROMPTS[k % len(PROMPTS)], LoRARequest(n, ids[n], str(adapters[n])) if n else None)
                for k, n in enumerate(names + names)]
        # BD adapters alone first: the logits skip the zero lm_head term (BDLogitsProcessorWithLoRA), after the
        # first call ran it; the mixed batch below, with the lm_head adapter in a slot, runs it
        bd_jobs = [(p, lr) for p, lr in jobs if lr is None or lr.lora_name.startswith("bd")]
        logits_rows = T.parity_report(model, bd_jobs, T.generate_mixed(llm, bd_jobs, max_tokens=max_tokens),
                                      [adapters[lr.lora_name] if lr else None for _, lr in bd_jobs])
        logits_bd = llm.collective_rpc(D.read_logits_lora)[0]
        if eager:
            llm.collective_rpc(D.reset_collective_counters)
        if kernels is not None:
            llm.collective_rpc(D.reset_path_counts)
        outs = T.generate_mixed(llm, jobs, max_tokens=max_tokens)
        rows = T.parity_report(model, jobs, outs, [adapters[lr.lora_name] if lr else None for _, lr in jobs])
        logits_all = llm.collective_rpc(D.read_logits_lora)[0]
        rows += logits_rows
        # batch 1: two BD adapters' requests, each alone (decode steps of ONE token: the one-token paths)
        alone = [j for j in jobs if j[1] is not None and j[1].lora_name.startswith("bd")][:2]
        alone_rows = [row for job in alone for row in T.parity_report(
            model, [job], T.generate_mixed(llm, [job], max_tokens=max_tokens), [adapters[job[1].lora_name]])]
        result = {"eager": eager, "startup_s": round(startup, 1), "requests": rows, "requests_alone": alone_rows,
                  "logits_lora": {"bd_only": logits_bd, "with_lm_head": logits_all}}
        result["logits_ok"] = (logits_bd.get("class") == "BDLogitsProcessorWithLoRA" and logits_bd["ran"] >= 1
                               and logits_bd["skipped"] > 0 and logits_all["ran"] > logits_bd["ran"])
        classes = llm.collective_rpc(D.lora_layer_classes)[0]
        result["layer_classes"] = sorted(set(classes.values()))
        if eager:
            counts = llm.collective_rpc(D.read_collective_counters)
            result["collectives_per_rank"] = counts
            result["lora_collectives"] = D.lora_collectives(counts)
            result["memory_bd2_r16"] = [{k: v for k, v in m.items() if k != "shapes"}
                                        for m in llm.collective_rpc(D.lora_memory, args=(ids["bd2_r16"],))]
        counters = llm.collective_rpc(D.read_path_counts) if kernels is not None else []  # before the self-check's
        checks = llm.collective_rpc(D.fused_decode_self_check) if kernels is not None else []
        if any(c["layers"] for c in checks):  # the device's tuning (or --tuning) sends some size to bdlora's kernels
            result["fused_counters"] = counters
            result["fused_self_check"] = checks
            tol = 1e-4 if dtype == "float32" else 3e-2  # relative to the largest LoRA term
            ran = ("folded", "fold_gemm", "fold_gemv", "fused")
            result["fused_ok"] = (
                (not eager or all(any(k.startswith(ran) for k in c) for c in result["fused_counters"]))
                and all(c["layers"] > 0 and c["slots_ok"] and c["padding_untouched"]
                        and c["max_abs_diff"] <= tol * max(1.0, c["max_abs_lora"]) for c in checks)
                and all(c["fold_layers"] == 0 or (c["fold_shares_weight"]
                        and c["fold_max_abs_diff"] <= tol * max(1.0, c["fold_max_abs_out"])) for c in checks))
            # after the self-check's crafted mapping the engine must still serve correctly
            again = T.parity_report(model, jobs[:3], T.generate_mixed(llm, jobs[:3], max_tokens=max_tokens),
                                    [adapters[lr.lora_name] if lr else None for _, lr in jobs[:3]])
            result["requests_after_self_check"] = again
        every = rows + alone_rows + result.get("requests_after_self_check", [])
        result["tokens_equal"] = all(r["tokens_equal"] for r in every)
        result["max_logprob_diff"] = max(r["max_logprob_diff"] for r in every)
        result["near_tie_flips"] = [{k: r[k] for k in ("adapter", "hf_gap_at_flip", "max_logprob_diff")}
                                    for r in every if not r["tokens_equal"] and T.tokens_match(r, tie_tol)]
        result["tokens_ok"] = all(T.tokens_match(r, tie_tol) for r in every) and result["logits_ok"]
        return result
    finally:
        T.stop_llm(llm)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", default="bdlora_gpu_parity.json")
    p.add_argument("--dtype", default="auto",
                   help="vLLM dtype (HF reference is always float32 on CPU); auto: float16 on a GPU (vLLM's GPU LoRA "
                        "kernels take only float16/bfloat16; bfloat16's 8-bit mantissa flips greedy tokens of the "
                        "tiny random model), float32 on CPU")
    p.add_argument("--modes", default="eager,graph", help="comma list of eager,graph")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--tol", type=float, help="max |logprob diff| to pass (default 1e-4 in float32, else 1e-2)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--stock", action="store_true",
                   help="serve with {'bdlora': {'kernels': false}}: vLLM's punica kernels at the BD rank")
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"), help="bdlora's kernels' backend")
    p.add_argument("--tuning", default=None,
                   help="JSON of ServingTuning keys replacing the device's tuning file's, e.g. small cut-offs so that "
                        "the tiny model's batches take every path")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--bd-options", default=None, type=json.loads,
                   help="JSON of additional_config['bdlora'] settings, e.g. '{\"max_rank\": 40}' with --max-lora-rank "
                        "64: buffers of rank 48 (no power of 2) for the adapters of rank 8 and 16")
    args = p.parse_args(argv)
    import torch

    on_gpu = torch.cuda.is_available()
    if args.dtype == "auto":
        args.dtype = "float16" if on_gpu else "float32"
    if args.tol is None:
        args.tol = 1e-4 if args.dtype == "float32" else 1e-2
    if args.stock and args.tuning:
        p.error("--stock and --tuning exclude each other")
    kernels = None if args.stock else {"backend": args.backend, "tuning": json.loads(args.tuning or "{}")}
    # Probes are sent to the workers as callables; counters are installed by register() in every worker.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("BDLORA_COUNT_COLLECTIVES", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    if on_gpu:
        # TP > 1 starts worker processes: spawn them, forked ones cannot use CUDA once this process touched it
        # (seen on an H200 with vLLM 0.26 and torch 2.11: "Cannot re-initialize CUDA in forked subprocess")
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    import vllm

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bdlora-gpu-parity-"))
    model, adapters = build(root)
    report = {"vllm": vllm.__version__, "tp": args.tp, "dtype": args.dtype, "workdir": str(root), "modes": [],
              "max_lora_rank": args.max_lora_rank, "bd_options": args.bd_options,
              "kernels": kernels}
    ok = True
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        try:
            res = run_mode(model, adapters, args.tp, mode == "eager", args.dtype, args.max_tokens, kernels, args.tol,
                           args.max_lora_rank, args.bd_options)
        except Exception as e:  # keep the other mode's result; the report says what broke
            res = {"eager": mode == "eager", "error": f"{type(e).__name__}: {e}"[:2000], "pass": False}
            print(f"[{mode}] ERROR {res['error'][:500]} -> FAIL", flush=True)
        else:
            res["pass"] = (res["tokens_ok"] and res["max_logprob_diff"] < args.tol
                           and res.get("lora_collectives", 0) == 0 and res.get("fused_ok", True))
            print(f"[{mode}] tokens_equal={res['tokens_equal']} near_tie_flips={res['near_tie_flips']} "
                  f"max_logprob_diff={res['max_logprob_diff']:.3e} "
                  f"lora_collectives={res.get('lora_collectives', 'n/a')} startup={res['startup_s']}s "
                  f"classes={res['layer_classes']}"
                  + (f" fused_ok={res['fused_ok']} fused_counters={res['fused_counters']}" if "fused_ok" in res else "")
                  + f" -> {'PASS' if res['pass'] else 'FAIL'}", flush=True)
        ok &= res["pass"]
        report["modes"].append(res)
        with open(args.out, "w") as f:  # after every mode: a later crash keeps what was measured
            json.dump(report, f, indent=2)
    report["pass"] = ok
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
