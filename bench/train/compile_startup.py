#!/usr/bin/env python3
"""What compiling costs `bdlora train` before its first fast step: the same short job compiled as a whole model and
with accelerate's regional compilation (the repeated decoder layer once), on a random Llama of a given depth,
`lora_backend: cublas` (bdlora's BD layer as a custom op in the graph). Prints and appends one JSON line per mode:
wall seconds of the whole run (loading, compiling, the steps, saving), dynamo's graph count, and the largest
difference between the two adapters. Compile time is host work: run it on the machine whose start-up you want.

    python bench/train/compile_startup.py --layers 32 --backend inductor --out startup.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the random Llama (widths: the tests')")
    ap.add_argument("--backend", default="inductor", help="torch_compile_backend (inductor, aot_eager)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="compile_startup.jsonl")
    a = ap.parse_args()

    import torch
    from safetensors.torch import load_file
    from torch._dynamo.utils import counters

    from bdlora.models import build_random_llama
    from bdlora.train.config import TrainConfig
    from bdlora.train.tasks import toy_chat_records, write_jsonl
    from bdlora.train.trainer import run_training

    work = Path(tempfile.mkdtemp(prefix="bdlora-compile-startup-"))
    model = build_random_llama(work / "model", num_layers=a.layers)
    data = write_jsonl(toy_chat_records(24, seed=2), work / "d.jsonl")
    adapters = {}
    for regional in (False, True):
        os.environ["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] = "1" if regional else "0"
        counters.clear()
        torch._dynamo.reset()
        cfg = TrainConfig(model=str(model), nblocks=2, r=8, lora_alpha=16, train_file=str(data), eval_fraction=0.0,
                          lr=5e-3, batch_size=4, max_steps=a.steps, seed=4, lora_backend="cublas",
                          output_dir=str(work / f"out-{int(regional)}"), report_to=[], progress=False,
                          training_args={"torch_compile": True, "torch_compile_backend": a.backend})
        t0 = time.time()
        res = run_training(cfg)
        wall = time.time() - t0
        adapters[regional] = load_file(res.adapter_dir / "adapter_model.safetensors")
        rec = {"layers": a.layers, "backend": a.backend, "regional": regional, "steps": a.steps,
               "wall_s": round(wall, 1), "graphs": counters["stats"]["unique_graphs"],
               "calls_captured": counters["stats"]["calls_captured"], "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d")}
        if regional:
            rec["max_adapter_diff"] = max((adapters[True][k] - adapters[False][k]).abs().max().item()
                                          for k in adapters[False])
        print(json.dumps(rec), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
