#!/usr/bin/env python3
"""A released multi-LoRA trainer beside bdlora's engine on the same jobs: mLoRA (TUDB-Labs/mLoRA, BatchLoRA).

    python -m bench.train.peer_mlora --mlora-src DIR --out R.json                 # GPU: Llama-3.1-8B shape, K = 1, 4, 8
    python -m bench.train.peer_mlora --mlora-src DIR --cpu-smoke --out R.json     # CPU: a tiny shape, the script only

DIR is a checkout of https://github.com/TUDB-Labs/mLoRA (its ``mlora`` package and ``mlora_train.py``; not part of
this repository). mLoRA pins torch 2.2 and transformers 4.38; it runs here unmodified in a child process
(``--child``) with the shims newer releases need: ``torch.List`` (gone from torch), ``typing.override`` (Python
3.12's, for Python 3.11), and on a CPU its CUDA-only calls. A model folder without weights (``--shape llama8b``, as
in ``bench_engine.py``) is built with random weights on the GPU where mLoRA calls ``from_pretrained``.

The jobs: K LoRA adapters (ranks cycling through ``--ranks``, alpha 2r, dropout 0.05 on q/k/v/o/gate/up/down: mLoRA
requires dropout > 0) trained together for ``--steps`` steps of ``--batch-size`` examples each, on
``bench_engine.make_data``'s synthetic instructions, in bf16 (mLoRA's ``--precision bf16``, AdamW, lr 1e-4). The same
K jobs then run in ``bdlora sweep``'s engine (LoRA, i.e. nblocks 1, same ranks, alpha, dropout, batch and steps) and,
as BD-LoRA, at ``--nblocks``. Each system's tokens/s counts its own real (unpadded) tokens of the steps after the
first over their wall time: mLoRA's iterations (its dispatcher's ``data()`` to the next, the last ended by the
executor's return; mLoRA pads every adapter's batch to one length, padding is not counted), the engine's rounds after
the first (``bench_engine.steady_tokens_per_s``). Peak memory: the largest per-iteration CUDA peak (mLoRA resets
the counter every iteration) and the engine's own. Writes ``--out`` (JSON) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT_TEMPLATE = """template: |
  ### Instruction:
  {{ data_point['instruction'] }}

  ### Input:
  {{ data_point['input'] }}

  ### Response:
  {{ data_point['chosen'] }}
"""
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DROPOUT, LR = 0.05, 1e-4


def mlora_config(root: Path, data: Path, ranks: list[int], k: int, batch: int, steps: int, cutoff: int) -> Path:
    """mLoRA's data file (the first ``batch * steps`` records, in its field names), prompt template and run config
    for K jobs, all dispatched at once (concurrency K), one epoch each: ``steps`` iterations."""
    records = [json.loads(line) for line in data.read_text().splitlines()[: batch * steps]]
    (root / "data.json").write_text(json.dumps([{"instruction": r["instruction"], "input": r["input"],
                                                "chosen": r["output"]} for r in records]))
    (root / "prompt.yaml").write_text(PROMPT_TEMPLATE)
    import yaml

    cfg = {
        "dispatcher": {"name": "default", "concurrency_num": k},
        "datasets": [{"name": "data", "data": str(root / "data.json"), "prompt": str(root / "prompt.yaml"),
                      "prompt_type": "instruction", "preprocess": "default"}],
        "adapters": [{"name": f"lora_{i}", "type": "lora", "path": str(root / f"adapter_{i}"), "optimizer": "adamw",
                      "lr": LR, "r": ranks[i % len(ranks)], "alpha": 2 * ranks[i % len(ranks)], "dropout": DROPOUT,
                      "target_modules": {t: True for t in TARGETS}} for i in range(k)],
        "tasks": [{"type": "train", "name": f"task_{i}", "adapter": f"lora_{i}", "dataset": "data",
                   "batch_size": batch, "mini_batch_size": batch, "num_epochs": 1, "cutoff_len": cutoff,
                   "save_step": 10**9} for i in range(k)],
    }
    path = root / "mlora.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def child(argv: list[str]) -> int:
    """Runs mLoRA's own ``mlora_train.py`` in this process with the shims, timing its iterations; the last line of
    stdout is this run's JSON (per-iteration start times, real tokens and CUDA peaks; the end time)."""
    src, shape_folder, device, rest = argv[0], argv[1], argv[2], argv[3:]
    import runpy
    import typing

    import torch
    import typing_extensions

    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override
    if not hasattr(torch, "List"):
        torch.List = typing.List
    sys.path.insert(0, src)
    import mlora.executor.dispatcher.dispatcher as mdisp
    import mlora.executor.executor as mexec
    import mlora.utils

    cuda = device.startswith("cuda")
    if not cuda:
        mlora.utils.setup_cuda_check = lambda: None
        for name in ("reset_peak_memory_stats", "max_memory_allocated", "synchronize"):
            setattr(torch.cuda, name, lambda *a, **k: 0)
    iters, end = [], {}
    original_data, original_execute = mdisp.Dispatcher.data, mexec.Executor.execute

    def data(self):
        peak = torch.cuda.max_memory_allocated() if cuda else 0  # the previous iteration's (reset after this)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = original_data(self)
        if out is not None:
            iters.append({"t": t, "tokens": sum(m.count(False) for m in out.batch_mask_), "prev_peak": peak})
        return out

    def execute(self):
        original_execute(self)
        if cuda:
            torch.cuda.synchronize()
        end["t"] = time.perf_counter()
        end["peak"] = torch.cuda.max_memory_allocated() if cuda else 0

    mdisp.Dispatcher.data, mexec.Executor.execute = data, execute
    sys.argv = [os.path.join(src, "mlora_train.py"), *rest]
    if shape_folder != "-":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from bench.train.bench_engine import RandomWeights

        with RandomWeights(Path(shape_folder), torch.device(device)):
            runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        runpy.run_path(sys.argv[0], run_name="__main__")
    print(json.dumps({"iterations": iters, "end": end}))
    return 0


