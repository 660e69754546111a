"""Round time of `bdlora sweep` on the quality benchmark's job mix (the recall task's runs: LoRA and BD-LoRA at
N = 2, 4, 8 at the three matched sizes, seed after seed), on a random model of SmolLM2's shape (a GPU) or a tiny one.

    python -m bench.quality.engine_rounds auto:1 auto:21 cublas:21 auto:21:prof

Each argument is BACKEND:K[:FLAG...]: the engine's lora_backend, the first K runs of the plan as jobs; ``foreach`` the
jobs' AdamW unfused (torch's foreach implementation, as on CPU), ``prof``
profiles one round (torch.profiler tables into ``$OUT/prof_<arg>.txt``). Prints and writes (``$OUT/engine_rounds.json``)
the median round time over ``ROUNDS`` (default 12) rounds after the first two, and job steps per second.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch


def plan_runs(k: int, config) -> list[tuple]:
    """The first k runs of the recall task's plan (full preset), seed after seed with the ranks ascending in each."""
    from .run import PRESETS, build_plan, exact_matched_rank

    full = PRESETS["full"]
    bd_rank = lambda r, n: exact_matched_rank(r, n, config)  # noqa: E731
    return [run for seed in full["seeds"]
            for g in build_plan(["recall"], full["ranks"], [seed], full["nblocks"], ["lora", "bd"], bd_rank)
            for run in g][:k]


def _unfused(adamw):
    def make(*args, **kwargs):
        kwargs["fused"] = False
        return adamw(*args, **kwargs)
    return make


def main(argv=None) -> int:
    from transformers import AutoConfig

    from bdlora.models import build_random_llama
    from bdlora.train.engine.config import parse_run
    from bdlora.train.engine.engine import Engine

    from .data import prepare
    from .run import PRESETS, TASK_SETTINGS, run_id, task_params
    from .sweep import run_file

    gpu = torch.cuda.is_available()
    work = Path(os.environ.get("WORK", "/tmp/bdlora-engine-rounds"))
    out = Path(os.environ.get("OUT", "."))
    shape = (dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                  vocab_size=49152) if gpu else
             dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512))
    model = work / "model"
    if not (model / "config.json").exists():
        build_random_llama(model, **shape, dtype="bfloat16", device="cuda" if gpu else None)
    files = prepare(work / "data", tasks=["recall"], recall_pairs=TASK_SETTINGS["recall"]["recall_pairs"])["recall"]
    config = AutoConfig.from_pretrained(str(model))
    rounds = int(os.environ.get("ROUNDS", 12))
    # the benchmark's own recall settings; every job active, one invocation of ROUNDS rounds
    p = task_params(PRESETS["full"], False, {"active_jobs": 64, "chunk_rounds": rounds})["recall"]
    if not gpu:
        p["precision"] = "fp32"
    adamw = torch.optim.AdamW
    results = {}
    for spec in (argv if argv is not None else sys.argv[1:]):
        backend, k, *flags = spec.split(":")
        runs = plan_runs(int(k), config)
        names = [run_id(*x, p["max_steps"]) for x in runs]
        raw = run_file(runs, names, p, files, str(model), work / f"sweep-{spec.replace(':', '_')}",
                       "cuda" if gpu else "cpu")
        raw.update(resume=None, lora_backend=backend)
        torch.optim.AdamW = _unfused(adamw) if "foreach" in flags else adamw
        engine = Engine(parse_run(raw, spec))
        if "prof" in flags:
            from torch.profiler import ProfilerActivity, profile

            engine.run_cfg.max_rounds = 3
            engine.run()
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
                engine.train_round()
                if gpu:
                    torch.cuda.synchronize()
            table = prof.key_averages()
            (out / f"prof_{spec.replace(':', '_')}.txt").write_text(
                table.table(sort_by="self_cpu_time_total", row_limit=35) + "\n\n"
                + table.table(sort_by="self_cuda_time_total" if gpu else "cpu_time_total", row_limit=25))
            continue
        engine.run()
        log = engine.round_log[2:]
        med = sorted(r["train_s"] for r in log)[len(log) // 2]
        results[spec] = {"jobs": int(k), "round_s_median": round(med, 4), "job_steps_per_s": round(int(k) / med, 2),
                         "tokens_per_round": log[0].get("tokens"), "device": torch.cuda.get_device_name() if gpu
                         else "cpu", "date": time.strftime("%Y-%m-%d")}
        print(spec, json.dumps(results[spec]), flush=True)
        del engine
        if gpu:
            torch.cuda.empty_cache()
    torch.optim.AdamW = adamw
    (out / "engine_rounds.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
