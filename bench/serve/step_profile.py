#!/usr/bin/env python3
"""Is a served decode step (or a prefill) GPU-bound or host-bound? One in-process engine of ``auto_proxy.py``'s shard
shapes generates under torch.profiler (CUPTI traces the kernels inside CUDA-graph replays); from the trace: the
wall span of the kernels, the union of GPU kernel intervals (busy), the GPU's idle time between them, and the host
side: the CPU ops by total time (count, total and per call: e.g. ``bdlora::fold_linear``, the plugin's op, against
``aten::mm``) and the kernel launches' CUDA runtime calls. busy ~ wall: GPU-bound (the kernels decide the time);
busy << wall: the host (scheduler, input preparation, LoRA metadata, op dispatch and kernel launches) does.
``busy_per_step_ms`` is the generate's busy over its steps, the prompts' prefill included (1/steps of it: at batch 64
with 128-token prompts, an 8192-token prefill); ``decode_busy_per_step_ms`` takes a profiled prefill-only generate
(max_tokens 1) off first, so it is the decode steps' own.

    PYTHONPATH=/tmp/site python3 bench/serve/step_profile.py --shape tp8 --only bd --out prof.json
    PYTHONPATH=/tmp/site python3 bench/serve/step_profile.py --shape tp4 --only bd --prompt-len 1024 --steps 1 \
        --out prefill.json     # the TTFT case: one prefill of 1024 tokens (no CUDA graph above the capture sizes)
"""
import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def busy_ms(trace: dict) -> tuple[float, float, int, dict]:
    """(GPU busy ms = union of kernel intervals, span ms from the first kernel's start to the last one's end, kernel
    count, the 15 kernels of most total time in ms) of a chrome trace of torch.profiler."""
    ks = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace["traceEvents"]
                if e.get("cat") == "kernel" and "dur" in e)
    if not ks:
        return 0.0, 0.0, 0, {}
    busy, cur_s, cur_e = 0.0, ks[0][0], ks[0][1]
    for s, e, _ in ks[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    by = {}
    for s, e, n in ks:
        k = n[:60]
        by[k] = by.get(k, 0.0) + (e - s)
    top = dict(sorted(by.items(), key=lambda kv: -kv[1])[:15])
    return busy / 1000, (ks[-1][1] - ks[0][0]) / 1000, len(ks), {k: round(v / 1000, 3) for k, v in top.items()}


#: CPU ops that wait for the GPU (``.item()``, ``.tolist()``, ``.cpu()`` of a device tensor end in them)
HOST_SYNCS = ("aten::_local_scalar_dense", "aten::item")


def host_ops(trace: dict, most: int = 20) -> dict:
    """The host side of a chrome trace of torch.profiler: per CPU op name (``cpu_op`` events; nested ops count in
    their own row and in their caller's), ``[count, total ms, us per call]`` for the ``most`` of most total time,
    plus every ``bdlora::`` op and the host syncs (``HOST_SYNCS``); and ``launch``: the CUDA runtime / driver calls
    that launch kernels (count, total ms)."""
    by: dict = {}
    launches, launch_us = 0, 0.0
    for e in trace["traceEvents"]:
        if "dur" not in e:
            continue
        if e.get("cat") == "cpu_op":
            c = by.setdefault(e["name"], [0, 0.0])
            c[0] += 1
            c[1] += e["dur"]
        elif e.get("cat") == "cuda_runtime" and "LaunchKernel" in e.get("name", ""):
            launches += 1
            launch_us += e["dur"]
    ranked = sorted(by.items(), key=lambda kv: -kv[1][1])
    keep = dict(ranked[:most])
    keep.update((k, v) for k, v in ranked if k.startswith("bdlora::") or k in HOST_SYNCS)
    ops = {k: [n, round(us / 1000, 3), round(us / n, 1)] for k, (n, us) in keep.items()}
    return {"ops": ops, "launch": {"count": launches, "total_ms": round(launch_us / 1000, 3)}}


def python_profile(fn, most: int | None = 25, roots=("vllm", "bdlora", "vllm_plugin")) -> list:
    """cProfile of one call of ``fn``: the ``most`` (None: all) Python functions of vLLM and bdlora by cumulative
    time, as ``[file:line(function), calls, cumulative ms, own ms]`` (where the host time goes, e.g. LoRA metadata per
    step; cProfile's own overhead inflates them, the ranking holds)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    rows = []
    for (file, line, func), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        parts = Path(file).parts
        if any(r in parts for r in roots):
            rel = "/".join(parts[max(i for i, p in enumerate(parts) if p in roots):])
            rows.append([f"{rel}:{line}({func})", calls, round(1000 * cum, 3), round(1000 * own, 3)])
    return sorted(rows, key=lambda r: -r[2])[:most]


def ab_pairs(generate, rounds: int, switch) -> dict:
    """``rounds`` pairs of ``generate()`` calls in this process, ``switch(True)`` before the first of each pair and
    ``switch(False)`` before the second (then back on): ms of each, their minima, and the median over rounds of
    on / off - 1 (engine processes differ more than a host-side change: pair it in one engine)."""
    on, off = [], []
    try:
        for _ in range(rounds):
            for enabled, out in ((True, on), (False, off)):
                switch(enabled)
                t0 = time.perf_counter()
                generate()
                out.append(round(1000 * (time.perf_counter() - t0), 2))
    finally:
        switch(True)
    ratios = sorted(x / y - 1 for x, y in zip(on, off))
    return {"on_ms": on, "off_ms": off, "on_min": min(on), "off_min": min(off),
            "paired_change": round(ratios[len(ratios) // 2], 4)}


def set_direct(enabled: bool) -> None:
    """bdlora's direct launches of kept kernels (bdlora/kernels/launch.py) on, or off: Triton's launcher."""
    from bdlora.kernels.launch import LAUNCHES

    LAUNCHES.enabled = enabled


def profiled_trace(fn) -> dict:
    """The chrome trace (CPU ops and CUDA kernels) of torch.profiler around one call of ``fn``."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
    with tempfile.TemporaryDirectory(prefix="bdlora-trace-") as d:  # a trace can take hundreds of MB
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def main():
    import auto_proxy as P

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tp8")
    ap.add_argument("--only", default="bd", help=" | ".join(P.ENGINES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64, help="output tokens per request (1: the prefill alone)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=1, help="LoRA engines: --max-loras and distinct adapters; "
                    "request i uses adapter i mod N (as auto_proxy.py --adapters)")
    ap.add_argument("--tuning", default=None, help="bd: a JSON dict of bdlora.vllm_plugin.fast_path.tuning keys replacing the "
                    "device's tuning file's (as auto_proxy.py --tuning)")
    ap.add_argument("--bd-options", default=None, type=json.loads,
                    help="bd: a JSON dict of additional_config['bdlora'] settings "
                         "(e.g. '{\"max_rank\": 38}', as auto_proxy.py --bd-options)")
    ap.add_argument("--out", default="prof.json")
    ap.add_argument("--ab-direct", type=int, default=0, metavar="ROUNDS",
                    help="with --time-only: ROUNDS pairs of generates in this one engine, bdlora's direct launches "
                    "(bdlora/kernels/launch.py) on then off, paired per round (engine processes differ more than "
                    "that change)")
    ap.add_argument("--time-only", action="store_true", help="only the unprofiled generate times (no cProfile, no "
                    "torch profiler): A/B runs of the host time")
    a = ap.parse_args()
    if a.ab_direct and not a.time_only:
        ap.error("--ab-direct pairs unprofiled generates: add --time-only")
    from vllm import LLM, SamplingParams

    sh = P.SHARDS[a.shape]
    root = Path(tempfile.mkdtemp(prefix="bdlora-step-profile-"))
    atexit.register(shutil.rmtree, root, True)  # the proxy model and its adapters: this run's scratch only
    model = P.write_model(root, sh)
    try:
        kw, lora = P.engine_setup(a.only, sh, root, adapters=a.adapters,
                                  tuning=json.loads(a.tuning) if a.tuning else None,
                                  bd_options=a.bd_options)
    except ValueError as e:
        ap.error(str(e))
    lora = P.per_request(lora, a.batch)
    llm = LLM(str(model), **kw)
    prompts = P._prompts(a.batch, a.prompt_len, vocab=P.dims(sh)[3])
    sp = SamplingParams(max_tokens=a.steps, ignore_eos=True, temperature=0.0, detokenize=False)
    llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
    plain = []
    for _ in range(5):
        t0 = time.perf_counter()
        llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
        plain.append(time.perf_counter() - t0)
    res = {"device": P.device_name(), "shape": a.shape, "engine": a.only, "batch": a.batch, "adapters": a.adapters,
           "prompt_len": a.prompt_len, "steps": a.steps, "bd_options": a.bd_options,
           "generate_ms_unprofiled": round(1000 * min(plain), 2),
           "generate_ms_unprofiled_runs": [round(1000 * v, 2) for v in plain]}
    if "bdlora.kernels.launch" in sys.modules:  # bdlora's Triton launches: direct (kept kernels) or through Triton
        from bdlora.kernels.launch import LAUNCHES

        res["launches"] = {"enabled": LAUNCHES.enabled, "direct": LAUNCHES.direct, "triton": LAUNCHES.triton}
    generate = lambda: llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)  # noqa: E731
    if a.ab_direct:
        res["ab_direct"] = ab_pairs(generate, a.ab_direct, set_direct)
    if a.time_only:
        print(json.dumps(res, indent=1), flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
        return
    python_all = python_profile(generate, most=None)
    python_top = python_all[:25]
    # vLLM's LoRA machinery and the plugin (vllm_plugin/..., whose paths need not say "lora")
    python_lora = [row for row in python_all if "lora" in row[0] or row[0].startswith("vllm_plugin/")][:60]
    trace = profiled_trace(generate)
    busy, span, n, top = busy_ms(trace)
    res.update({"kernel_span_ms": round(span, 2), "gpu_busy_ms": round(busy, 2), "gpu_idle_ms": round(span - busy, 2),
                "kernels": n, "busy_per_step_ms": round(busy / a.steps, 4),
                "span_per_step_ms": round(span / a.steps, 4), "top_kernels_ms": top, "host": host_ops(trace),
                "python_top": python_top, "python_lora": python_lora})
    if a.steps > 1:  # the decode steps alone: busy_per_step_ms also carries 1/steps of the prompts' prefill
        first = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0, detokenize=False)
        prefill, _, _, prefill_top = busy_ms(profiled_trace(
            lambda: llm.generate(prompts, first, lora_request=lora, use_tqdm=False)))
        res.update({"prefill_busy_ms": round(prefill, 3), "prefill_top_kernels_ms": prefill_top,
                    "decode_busy_per_step_ms": round((busy - prefill) / (a.steps - 1), 4)})
    print(json.dumps(res, indent=1), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
