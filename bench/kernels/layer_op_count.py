"""Torch ops one PEFT BD-LoRA layer call dispatches (forward + backward under bf16 autocast, the input's cast and
the gradient accumulation included), for each ``lora_backend``: the host work per layer call that bounds a training
step of small batches. Top-level aten ops as torch.profiler records them, on a CPU (a toy random Llama, q_proj of
layer 0, N=4, r=16, 8 x 64 rows).

    python bench/kernels/layer_op_count.py [--out ops.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def count_ops(model_dir: Path, backend: str, precision: str = "fp32") -> tuple[int, list[str]]:
    from torch.profiler import ProfilerActivity, profile

    from bdlora.train.config import TrainConfig
    from bdlora.train.trainer import build_peft_model

    cfg = TrainConfig.from_dict(dict(model=str(model_dir), nblocks=4, r=16, train_file="unused",
                                     output_dir=str(model_dir / "unused"), lora_backend=backend,
                                     precision=precision))
    model, _ = build_peft_model(cfg, model_dir)
    model.train()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(8, 64, model.config.hidden_size, requires_grad=True,
                    dtype=next(model.parameters()).dtype)  # the activations in the base's dtype

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().sum().backward()

    call()  # first call: one-time work out of the count
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    ops = [e.name for e in prof.events()
           if e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))]
    return len(ops), ops


def main() -> int:
    from bdlora.models import build_random_llama

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="the base's dtype (bf16: bf16 weights and activations, fp32 factors, as bdlora train's bf16 "
                         "precision has them; fp32 by default, the first recorded counts' setting)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_llama(Path(tmp) / "m", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                       intermediate_size=128, vocab_size=512)
        res = {}
        for backend in ("peft", "cublas"):
            n, ops = count_ops(model_dir, backend, a.precision)
            res[backend] = {"ops": n, "sequence": [o.removeprefix("aten::") for o in ops]}
            print(f"lora_backend {backend}: {n} ops")
    if a.out:
        Path(a.out).write_text(json.dumps({"torch": torch.__version__, "precision": a.precision, **res}, indent=1)
                               + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
