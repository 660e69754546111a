"""Multi-LoRA engine benchmark (GPU): BatchLoRA throughput vs sequential single-job runs, and an early-exit sweep.

    python bench/train/bench_engine.py --out bench/results/train_engine.json        # H100/H200, SmolLM2-135M
    python bench/train/bench_engine.py --cpu-smoke --out /tmp/train_engine.json     # tiny model, seconds

0. Warm-up, untimed: the engine runs every rank alone and all ranks together for 2 steps (the grouped kernel's
   compile-time tile sizes follow the largest active rank), and the single-job trainer runs 3 steps.
1. Throughput: K = 1, 4, 8, 16 jobs (mixed ranks, BD N=3, SmolLM2's TP degree) trained together by the engine
   (one base GEMM per layer over all jobs' tokens, grouped BD-LoRA kernel) vs the same K jobs run one after another
   with the single-job PEFT trainer (``bdlora.train.run_training``, a TrainConfig made from each job: same model,
   rank, nblocks, alpha, init, lr, schedule, batch size, max_seq_len, steps, seed and data file). Tokens/s counts
   the jobs' real (unpadded) input tokens over training time only: the engine's rounds after the first (each
   round's training part, which ends on a host sync; evaluation excluded), the trainer's optimizer steps after the
   first, timed by its per-step metrics records (model load, tokenization, final evaluation and adapter save
   excluded; ``sequential_trainer_wall_s`` has the whole calls). Job i is the same in every K, so each sequential
   job runs once and the baseline of K is the first K jobs: their tokens over their step seconds. Extra column:
   the engine itself with one active job at a time (``max_active_jobs=1``), for the first ``--engine-seq-jobs``
   jobs. Known differences that are the trainer's design: it keeps an fp32 base and autocasts to bf16 (the engine
   stores the base in bf16), pads each batch to its longest example, computes logits at every position, and
   splits train/validation with the job's seed (the engine with the dataset's seed 0), so jobs with seed != 0
   see a slightly different training subset (token counts of both sides are exact, measured per step).
2. Sweep: 16 configurations (4 learning rates x 4 ranks) on one task, with ALTO early exit (w=2, p=2,
   tau_slope=0.001, tau_gap=0.1, 5% warm-up, keep 25%) vs without: wall time, tokens trained, best val loss.

Everything runs in one process. Measured 453 s on an H200 with 80 sweep steps and the engine-at-one-job baseline
for all 16 jobs; now (60 sweep steps, trainer baseline for the 16 jobs, engine-at-one-job for 4, the longer
warm-up) estimated 5-7 min on an H100/H200, not yet measured. ``--time-limit`` (420 s) skips an experiment whose
estimated end is past it and lists it under ``skipped`` in the JSON. ``--random-smollm2-shape`` uses random weights
in SmolLM2's shape (same cost) where the SmolLM2 package is missing. Data: a synthetic instruction task (reverse /
sort / count words), written to a temp dir.
"""

from __future__ import annotations

import argparse
import gc
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


def engine_run_config(model_path, data, out, jobs, *, dtype, budget, early_exit=None, max_active=64,
                      eval_every=10**9, max_seq_len=256, val_fraction=0.02):
    from bdlora.train.engine import parse_run

    return parse_run({
        "base_model": str(model_path), "output_dir": str(out), "dtype": dtype, "token_budget": budget,
        "max_active_jobs": max_active, "eval_every": eval_every, "log_every": 0, "save_plots": False,
        "checkpoint_every": 0, "resume": False,
        "datasets": {"task": {"path": str(data), "val_fraction": val_fraction}},
        "defaults": {"max_seq_len": max_seq_len, "dataset": "task"},
        "jobs": jobs, "early_exit": early_exit or {"enabled": False},
    })


def run_engine(model_path, data, out, jobs, **kw):
    from bdlora.train.engine.engine import Engine

    free_memory()
    eng = Engine(engine_run_config(model_path, data, out, jobs, **kw))
    t0 = time.perf_counter()
    rows = eng.run()
    wall = time.perf_counter() - t0
    return eng, rows, wall


