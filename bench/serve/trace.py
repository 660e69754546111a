"""Where a served decode step's time goes: a torch-profiler trace of one request on a running vLLM server, reduced to
GPU time per decode step by kernel category.

A sweep config with ``profile: {it: 128, ot: 64}`` starts its servers with vLLM's own profiler
(``--profiler-config``: torch profiler, traces under ``OUT/<server_id>/trace``) and, after the server's loads,
sends one request of IT prompt / OT output tokens between ``POST /start_profile`` and ``POST /stop_profile``.
``summarize_trace`` then reads the rank-0 worker trace and writes ``OUT/<server_id>/trace_summary.json``:

    steps            decode steps found (vLLM annotates each engine step ``execute_context_C(..)_generation_G(..)``;
                     a decode step has C = 0)
    per_step_us      GPU kernel time per decode step by category (gemm, lora, allreduce, attention, other)
    busy_us          union of kernel intervals per step (overlapping streams counted once)
    period_us        start-to-start time of consecutive decode steps on the GPU; period - busy = GPU idle
    top_kernels      the kernels with the most time per step (name, calls per step, us per step)

Reading it: a LoRA server whose ``lora`` time per step is close to its TPOT gap to the base server pays for its
kernels; one whose ``period - busy`` grows pays on the host.
"""
from __future__ import annotations

import bisect
import gzip
import json
import re
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Iterable

#: Kernel name patterns of each category, checked in this order (first match wins).
CATEGORIES = (
    ("lora", re.compile(r"lora|_decode_\w*kernel|bgmv|sgmv|punica", re.I)),
    ("allreduce", re.compile(r"allreduce|all_reduce|cross_device_reduce|nccl|one_shot|two_shot", re.I)),
    ("attention", re.compile(r"flash|attn|attention|fmha|reshape_and_cache", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|cublas|sm90_xmma|ampere_|splitKreduce|matmul", re.I)),
)
STEP_RE = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")


def kernel_category(name: str) -> str:
    for cat, pat in CATEGORIES:
        if pat.search(name):
            return cat
    return "other"


def profiler_args(trace_dir: Path) -> list[str]:
    """The ``vllm serve`` arguments that enable its torch profiler, traces written to ``trace_dir``."""
    cfg = {"profiler": "torch", "torch_profiler_dir": str(Path(trace_dir).resolve()),
           "torch_profiler_with_stack": False, "ignore_frontend": True}
    return ["--profiler-config", json.dumps(cfg)]


def _post(url: str, timeout_s: float = 600.0) -> None:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        if r.status != 200:
            raise RuntimeError(f"POST {url}: HTTP {r.status}")


def profile_request(base_url: str, model: str, prompt: list[int], output_tokens: int,
                    timeout_s: float = 600.0) -> dict:
    """One request between /start_profile and /stop_profile (the server writes its traces on stop)."""
    from .client import run_load

    _post(base_url + "/start_profile", timeout_s)
    try:
        responses, t0, t1 = run_load(base_url, [model], [prompt], output_tokens, 1, timeout_s)
    finally:
        _post(base_url + "/stop_profile", timeout_s)
    return responses[0] if responses else {}


def load_trace(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def find_traces(trace_dir: Path) -> list[Path]:
    """Worker traces under ``trace_dir`` (rank 0 first when the names say which rank they are)."""
    files = [p for p in Path(trace_dir).rglob("*") if p.is_file()
             and (p.name.endswith(".json") or p.name.endswith(".json.gz")) and "capture" not in p.parts]

    def rank_key(p: Path):
        m = re.search(r"(?:rank|tp)[_-]?(\d+)", p.name)
        return (0 if m and m.group(1) == "0" else 1, p.name)

    return sorted(files, key=rank_key)


def _union_us(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize_events(events: list[dict], top: int = 15) -> dict:
    """GPU time per decode step (see the module doc) from the trace events of one worker."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e]
    # decode-step ranges on the GPU timeline ("gpu_user_annotation"); the host-side ones otherwise
    ranges = {}
    for cat in ("gpu_user_annotation", "user_annotation"):
        found = []
        for e in events:
            if e.get("cat") == cat and e.get("ph") == "X":
                m = STEP_RE.match(str(e.get("name", "")))
                if m and int(m.group(1)) == 0 and int(m.group(3)) > 0:
                    found.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), int(m.group(4))))
        ranges[cat] = sorted(found)
    on_gpu = bool(ranges["gpu_user_annotation"])
    steps = ranges["gpu_user_annotation"] or ranges["user_annotation"]
    out: dict = {"steps": len(steps), "step_ranges_on": "gpu" if on_gpu else "host",
                 "tokens_per_step": (sum(s[2] for s in steps) / len(steps)) if steps else 0,
                 "kernels": len(gpu)}
    if not steps:
        out["note"] = "no decode step annotations in the trace"
        return out
    # a kernel belongs to the step whose range contains its start (host ranges: launched asynchronously, so the
    # GPU work of a step may start after its host range ends: assign each kernel to the last step started before it)
    starts = [s[0] for s in steps]
    per_cat: dict = defaultdict(float)
    per_kernel: dict = defaultdict(lambda: [0, 0.0])
    busy: dict = defaultdict(list)  # step -> its kernels' (start, end)
    lo, hi = steps[0][0], steps[-1][1]
    for e in gpu:
        ts, dur = float(e["ts"]), float(e["dur"])
        i = bisect.bisect_right(starts, ts) - 1
        if i < 0:
            continue
        if on_gpu and ts > steps[i][1]:
            continue  # between steps (e.g. a prefill's kernels): not part of a decode step
        if not on_gpu and ts > hi + (hi - lo):
            continue
        name = str(e.get("name", "?"))
        per_cat[kernel_category(name)] += dur
        per_kernel[name][0] += 1
        per_kernel[name][1] += dur
        busy[i].append((ts, ts + dur))
    n = len(steps)
    out["per_step_us"] = {k: round(v / n, 2) for k, v in sorted(per_cat.items())}
    out["per_step_us"]["total"] = round(sum(per_cat.values()) / n, 2)
    out["busy_us"] = round(sum(_union_us(v) for v in busy.values()) / n, 2)
    firsts = [min(busy[i])[0] for i in sorted(busy)]
    if len(firsts) > 1:
        out["period_us"] = round((firsts[-1] - firsts[0]) / (len(firsts) - 1), 2)
    out["top_kernels"] = [{"name": k[:120], "calls_per_step": round(c / n, 2), "us_per_step": round(t / n, 2)}
                          for k, (c, t) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top]]
    return out


def keep_gpu_events(events: list[dict], dest: Path) -> Path:
    """The GPU events and step annotations of a worker trace's ``events`` (a few % of its size) as a chrome trace,
    for a later look in Perfetto or ``summarize_trace``: the raw traces stay on the machine that made them."""
    keep = [e for e in events if e.get("cat") in GPU_CATS + ("gpu_user_annotation", "user_annotation")]
    tmp = dest.with_name(dest.name + ".tmp")
    with gzip.open(tmp, "wt") as f:
        json.dump({"traceEvents": keep}, f)
    tmp.replace(dest)
    return dest


def summarize_trace(path: Path, top: int = 15) -> dict:
    return dict(summarize_events(load_trace(path), top), trace=Path(path).name)
