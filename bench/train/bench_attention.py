"""Attention alone, forward + backward, on the batches training sees: examples of 30-250 tokens (Llama-3.1-8B heads:
32 query, 8 key / value, head size 128, bf16), as

- ``masked``: rows of up to 258 tokens packed first-fit-decreasing, transformers' sdpa under a block-causal mask
  (what ``attn_implementation: sdpa`` runs);
- ``causal``: one example per row, right-padded, sdpa's causal flash kernel (padding-free rows cannot get this);
- ``packed``: one row of every example end to end through ``train.attention.packed_sdpa_forward`` (torch's
  variable-length flash attention), the route packed training takes.

Per route: median milliseconds of one layer's attention (forward + backward), and the attention FLOPs it does per
second counted as causal sum(l^2) over the real examples.

    python bench/train/bench_attention.py [--batch 32] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class _Attn(torch.nn.Module):
    """What transformers' attention functions read from the module."""

    def __init__(self, groups: int):
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = groups


def _rows(lengths: list[int], cap: int) -> list[list[int]]:
    rows: list[list[int]] = []
    for n in sorted(lengths, reverse=True):
        for row in rows:
            if sum(row) + n <= cap:
                row.append(n)
                break
        else:
            rows.append([n])
    return rows


def _time(fn, repeats: int) -> float:
    times = []
    for i in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from bdlora.train.attention import _varlen_api, packed_sdpa_forward, packed_sequence_kwargs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cap", type=int, default=258)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    heads, kv_heads, dim = 32, 8, 128
    module = _Attn(heads // kv_heads)
    rng = random.Random(args.seed)
    lengths = [rng.randint(30, 250) for _ in range(args.batch)]
    useful = sum(n * (n + 1) // 2 for n in lengths) * heads * dim * 4 * 3.5  # fwd 2 GEMMs, bwd 2.5x fwd

    def inputs(rows: int, length: int):
        g = torch.Generator(device=dev).manual_seed(args.seed)
        return [torch.randn(rows, h, length, dim, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_(True)
                for h in (heads, kv_heads, kv_heads)]

    def fwd_bwd(call, q, k, v):
        def step():
            out, _ = call(q, k, v)
            out.backward(torch.ones_like(out))
        return step

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "lengths": lengths,
               "varlen_keywords": sorted(_varlen_api()[1]) if _varlen_api() else None, "routes": {}}

    # masked: FFD rows under a block-causal mask
    rows = _rows(lengths, args.cap)
    seg = torch.full((len(rows), args.cap), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i, n in enumerate(row):
            seg[r, at:at + n] = i
            at += n
    seg = seg.to(dev)
    pos = torch.arange(args.cap, device=dev)
    mask = ((seg[:, :, None] == seg[:, None, :]) & (pos[:, None] >= pos[None, :]))[:, None]
    q, k, v = inputs(len(rows), args.cap)
    routes = {"masked": (lambda q, k, v: sdpa_attention_forward(module, q, k, v, mask), (q, k, v))}
    # causal: one example per row, right-padded
    q2, k2, v2 = inputs(len(lengths), max(lengths))
    routes["causal"] = (lambda q, k, v: sdpa_attention_forward(module, q, k, v, None), (q2, k2, v2))
    # packed: one row, varlen flash
    total = sum(lengths)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    kw = packed_sequence_kwargs(position_ids)
    kw["cu_seq_lens_q"] = kw["cu_seq_lens_k"] = kw["cu_seq_lens_q"].to(dev)
    q3, k3, v3 = inputs(1, total)
    routes["packed"] = (lambda q, k, v: packed_sdpa_forward(module, q, k, v, None, **kw), (q3, k3, v3))
    for name, (call, qkv) in routes.items():
        ms = _time(fwd_bwd(call, *qkv), args.repeats)
        results["routes"][name] = {"ms": round(ms, 3), "tflops_useful": round(useful / ms / 1e9, 1),
                                   "tokens_in_batch": qkv[0].shape[0] * qkv[0].shape[2]}
        print(f"{name:7s} {ms:8.3f} ms  {useful / ms / 1e9:7.1f} TFLOP/s useful  "
              f"{qkv[0].shape[0]} x {qkv[0].shape[2]} tokens", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