def free_memory() -> None:
    """Drop earlier runs' models (engines hold reference cycles) before the next one loads its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def steady_tokens_per_s(round_log, skip_first: int) -> float:
    """Tokens over training seconds of the rounds after the first ``skip_first``. A round's ``train_s`` covers the
    packing, forward/backward and optimizer steps only (it ends on a host sync), never the evaluation after it."""
    rounds = round_log[skip_first:] or round_log[-1:]
    tok = sum(r["tokens"] for r in rounds)
    sec = sum(r["train_s"] for r in rounds)
    return tok / sec if sec else float("nan")


def engine_one_job_stats(round_log, n_jobs: int, steps: int) -> list[dict]:
    """Per-job (tokens, seconds) of an engine run with ``max_active_jobs=1``: job i holds rounds
    [i*steps, (i+1)*steps); each job's first round is left out, like the trainer's first step."""
    if len(round_log) != n_jobs * steps or any(r["active"] != 1 for r in round_log):
        raise RuntimeError(f"engine at one job: expected {n_jobs}x{steps} one-job rounds, got {len(round_log)}")
    out = []
    for i in range(n_jobs):
        rounds = round_log[i * steps + 1:(i + 1) * steps] or round_log[i * steps:(i + 1) * steps]
        out.append({"tokens": sum(r["tokens"] for r in rounds), "seconds": sum(r["train_s"] for r in rounds)})
    return out


class TokenLengths:
    """Token count of every record of a data file, encoded exactly as the trainer encodes it (chat template,
    truncation to max_length): the trainer's non-pad tokens of a batch are the sum over its records."""

    def __init__(self, model_path, data, max_len: int):
        from bdlora.train.data import encode, read_records, to_messages
        from bdlora.train.trainer import load_tokenizer

        tok = load_tokenizer(Path(model_path))
        self.lengths = {}
        for i, rec in enumerate(read_records(data)):
            ex = encode(tok, to_messages(rec, "auto"), max_len, index=i)
            if ex is not None:
                self.lengths[i] = len(ex.input_ids)


def trainer_config(job, *, model_path, data, out, dtype, val_fraction, steps=None):
    """The single-job trainer's TrainConfig of an engine job (a parsed JobConfig): same model, rank, nblocks,
    alpha, init, optimizer, schedule, batch, sequence limit, steps, seed and data file."""
    from bdlora.train.config import TrainConfig

    sched = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear",
             "cosine": "cosine"}.get(job.schedule)
    if sched is None or tuple(job.adam_betas) != (0.9, 0.999) or job.adam_eps != 1e-8:
        raise ValueError(f"job {job.name}: schedule {job.schedule!r} / AdamW betas {job.adam_betas} eps "
                         f"{job.adam_eps} have no single-job trainer equivalent")
    return TrainConfig(
        model=str(model_path), nblocks=int(job.nblocks), r=int(job.rank), lora_alpha=float(job.alpha),
        lora_dropout=float(job.lora_dropout), a_init=job.a_init, target_modules=job.target_modules,
        train_file=str(data), eval_fraction=val_fraction, max_length=int(job.max_seq_len),
        lr=float(job.lr), weight_decay=float(job.weight_decay), max_grad_norm=float(job.max_grad_norm or 0.0),
        scheduler=sched, warmup_steps=int(job.warmup_steps), batch_size=int(job.batch_size),
        grad_accum=int(job.grad_accum), max_steps=int(steps or job.steps),
        # the trainer keeps fp32 base weights and autocasts to bf16; the engine stores the base in bf16
        precision="bf16" if dtype == "bfloat16" else "fp32", seed=int(job.seed),
        eval_every=0, save_every=0, log_every=1, output_dir=str(out), resume=None, tensorboard=False,
        progress=False, record_samples=True)


