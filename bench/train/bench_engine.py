"""Multi-LoRA engine benchmark (GPU): BatchLoRA throughput vs sequential single-job runs, and an early-exit sweep.

    python bench/train/bench_engine.py --out bench/results/train_engine.json        # H100/H200, SmolLM2-135M
    python bench/train/bench_engine.py --cpu-smoke --out /tmp/train_engine.json     # tiny model, seconds

1. Throughput: K = 1, 4, 8, 16 jobs (mixed ranks, BD N=3, SmolLM2's TP degree) trained together by the engine
   (one base GEMM per layer over all jobs' tokens, grouped BD-LoRA kernel) vs the same K jobs run one after another
   through the same engine with one job at a time. Tokens/s counts the jobs' real (unpadded) training tokens over
   the training part of each round, without the first rounds (Triton compilation, allocator warm-up) and without
   the evaluation passes.
2. Sweep: 16 configurations (4 learning rates x 4 ranks) on one task, with ALTO early exit (w=2, p=2,
   tau_slope=0.001, tau_gap=0.1, 5% warm-up, keep 25%) vs without: wall time, tokens trained, best val loss.

Everything runs in one process: measured 453 s on an H200 with 80 sweep steps (now 60 by default, ~7 min);
``--time-limit`` (400 s) skips the experiments that would not fit and lists them under ``skipped`` in the JSON.
``--random-smollm2-shape`` uses random weights in SmolLM2's shape (same cost) where the SmolLM2 package is missing. Data: a synthetic instruction task (reverse / sort / count words), written to a temp dir.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

WORDS = ("the a one two three four five six seven eight nine ten red blue green cat dog bird fish tree house river "
         "moon sun star run jump swim read write sing small big fast slow happy sad old new left right").split()


def make_data(path: Path, n: int, seed: int = 0, min_words: int = 8, max_words: int = 80) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ws = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
            task = rng.choice(["reverse", "sort", "count"])
            if task == "reverse":
                out = " ".join(ws[::-1])
            elif task == "sort":
                out = " ".join(sorted(ws))
            else:
                out = f"{len(ws)} words"
            f.write(json.dumps({"instruction": f"{task} the words", "input": " ".join(ws), "output": out}) + "\n")
    return path


def run_engine(model_path, data, out, jobs, *, dtype, budget, early_exit=None, max_active=64, eval_every=10**9,
               max_seq_len=256, val_fraction=0.02):
    from bdlora.train.engine import parse_run
    from bdlora.train.engine.engine import Engine

    run = parse_run({
        "base_model": str(model_path), "output_dir": str(out), "dtype": dtype, "token_budget": budget,
        "max_active_jobs": max_active, "eval_every": eval_every, "log_every": 0, "save_plots": False,
        "checkpoint_every": 0, "resume": False,
        "datasets": {"task": {"path": str(data), "val_fraction": val_fraction}},
        "defaults": {"max_seq_len": max_seq_len, "dataset": "task"},
        "jobs": jobs, "early_exit": early_exit or {"enabled": False},
    })
    eng = Engine(run)
    t0 = time.perf_counter()
    rows = eng.run()
    wall = time.perf_counter() - t0
    return eng, rows, wall


def steady_tokens_per_s(round_log, skip_first: int) -> float:
    rounds = [r for r in round_log[skip_first:] if not r.get("evals")] or round_log[-1:]
    tok = sum(r["tokens"] for r in rounds)
    sec = sum(r["train_s"] for r in rounds)
    return tok / sec if sec else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/train_engine.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="run a tiny version on CPU (correctness of the script)")
    ap.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct via bdlora.models.smollm2_path)")
    ap.add_argument("--random-smollm2-shape", action="store_true",
                    help="random weights in SmolLM2-135M's shape (same cost; for machines without the SmolLM2 package)")
    ap.add_argument("--ks", default="1,4,8,16")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per job in the throughput runs")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--sweep-steps", type=int, default=60)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--time-limit", type=float, default=400.0, help="seconds; later experiments are skipped")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("bench_engine: no CUDA device. This benchmark is meant for a GPU (H100/H200); "
              "use --cpu-smoke for a tiny CPU run that only checks the script.", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bdlora-bench-train-"))
    if args.cpu_smoke:
        from bdlora.models import build_random_llama

        torch.set_num_threads(max(1, os.cpu_count() or 1))
        model = args.model or build_random_llama(tmp / "tiny", init_std=0.05)
        ks = [int(k) for k in args.ks.split(",")] if args.ks != "1,4,8,16" else [1, 2]
        steps, bs, budget, sweep_steps = 3, 2, 512, 8
        nblocks, ranks, dtype, seq = 2, [4, 8], "float32", 64
        data = make_data(tmp / "task.jsonl", 200, max_words=20)
        lrs, sweep_ranks = [1e-3, 1e-2], [4, 8]
    else:
        from bdlora.models import smollm2_path

        torch.backends.cuda.matmul.allow_tf32 = True
        if args.random_smollm2_shape and not args.model:
            from bdlora.models import build_random_llama

            model = build_random_llama(tmp / "smollm2-shape", hidden_size=576, num_layers=30, num_heads=9,
                                       num_kv_heads=3, intermediate_size=1536, vocab_size=49152)
        else:
            model = args.model or smollm2_path()
        ks = [int(k) for k in args.ks.split(",")]
        steps, bs, budget, sweep_steps = args.steps, args.batch_size, args.token_budget, args.sweep_steps
        nblocks, ranks, dtype, seq = 3, [12, 24, 48, 96], args.dtype, 256
        data = make_data(tmp / "task.jsonl", 4000)
        lrs, sweep_ranks = [3e-5, 1e-4, 3e-4, 3e-3], [6, 12, 24, 48]
    result = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "model": str(model), "dtype": dtype,
        "settings": {"ks": ks, "steps": steps, "batch_size": bs, "token_budget": budget, "nblocks": nblocks,
                     "ranks": ranks, "max_seq_len": seq, "sweep_steps": sweep_steps, "lrs": lrs,
                     "sweep_ranks": sweep_ranks},
        "throughput": [], "sweep": {}, "skipped": [],
    }

    def over_time(what: str, estimate: float = 0.0) -> bool:
        if time.perf_counter() - t_start + estimate > args.time_limit:
            result["skipped"].append(what)
            print(f"[bench] skipping {what}: time limit {args.time_limit}s", flush=True)
            return True
        return False

    # -- 0. warm-up: compile the kernels for every rank used, so no measured run pays for compilation ------
    warm = [{"name": f"warm-{r}", "rank": r, "nblocks": nblocks, "lr": 1e-4, "batch_size": bs, "steps": 2}
            for r in sorted(set(ranks + sweep_ranks))]
    t0 = time.perf_counter()
    run_engine(model, data, tmp / "warmup", warm, dtype=dtype, budget=budget)
    run_engine(model, data, tmp / "warmup1", warm[:1], dtype=dtype, budget=budget)
    result["warmup_s"] = time.perf_counter() - t0

    # -- 1. throughput: K jobs together vs one at a time ------------------------------------------------
    per_job_seq_time = None
    for k in ks:
        jobs = [{"name": f"k{k}-j{i}", "rank": ranks[i % len(ranks)], "nblocks": nblocks, "lr": 1e-4,
                 "batch_size": bs, "steps": steps, "seed": i} for i in range(k)]
        if over_time(f"throughput K={k}"):
            break
        eng, rows, wall = run_engine(model, data, tmp / f"tp-{k}", jobs, dtype=dtype, budget=budget)
        together = steady_tokens_per_s(eng.round_log, skip_first=1)
        entry = {"k": k, "engine_tokens_per_s": together, "engine_wall_s": wall,
                 "microbatches_per_round": eng.round_log[-1]["microbatches"],
                 "peak_mem_gib": (torch.cuda.max_memory_allocated() / 2**30) if cuda else None}
        est = (per_job_seq_time or wall / max(k, 1)) * k
        if not over_time(f"sequential K={k}", est):
            eng_s, _, wall_s = run_engine(model, data, tmp / f"seq-{k}", jobs, dtype=dtype, budget=budget,
                                          max_active=1)
            seq_tps = steady_tokens_per_s(eng_s.round_log, skip_first=1)
            per_job_seq_time = wall_s / k
            entry.update(sequential_tokens_per_s=seq_tps, sequential_wall_s=wall_s,
                         speedup=together / seq_tps if seq_tps else None)
        result["throughput"].append(entry)
        print(f"[bench] K={k}: engine {together:,.0f} tok/s, sequential "
              f"{entry.get('sequential_tokens_per_s', float('nan')):,.0f} tok/s, speedup "
              f"{entry.get('speedup') or float('nan'):.2f}x", flush=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    # -- 2. sweep with vs without early exit ---------------------------------------------------------------
    grid = [{"name": f"lr{lr:g}-r{r}", "lr": lr, "rank": r, "nblocks": nblocks, "batch_size": bs,
             "steps": sweep_steps, "group": "sweep", "seed": 0} for lr in lrs for r in sweep_ranks]
    ee = {"enabled": True}  # paper defaults
    for label, early in (("with_early_exit", ee), ("without_early_exit", None)):
        if over_time(f"sweep {label}"):
            continue
        eng, rows, wall = run_engine(model, data, tmp / f"sweep-{label}", grid, dtype=dtype, budget=budget,
                                     early_exit=early, eval_every=max(2, sweep_steps // 10), val_fraction=0.02)
        vals = [r["best_eval_loss"] for r in rows if r["best_eval_loss"] is not None]
        best = min(rows, key=lambda r: r["best_eval_loss"] if r["best_eval_loss"] is not None else 1e9)
        reasons = {}
        for r in rows:
            reasons[r["stop_reason"]] = reasons.get(r["stop_reason"], 0) + 1
        result["sweep"][label] = {
            "wall_s": wall, "tokens": sum(r["tokens"] for r in rows), "steps": sum(r["steps"] for r in rows),
            "best_eval_loss": min(vals) if vals else None, "best_job": best["job"], "stop_reasons": reasons,
            "jobs": rows,
        }
        print(f"[bench] sweep {label}: {wall:.1f}s, {result['sweep'][label]['steps']} job-steps, best "
              f"{result['sweep'][label]['best_eval_loss']} ({best['job']}), {reasons}", flush=True)
    sw = result["sweep"]
    if "with_early_exit" in sw and "without_early_exit" in sw:
        a, b = sw["with_early_exit"], sw["without_early_exit"]
        result["sweep"]["time_saved_fraction"] = 1 - a["wall_s"] / b["wall_s"]
        result["sweep"]["steps_saved_fraction"] = 1 - a["steps"] / b["steps"]
        result["sweep"]["best_loss_ratio_with_over_without"] = (a["best_eval_loss"] / b["best_eval_loss"]
                                                                if a["best_eval_loss"] and b["best_eval_loss"]
                                                                else None)
    result["total_s"] = time.perf_counter() - t_start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"[bench] wrote {out} in {result['total_s']:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
