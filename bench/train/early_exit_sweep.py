#!/usr/bin/env python3
"""Early exit on a real sweep: the same grid of jobs through ``bdlora sweep`` without and with ALTO's loss-aware
early exit (``early_exit: {enabled: true}``, its defaults), side by side in one process.

    python -m bench.train.early_exit_sweep --out OUT                 # GPU: SmolLM2-135M, 16 jobs on the recall task
    python -m bench.train.early_exit_sweep --out OUT --small         # CPU: the tiny random Llama, 4 jobs, a few steps
    python -m bench.train.early_exit_sweep --out OUT --part full     # one sweep per call (then --part early, same OUT)

The jobs: BD-LoRA (N=3, what SmolLM2 serves at TP=3) on the quality benchmark's recall task (a 512-pair code book,
batches of 16, 300 steps, validation on held-out phrasings every ``eval_every`` steps), a grid of learning rates x
ranks. Both sweeps admit every job at once, so a job's ``time_s`` is its wall-clock from the sweep's start to its
adapter. Writes ``OUT/early_exit.json`` and prints a summary: job steps of each sweep and the share early exit saved,
each sweep's wall-clock, the best job by validation loss (the sweep's own criterion) in each and whether they agree,
and the wall-clock to the best adapter in each. ``--part`` runs one of the two sweeps and keeps its rows in
``OUT/<part>.json``; the comparison is written once both are there (for machines lent in calls shorter than both).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

GRID = {"full": dict(lr=[2e-4, 5e-4, 1e-3, 2e-3], r=[6, 12, 24, 48], max_steps=300, eval_every=20, batch_size=16,
                     max_length=384, recall_pairs=512, token_budget=16384, nblocks=3, model="smollm2"),
        "small": dict(lr=[1e-3, 1e-2], r=[4, 8], max_steps=8, eval_every=2, batch_size=2, max_length=96,
                      recall_pairs=8, token_budget=1024, nblocks=2, model="tiny-random")}


def run_file(g: dict, files: dict, folder: Path, early_exit: bool, device: str) -> dict:
    """The ``bdlora sweep`` run file (as a dict): every (lr, r) of the grid one job, all admitted at once."""
    jobs = [{"name": f"lr{lr:g}-r{r}", "lr": lr, "r": r} for lr in g["lr"] for r in g["r"]]
    return {
        "model": g["model"], "output_dir": str(folder), "train_file": str(files["train"]),
        "eval_file": str(files["eval"]), "data_format": "alpaca", "nblocks": g["nblocks"], "lora_alpha": 16.0,
        "scheduler": "linear", "warmup_ratio": 0.05, "batch_size": g["batch_size"], "max_steps": g["max_steps"],
        "max_length": g["max_length"], "eval_every": g["eval_every"], "report_to": [], "progress": False,
        "save_plots": False, "save_every": 0, "device": device, "max_active_jobs": len(jobs),
        "token_budget": g["token_budget"], "jobs": jobs, "early_exit": {"enabled": early_exit},
    }


def sweep(raw: dict) -> tuple[list[dict], float]:
    """(result rows, wall seconds) of one engine run."""
    from bdlora.train.engine.config import parse_run
    from bdlora.train.engine.launch import run_engine

    t0 = time.time()
    run_engine(parse_run(raw))
    wall = time.time() - t0
    return json.loads((Path(raw["output_dir"]) / "results.json").read_text())["jobs"], wall


def best(rows: list[dict]) -> dict:
    """The job with the lowest validation loss (what a sweep picks)."""
    return min((r for r in rows if r.get("best_eval_loss") is not None), key=lambda r: r["best_eval_loss"])


def compare(full: list[dict], full_wall: float, early: list[dict], early_wall: float) -> dict:
    steps_full, steps_early = sum(r["steps"] for r in full), sum(r["steps"] for r in early)
    b_full, b_early = best(full), best(early)
    return {
        "jobs": len(full), "steps_full": steps_full, "steps_early": steps_early,
        "steps_saved_share": 1 - steps_early / steps_full, "wall_full_s": round(full_wall, 1),
        "wall_early_s": round(early_wall, 1), "best_full": b_full["job"], "best_early": b_early["job"],
        "same_best": b_full["job"] == b_early["job"],
        "best_eval_loss_full": b_full["best_eval_loss"], "best_eval_loss_early": b_early["best_eval_loss"],
        "time_to_best_full_s": b_full["time_s"], "time_to_best_early_s": b_early["time_s"],
        "stop_reasons": {r["job"]: r["stop_reason"] for r in early},
        "steps_per_job_early": {r["job"]: r["steps"] for r in early},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="the CPU-sized grid on the tiny random Llama")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--part", choices=["both", "full", "early"], default="both",
                    help="run only the sweep without (full) or with (early) early exit; compare when both are in OUT")
    a = ap.parse_args(argv)
    import torch

    from bench.quality.data import prepare
    from bench.quality.metrics import device_name

    g = GRID["small" if a.small else "full"]
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(a.out)
    files = prepare(out / "data", tasks=["recall"], recall_pairs=g["recall_pairs"])["recall"]
    for part in (["full", "early"] if a.part == "both" else [a.part]):
        rows, wall = sweep(run_file(g, files, out / part, part == "early", device))
        (out / f"{part}.json").write_text(json.dumps({"rows": rows, "wall_s": wall, "device": device_name()}))
    if not all((out / f"{p}.json").exists() for p in ("full", "early")):
        print(f"{a.part} sweep done; run the other --part with the same --out to compare", flush=True)
        return 0
    (full, full_wall), (early, early_wall) = [
        (d["rows"], d["wall_s"]) for d in (json.loads((out / f"{p}.json").read_text()) for p in ("full", "early"))]
    res = {"device": device_name(), "date": time.strftime("%Y-%m-%d"), "grid": g,
           **compare(full, full_wall, early, early_wall)}
    (out / "early_exit.json").write_text(json.dumps(res, indent=1))
    print(f"{res['jobs']} jobs on {res['device']}: job steps {res['steps_full']} -> {res['steps_early']} "
          f"({100 * res['steps_saved_share']:.0f}% saved); wall {res['wall_full_s']} -> {res['wall_early_s']} s; "
          f"best {res['best_full']} ({res['best_eval_loss_full']:.4f}) / {res['best_early']} "
          f"({res['best_eval_loss_early']:.4f}): {'same' if res['same_best'] else 'DIFFERENT'}; to the best "
          f"adapter {res['time_to_best_full_s']:.1f} -> {res['time_to_best_early_s']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