def run_mlora(src: Path, model: Path, random_weights: bool, device: str, config: Path, log: Path) -> dict:
    """mLoRA's K jobs in a child process: steady tokens/s (iterations after the first), peak GiB, wall."""
    cmd = [sys.executable, "-m", "bench.train.peer_mlora", "--child", str(src), str(model) if random_weights else "-",
           device, "--base_model", str(model), "--device", device, "--precision",
           "bf16" if device.startswith("cuda") else "fp32", "--config", str(config), "--metric_file",
           str(config.parent / "metric")]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    wall = time.perf_counter() - t0
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
        return {"error": f"mLoRA exited with {proc.returncode}: {tail}", "log": str(log)}
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    its, end = run["iterations"], run["end"]
    steady = its[1:] or its
    seconds = end["t"] - steady[0]["t"]
    peaks = [it["prev_peak"] for it in its[1:]] + [end["peak"]]
    return {"iterations": len(its), "tokens_per_s": sum(it["tokens"] for it in steady) / seconds,
            "peak_gib": max(peaks) / 2**30, "wall_s": round(wall, 1), "log": str(log)}


def run_ours(model: Path, data: Path, out: Path, ranks: list[int], k: int, batch: int, steps: int, nblocks: int,
             cutoff: int, dtype: str) -> dict:
    """The same K jobs through the engine: steady tokens/s (rounds after the first), peak GiB."""
    from bench.train.bench_engine import engine_peak_gib, run_engine, steady_tokens_per_s

    jobs = [{"name": f"j{i}", "r": ranks[i % len(ranks)], "lora_alpha": 2.0 * ranks[i % len(ranks)],
             "nblocks": nblocks, "lr": LR, "batch_size": batch, "max_steps": steps, "seed": 0,
             "lora_dropout": DROPOUT} for i in range(k)]
    # token_budget: auto, the engine's default (the largest micro-batch its memory model admits for the jobs)
    eng, rows, wall = run_engine(model, data, out, jobs, dtype=dtype, budget="auto", max_seq_len=cutoff)
    return {"tokens_per_s": steady_tokens_per_s(eng.round_log, skip_first=1), "peak_gib": engine_peak_gib(eng),
            "token_budget": eng.token_budget, "rounds": len(eng.round_log), "wall_s": round(wall, 1),
            "jobs": {r["job"]: f"{r['status']} ({r['stop_reason']}) after {r['steps']} steps" for r in rows}}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mlora-src", required=True, help="a checkout of TUDB-Labs/mLoRA")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on the CPU (checks the script only)")
    ap.add_argument("--ks", default=None, help="comma-separated job counts (default 1,4,8; cpu-smoke 1,2)")
    ap.add_argument("--ranks", default=None, help="comma-separated job ranks (default 16,32,64,128; cpu-smoke 4,8)")
    ap.add_argument("--nblocks", type=int, default=None, help="BD blocks of the engine's BD rows (default 4; smoke 2)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--no-mlora", action="store_true", help="the engine's rows only (mLoRA's already measured)")
    ap.add_argument("--num-layers", type=int, default=None, help="decoder layers of the 8B shape (default 32)")
    a = ap.parse_args(argv)
    src = Path(a.mlora_src).resolve()
    if not (src / "mlora_train.py").is_file() or not (src / "mlora").is_dir():
        ap.error(f"--mlora-src {src}: not a checkout of TUDB-Labs/mLoRA (no mlora_train.py and mlora/ there)")
    import torch

    from bench.train.bench_engine import (LLAMA8B_SHAPE, LLAMA8B_SMOKE_SHAPE, RandomWeights, make_data,
                                          write_config_folder)

    cuda = torch.cuda.is_available() and not a.cpu_smoke
    if not cuda and not a.cpu_smoke:
        ap.error("no CUDA device: this benchmark is meant for a GPU; --cpu-smoke checks the script on the CPU")
    device = "cuda:0" if cuda else "cpu"
    ks = [int(k) for k in (a.ks or ("1,4,8" if cuda else "1,2")).split(",")]
    ranks = [int(r) for r in (a.ranks or ("16,32,64,128" if cuda else "4,8")).split(",")]
    nblocks = a.nblocks or (4 if cuda else 2)
    batch, steps = (a.batch_size, a.steps) if cuda else (2, 3)
    cutoff = 256 if cuda else 64
    dtype = "bfloat16" if cuda else "float32"
    tmp = Path(tempfile.mkdtemp(prefix="bdlora-peer-mlora-"))
    shape = dict(LLAMA8B_SHAPE if cuda else LLAMA8B_SMOKE_SHAPE)
    if a.num_layers:
        shape["num_layers"] = a.num_layers
    model = write_config_folder(tmp / "model", shape)
    data = make_data(tmp / "task.jsonl", max(4000, batch * steps), max_words=80 if cuda else 20)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "date": time.strftime("%Y-%m-%d"),
              "shape": shape, "batch_size": batch, "steps": steps, "ranks": ranks, "nblocks": nblocks,
              "mlora_commit": _commit(src), "rows": []}
    for k in ks:
        root = tmp / f"mlora-k{k}"
        root.mkdir()
        cfg = mlora_config(root, data, ranks, k, batch, steps, cutoff)
        row = {"k": k, "mlora": {"skipped": "--no-mlora"} if a.no_mlora else
               run_mlora(src, model, True, device, cfg, out.with_name(f"{out.stem}_mlora_k{k}.log"))}
        with RandomWeights(model, torch.device(device)):
            row["engine_lora"] = run_ours(model, data, tmp / f"eng-lora-k{k}", ranks, k, batch, steps, 1, cutoff,
                                          dtype)
            row["engine_bd"] = run_ours(model, data, tmp / f"eng-bd-k{k}", ranks, k, batch, steps, nblocks, cutoff,
                                        dtype)
        result["rows"].append(row)
        out.write_text(json.dumps(result, indent=1))
        m, lo, bd = row["mlora"], row["engine_lora"], row["engine_bd"]
        print(f"K={k}: mLoRA {m.get('tokens_per_s', float('nan')):,.0f} tok/s ({m.get('peak_gib') or 0:.2f} GiB)"
              f"{' ' + m['error'] if 'error' in m else ''} | engine LoRA {lo['tokens_per_s']:,.0f} tok/s "
              f"| engine BD N={nblocks} {bd['tokens_per_s']:,.0f} tok/s", flush=True)
    return 0


def _commit(src: Path):
    """The checkout's commit (a copy without .git carries it in a COMMIT file)."""
    if (src / "COMMIT").is_file():
        return (src / "COMMIT").read_text().strip()
    try:
        top, head = subprocess.run(["git", "-C", str(src), "rev-parse", "--show-toplevel", "HEAD"],
                                   capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError, ValueError):
        return None
    # a copy without .git inside another repository (this one) would report that repository's commit
    return head if Path(top).resolve() == src.resolve() else None


if __name__ == "__main__":
    sys.exit(main())