def run_trainer(cfg, lengths: TokenLengths) -> dict:
    """One ``run_training`` call; tokens/s over its optimizer steps after the first (model load, tokenization,
    the final evaluation and the adapter save are outside), timed by the trainer's own per-step metrics records
    (written after each step's loss reaches the host, so the device work of the step is done)."""
    from bdlora.train.trainer import run_training

    free_memory()
    t0 = time.perf_counter()
    res = run_training(cfg, validate_adapter=False)
    wall = time.perf_counter() - t0
    out = Path(cfg.output_dir)
    times = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train_loss" in rec:
            times[rec["step"]] = rec["time"]
    step_tokens = {}
    for line in (out / "samples.rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "records" in rec:
            step_tokens[rec["step"]] = step_tokens.get(rec["step"], 0) + sum(lengths.lengths[i]
                                                                              for i in rec["records"])
    n = res.step
    if n < 2 or sorted(times) != list(range(1, n + 1)):
        raise RuntimeError(f"trainer run {out}: expected one metrics record per step 1..{n}")
    del res
    free_memory()
    # metrics step s is written after optimizer step s; samples step s (0-based) is consumed by optimizer step s+1
    return {"tokens": sum(step_tokens[s] for s in range(1, n)), "seconds": times[n] - times[1],
            "steps": n, "wall_s": wall}


def throughput_table(rows: list[dict]) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    head = ["K", "engine tok/s", "trainer seq tok/s", "vs trainer", "engine@1 tok/s", "vs engine@1", "engine s",
            "trainer s"]
    body = [[str(r["k"]), f(r["engine_tokens_per_s"], ",.0f"), f(r.get("sequential_trainer_tokens_per_s"), ",.0f"),
             f(r.get("speedup_vs_trainer"), ".2f"), f(r.get("engine_one_job_tokens_per_s"), ",.0f"),
             f(r.get("speedup_vs_engine_one_job"), ".2f"), f(r["engine_wall_s"], ".1f"),
             f(r.get("sequential_trainer_wall_s"), ".1f")] for r in rows]
    w = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(n) for c, n in zip(cells, w))  # noqa: E731
    return "\n".join([line(head), line(["-" * n for n in w])] + [line(b) for b in body])


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
    ap.add_argument("--engine-seq-jobs", type=int, default=4,
                    help="the engine-at-one-job column covers the first this many jobs (K <= this)")
    ap.add_argument("--time-limit", type=float, default=420.0,
                    help="seconds; an experiment whose estimated end is past it is skipped")
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
                     "sweep_ranks": sweep_ranks, "engine_seq_jobs": args.engine_seq_jobs,
                     "time_limit_s": args.time_limit},
        "throughput": [], "sweep": {}, "skipped": [],
    }

    def over_time(what: str, estimate: float = 0.0) -> bool:
        if time.perf_counter() - t_start + estimate > args.time_limit:
            result["skipped"].append(what)
            print(f"[bench] skipping {what}: time limit {args.time_limit}s", flush=True)
            return True
        return False

    val_fraction = 0.02

    def job(name, i, rank, n_steps):
        return {"name": name, "rank": rank, "nblocks": nblocks, "lr": 1e-4, "batch_size": bs, "steps": n_steps,
                "seed": i}

    def parsed(jobs, out):
        return engine_run_config(model, data, out, jobs, dtype=dtype, budget=budget, max_seq_len=seq).jobs

    # -- 0. warm-up, untimed: nothing measured pays for compilation or first-use costs ----------------------
    # The grouped kernel's compile-time tile sizes depend on the largest rank among the active jobs (all jobs
    # here share nblocks), so every rank is run ALONE once (one engine, one active job at a time) and all of
    # them together once. The 2026-11-21 run warmed only the smallest rank (6) alone and all ranks together, so
    # the K=1 engine run (rank 12 alone) most likely compiled inside its timed rounds, which would explain its
    # 883 vs 2402 tok/s against the identical one-job engine run right after it.
    all_ranks = sorted(set(ranks + sweep_ranks))
    warm = [job(f"warm-{r}", 0, r, 2) for r in all_ranks]
    t0 = time.perf_counter()
    run_engine(model, data, tmp / "warmup-each", warm, dtype=dtype, budget=budget, max_seq_len=seq, max_active=1)
    run_engine(model, data, tmp / "warmup-all", warm, dtype=dtype, budget=budget, max_seq_len=seq)
    # the single-job trainer (PEFT, eager): CUDA/cuBLAS/autocast first use, accelerate set-up
    run_training_warm = trainer_config(parsed([job("warm-trainer", 0, ranks[0], 3)], tmp / "w")[0],
                                       model_path=model, data=data, out=tmp / "warmup-trainer", dtype=dtype,
                                       val_fraction=val_fraction)
    lengths = TokenLengths(model, data, seq)
    run_trainer(run_training_warm, lengths)
    result["warmup_s"] = time.perf_counter() - t0

    # -- 1. throughput: K jobs together vs the same jobs one after another --------------------------------
    # Job i is the same in every K (rank ranks[i % len], seed i), so the sequential baselines run each job once
    # and the baseline of K is the first K jobs back to back: sum of their tokens / sum of their step seconds.
    all_jobs = [job(f"j{i}", i, ranks[i % len(ranks)], steps) for i in range(max(ks))]
    trainer_jobs = parsed(all_jobs, tmp / "parsed")
    seq_trainer: dict[int, dict] = {}
    seq_engine1: dict[int, dict] = {}
    n_engine1 = min(args.engine_seq_jobs, max(ks))
    per_trainer_job = None

    def agg(stats: dict, k: int):
        if any(i not in stats for i in range(k)):
            return None
        tok = sum(stats[i]["tokens"] for i in range(k))
        sec = sum(stats[i]["seconds"] for i in range(k))
        return tok / sec if sec else None

    def ratio(a, b):
        return a / b if a and b else None

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for k in ks:
        jobs = [dict(j, name=f"k{k}-{j['name']}") for j in all_jobs[:k]]
        if over_time(f"throughput K={k}"):
            break
        eng, rows, wall = run_engine(model, data, tmp / f"tp-{k}", jobs, dtype=dtype, budget=budget,
                                     max_seq_len=seq)
        together = steady_tokens_per_s(eng.round_log, skip_first=1)
        entry = {"k": k, "engine_tokens_per_s": together, "engine_wall_s": wall,
                 "microbatches_per_round": eng.round_log[-1]["microbatches"],
                 "peak_mem_gib": (torch.cuda.max_memory_allocated() / 2**30) if cuda else None}
        del eng
        # the single-job PEFT trainer, job by job (the baseline)
        for i in range(k):
            if i in seq_trainer:
                continue
            if over_time(f"trainer job {i} (K={k})", per_trainer_job or 0.0):
                break
            seq_trainer[i] = run_trainer(trainer_config(trainer_jobs[i], model_path=model, data=data,
                                                        out=tmp / f"trainer-{i}", dtype=dtype,
                                                        val_fraction=val_fraction), lengths)
            seq_trainer[i].update(job=i, rank=trainer_jobs[i].rank)
            per_trainer_job = seq_trainer[i]["wall_s"]
        # the engine with one active job at a time (extra column; the first n_engine1 jobs only)
        todo = [i for i in range(min(k, n_engine1)) if i not in seq_engine1]
        if todo and not over_time(f"engine at one job, jobs {todo}", 1.5 * wall * len(todo) / k):
            eng1, _, _ = run_engine(model, data, tmp / f"engine1-{todo[0]}", [all_jobs[i] for i in todo],
                                    dtype=dtype, budget=budget, max_seq_len=seq, max_active=1)
            for i, st in zip(todo, engine_one_job_stats(eng1.round_log, len(todo), steps)):
                seq_engine1[i] = dict(st, job=i, rank=all_jobs[i]["rank"])
            del eng1
        tr = agg(seq_trainer, k)
        e1 = agg(seq_engine1, k)
        entry.update(sequential_tokens_per_s=tr, speedup=ratio(together, tr),
                     sequential_trainer_tokens_per_s=tr, speedup_vs_trainer=ratio(together, tr),
                     sequential_trainer_wall_s=(sum(seq_trainer[i]["wall_s"] for i in range(k)) if tr else None),
                     engine_one_job_tokens_per_s=e1, speedup_vs_engine_one_job=ratio(together, e1))
        result["throughput"].append(entry)
        print(f"[bench] K={k}: engine {together:,.0f} tok/s | trainer sequential {tr or float('nan'):,.0f} tok/s "
              f"({entry['speedup_vs_trainer'] or float('nan'):.2f}x) | engine at one job "
              f"{e1 or float('nan'):,.0f} tok/s ({entry['speedup_vs_engine_one_job'] or float('nan'):.2f}x)",
              flush=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
    result["sequential_jobs"] = {
        "trainer": [dict(seq_trainer[i], tokens_per_s=seq_trainer[i]["tokens"] / seq_trainer[i]["seconds"])
                    for i in sorted(seq_trainer)],
        "engine_one_job": [dict(seq_engine1[i], tokens_per_s=seq_engine1[i]["tokens"] / seq_engine1[i]["seconds"])
                           for i in sorted(seq_engine1)],
    }
    print(throughput_table(result["throughput"]), flush=True)
    k_max_round = None
    if result["throughput"]:
        last = result["throughput"][-1]
        k_max_round = last["engine_wall_s"] / steps * (len(set(sweep_ranks)) * len(lrs) / last["k"])

    # -- 2. sweep with vs without early exit ---------------------------------------------------------------
    grid = [{"name": f"lr{lr:g}-r{r}", "lr": lr, "rank": r, "nblocks": nblocks, "batch_size": bs,
             "steps": sweep_steps, "group": "sweep", "seed": 0} for lr in lrs for r in sweep_ranks]
    ee = {"enabled": True}  # paper defaults
    for label, early in (("with_early_exit", ee), ("without_early_exit", None)):
        est = k_max_round * sweep_steps * (0.6 if early else 1.0) if k_max_round else 0.0
        if over_time(f"sweep {label}", est):
            continue
        eng, rows, wall = run_engine(model, data, tmp / f"sweep-{label}", grid, dtype=dtype, budget=budget,
                                     max_seq_len=seq,
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
