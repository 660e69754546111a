"""Benchmark bdlora.kernels on one CUDA GPU (bf16, CUDA-event timing); prints tables and writes JSON.

    python bench/kernels/bench_kernels.py --out results.json [--quick]

Sections
  check   : every Triton op vs its torch reference on the GPU (fp32), before any timing
  layer   : one linear layer forward+backward (dX, dA, dB; W frozen) at T tokens, d_in -> d_out, rank r, N blocks:
            base_only (no LoRA), peft_bd (PEFT-style layer with BlockDiagonalLinear), fused (cuBLAS base + Triton
            LoRA added in place), fused_base (base GEMM inside the Triton tile), cublas (the layer composed of
            cuBLAS GEMMs with alpha/beta epilogues, block-diagonal factors as dense GEMMs: backend="cublas", its
            default bd_gemm), cublas_blocks (the same, block-diagonal factors as strided-batched GEMMs over the
            blocks), cublas_maskdrop (the cublas default with its dropout materialized as a bool mask instead of
            drawn inside the Triton dropout kernels, i.e. the route before those kernels). Every column does the
            same work: fwd + bwd with grads of x, A, B, dropout as --dropout.
            min_MB = theoretical minimum bytes; cublas_MB = bytes the cublas path moves by its design (every GEMM's
            activation reads/writes, base GEMM included). speedup_vs_peft = peft_bd/fused, cublas_vs_peft =
            peft_bd/cublas.
  grouped : LoRA path only (fwd+bwd) for 4-32 adapters of mixed ranks over one batch: grouped kernel vs a loop
            of per-adapter torch LoRA.
  decode  : LoRA time per module at 1-64 tokens (8B q/k/v at TP=1 with N 1/4; qkv, o, gate_up, down as one GPU
            of TP=4 serves them): decode_lora (shrink + expand launches) vs batched torch gather vs vLLM's punica
            shrink+expand when importable, each timed eagerly (*_ms) and replayed from a CUDA graph (*_graph_ms,
            as in serving).
  module  : base GEMM + LoRA per module at 1 and 8 tokens, one GPU of TP=4 (8B, BD rank 152/4): base only,
            + decode_lora, decode_lora_folded (shrink inside the base GEMM), + vLLM's punica; graph-replayed.
On a machine without CUDA it prints a message and exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bdlora.layout import LoraFactors, unpack_block_diagonal  # noqa: E402

BF16 = 2  # bytes


def timed(fn, warmup=3, iters=10, batch=1) -> float:
    """Median milliseconds per fn() by CUDA events over ``iters`` samples of ``batch`` back-to-back calls each.
    batch=1 synchronizes after every call (host launch time included in full); batch > 1 lets the host run ahead
    of the GPU between calls as it does across the layers of a training step."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return sorted(times)[len(times) // 2]


def host_profile(fn, calls: int, top: int) -> str:
    """cProfile's table of the ``top`` functions by own time over ``calls`` back-to-back calls of ``fn`` (after one
    warm-up call; the GPU is synchronized before and after): where a call's host time goes."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def graph_timed(fn, reps=20, iters=10) -> float:
    """Median milliseconds per fn() call, replayed from one CUDA graph of ``reps`` calls: launch cost as in vLLM's
    captured decode steps, not Python dispatch (what ``timed`` sees for microsecond kernels)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles, autotuning) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return timed(graph.replay, iters=iters) / reps


def table(title, rows):
    if not rows:
        return
    cols = list(rows[0])
    width = {c: max(len(c), *(len(fmt(r[c])) for r in rows)) for c in cols}
    print(f"\n== {title}")
    print("  ".join(c.rjust(width[c]) for c in cols))
    for r in rows:
        print("  ".join(fmt(r[c]).rjust(width[c]) for c in cols))


def fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)


try:
    from peft.tuners.lora.variants import BlockDiagonalLinear
except Exception:  # older PEFT: same math as PEFT 0.21's class (weight (out, in/N), einsum per block)
    class BlockDiagonalLinear(nn.Module):
        def __init__(self, in_features, out_features, nblocks, dtype=torch.float32, device=None):
            super().__init__()
            self.nblocks = nblocks
            self.weight = nn.Parameter(torch.empty(out_features, in_features // nblocks, dtype=dtype, device=device))

        def forward(self, x):
            nb = self.nblocks
            w = self.weight.view(nb, self.weight.shape[0] // nb, -1)
            return torch.einsum("bim,inm->bin", x.reshape(x.shape[0], nb, -1), w).reshape(x.shape[0], -1)


class PeftBdLayer(nn.Module):
    """What PEFT runs for a BD-LoRA linear: base(x) + lora_B(lora_A(dropout(x))) * scaling."""

    def __init__(self, base, ad, dropout):
        super().__init__()
        self.base, self.scale = base, ad.scale
        self.drop = nn.Dropout(dropout)
        d_in, d_out, r = ad.d_in, ad.d_out, ad.rank
        dev, dt = ad.lora_A.device, ad.lora_A.dtype
        self.lora_a = (BlockDiagonalLinear(d_in, r, ad.nblocks, dtype=dt, device=dev) if ad.layout == "row"
                       else nn.Linear(d_in, r, bias=False, device=dev, dtype=dt))
        self.lora_b = (BlockDiagonalLinear(r, d_out, ad.nblocks, dtype=dt, device=dev) if ad.layout == "column"
                       else nn.Linear(r, d_out, bias=False, device=dev, dtype=dt))
        with torch.no_grad():
            self.lora_a.weight.copy_(ad.lora_A)
            self.lora_b.weight.copy_(ad.lora_B)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(self.drop(x))) * self.scale


def make_adapter(K, d_in, d_out, r, layout, n, dtype, dropout=0.0, scale=2.0):
    na, nb = (n, 1) if layout == "row" else (1, n)
    a = (torch.randn(r, d_in // na, device="cuda") / (d_in // na) ** 0.5).to(dtype).requires_grad_()
    b = (torch.randn(d_out, r // nb, device="cuda") / r ** 0.5).to(dtype).requires_grad_()
    return LoraFactors(a, b, layout, n, scale, dropout)


def check(K) -> list[dict]:
    """Correctness on the GPU (fp32 kernels use IEEE dots) before timing anything."""
    rows = []
    torch.manual_seed(0)
    d_in, d_out, t = 256, 384, 300
    adapters = [make_adapter(K, d_in, d_out, r, lay, n, torch.float32) for r, lay, n in
                [(16, "column", 4), (64, "row", 4), (8, "column", 1), (32, "row", 2)]]
    seg = [0, 1, 1, 180, t]
    x = torch.randn(t, d_in, device="cuda", requires_grad=True)
    w = torch.randn(d_out, d_in, device="cuda") / 16
    params = [x] + [p for ad in adapters for p in (ad.lora_A, ad.lora_B)]
    gy = torch.randn(t, d_out, device="cuda")
    # the cuBLAS path with dropout against the torch reference with the same (torch-drawn) masks
    drop = [dataclasses.replace(ad, dropout=0.25) for ad in adapters]
    masks = K.torch_keep_masks(x, seg, drop, 7)
    fused_ref = lambda: K.fused_lora_linear_ref(x, w, None, seg, adapters)  # noqa: E731
    for name, fn, ref in [
        ("grouped_lora", lambda: K.grouped_lora(x, seg, adapters), lambda: K.grouped_lora_ref(x, seg, adapters)),
        ("fused_lora_linear[triton]", lambda: K.fused_lora_linear(x, w, None, seg, adapters, options=K.KernelOptions(backend="triton")),
         fused_ref),
        ("fused_lora_linear[fuse_base]", lambda: K.fused_lora_linear(x, w, None, seg, adapters, options=K.KernelOptions(fuse_base=True)),
         fused_ref),
        ("fused_lora_linear[auto]", lambda: K.fused_lora_linear(x, w, None, seg, adapters), fused_ref),
        ("fused_lora_linear[cublas,blocks]",
         lambda: K.fused_lora_linear(x, w, None, seg, adapters, options=K.KernelOptions(backend="cublas", bd_gemm="blocks")), fused_ref),
        ("fused_lora_linear[cublas,dropout]",
         lambda: K.fused_lora_linear(x, w, None, seg, drop, dropout_seed=7, options=K.KernelOptions(backend="cublas")),
         lambda: K.fused_lora_linear_ref(x, w, None, seg, drop, masks)),
    ]:
        y, ran = fn()
        backend = ran.backend
        yr = ref()  # grads below compare against the reference
        g, gr = torch.autograd.grad(y, params, gy), torch.autograd.grad(yr, params, gy)
        err = max([float((y - yr).detach().abs().max() / yr.detach().abs().max())] +
                  [float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for a, b in zip(g, gr)])
        rows.append(dict(op=name, backend=backend, max_rel_err=err, ok=err < 1e-3))
    rows[-1]["backend"] += ("+dropout:" + (ran.dropout or ("none",))[-1]
                            + "+dsdb(last adapter):" + (ran.dsdb or ("none",))[-1])
    from bdlora.kernels import dropout as D  # the compiled counter hash gives the torch twin's bits
    keys = D.dropout_keys(7, 3)
    same = torch.equal(D.keep_mask_triton(keys, 1000, 4099, 0.1, "cuda"), D.keep_mask_torch(keys, 1000, 4099, 0.1,
                                                                                          "cuda"))
    rows.append(dict(op="keep_mask[triton==torch]", backend="triton", max_rel_err=0.0 if same else 1.0, ok=same))
    per = [[(torch.randn(r, d_in, device="cuda"), torch.randn(d, r // 2, device="cuda")) for r in (16, 64, 8)]
           for d in (256, 64, 64)]
    a, b, rk, offs = K.stack_decode_weights(per, 64, "column", 2)
    idx = torch.tensor([0, -1, 2, 1, 1, 0, -1, 2], device="cuda")
    xs = torch.randn(8, d_in, device="cuda")
    y0 = torch.randn(8, offs[-1], device="cuda")
    sc = torch.rand(3, device="cuda")
    yk, ran = K.decode_lora(y0.clone(), xs, a, b, idx, rk, sc, offs, nblocks=2)
    yr = K.decode_lora_ref(y0.clone(), xs, a, b, idx, rk, sc, offs, "column", 2)
    err = float((yk - yr).abs().max() / yr.abs().max())
    rows.append(dict(op="decode_lora", backend=ran.backend, max_rel_err=err, ok=err < 1e-3))
    # serving shapes in bf16: one GPU of TP=4 (qkv of the 8B model at BD rank 152/4 = 38; down_proj's 3584 inputs)
    for name, d_in_s, outs, r, t_s in [("qkv", 4096, (1024, 256, 256), 38, 1), ("qkv", 4096, (1024, 256, 256), 38, 8),
                                       ("down", 3584, (4096,), 38, 3)]:
        per = [[(torch.randn(r, d_in_s, device="cuda") / d_in_s ** 0.5, torch.randn(d, r, device="cuda"))
                for _ in range(2)] for d in outs]
        a, b, rk, offs = K.stack_decode_weights(per, 64, "column", 1)
        a, b = a.bfloat16(), b.bfloat16()
        idx = torch.tensor([1, 0, -1, 1, 0, 0, 1, -1][:t_s], device="cuda", dtype=torch.int32)
        xs = torch.randn(t_s, d_in_s, device="cuda", dtype=torch.bfloat16)
        y0 = torch.randn(t_s, offs[-1], device="cuda", dtype=torch.bfloat16)
        sc = torch.rand(2, device="cuda") + 0.5
        yk, ran = K.decode_lora(y0.clone(), xs, a, b, idx, rk, sc, offs)
        yk = yk.float()
        yr = K.decode_lora_ref(y0.float(), xs.float(), a.float(), b.float(), idx, rk, sc, offs, "column", 1)
        err = float((yk - yr).abs().max() / yr.abs().max())
        rows.append(dict(op=f"decode_lora[bf16,{name},t={t_s}]", backend=ran.backend,
                         max_rel_err=err, ok=err < 1e-2))
        # the same module with the shrink folded into the base GEMM: base + LoRA vs the unfolded fp32 reference
        folded = K.fold_weight(torch.randn(offs[-1], d_in_s, device="cuda") / d_in_s ** 0.5, len(outs), 2, 64)
        folded.lora_a(len(outs), 2, 64).copy_(a.float())
        folded = type(folded)(folded.w_ext.bfloat16(), folded.d_out)
        yk, ran = K.decode_lora_folded(xs, folded, b, idx, rk, sc, offs)
        yk = yk.float()
        yr = K.decode_lora_folded_ref(xs.float(), folded.w_ext.float(), folded.d_out, b.float(), idx, rk, sc, offs)
        err = float((yk - yr).abs().max() / yr.abs().max())
        rows.append(dict(op=f"decode_lora_folded[bf16,{name},t={t_s}]",
                         backend=ran.backend, max_rel_err=err, ok=err < 1e-2))
    rows += check_wider_factors(K)
    return rows


def check_wider_factors(K) -> list[dict]:
    """fp32 master factors beside a bf16 base (the engine's mixed-precision jobs): every path runs the products in
    bf16 with fp32 accumulation, so each is compared with the float64 reference on the factors rounded to bf16,
    within bf16 rounding (relative to each tensor's largest entry)."""
    rows = []
    torch.manual_seed(1)
    d_in, d_out, t = 256, 384, 300
    seg = [0, 1, 1, 180, t]
    x = torch.randn(t, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(d_out, d_in, device="cuda") / 16).bfloat16()
    wide = [make_adapter(K, d_in, d_out, r, lay, n, torch.float32) for r, lay, n in
            [(16, "column", 4), (64, "row", 4), (8, "column", 1), (32, "row", 2)]]
    rounded = [dataclasses.replace(ad, lora_A=ad.lora_A.detach().bfloat16().double().requires_grad_(),
                                   lora_B=ad.lora_B.detach().bfloat16().double().requires_grad_()) for ad in wide]
    x64 = x.detach().double().requires_grad_()
    gy = torch.randn(t, d_out, device="cuda", dtype=torch.bfloat16)
    yr = K.fused_lora_linear_ref(x64, w.double(), None, seg, rounded)
    gr = torch.autograd.grad(yr, [x64] + [p for ad in rounded for p in (ad.lora_A, ad.lora_B)], gy.double())
    for name, opts in [("triton", K.KernelOptions(backend="triton")), ("fuse_base", K.KernelOptions(fuse_base=True)),
                       ("cublas", K.KernelOptions(backend="cublas")), ("auto", None)]:
        y, ran = K.fused_lora_linear(x, w, None, seg, wide, **({"options": opts} if opts else {}))
        g = torch.autograd.grad(y, [x] + [p for ad in wide for p in (ad.lora_A, ad.lora_B)], gy)
        dtypes_ok = y.dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in g[1:])
        err = max(float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-6))
                  for a, b in zip([y.detach(), *g], [yr.detach(), *gr]))
        rows.append(dict(op=f"fused_lora_linear[{name},bf16 x,fp32 factors]", backend=ran.backend,
                         max_rel_err=err, ok=err < 3e-2 and dtypes_ok))
    return rows


def bench_layer(K, t, shapes, ranks, nbs, dropout, iters, batch=1) -> list[dict]:

    rows = []
    dt = torch.bfloat16
    for d_in, d_out in shapes:
        base = nn.Linear(d_in, d_out, bias=False, device="cuda", dtype=dt).requires_grad_(False)
        x = torch.randn(t, d_in, device="cuda", dtype=dt, requires_grad=True)
        gy = torch.randn(t, d_out, device="cuda", dtype=dt)
        t_base = timed(lambda: torch.autograd.grad(base(x), [x], gy), iters=iters, batch=batch)
        for layout in ("column", "row"):
            for r in ranks:
                for n in nbs:
                    ad = make_adapter(K, d_in, d_out, r, layout, n, dt, dropout)
                    peft_layer = PeftBdLayer(base, ad, dropout)
                    lp = [x, peft_layer.lora_a.weight, peft_layer.lora_b.weight]
                    kp = [x, ad.lora_A, ad.lora_B]
                    res = dict(d_in=d_in, d_out=d_out, layout=layout, r=r, N=n, base_only_ms=t_base)
                    res["peft_bd_ms"] = timed(lambda: torch.autograd.grad(peft_layer(x), lp, gy), iters=iters,
                                              batch=batch)
                    for name, kw in (("fused_ms", dict(backend="triton")),
                                     ("fused_base_ms", dict(backend="triton", fuse_base=True)),
                                     ("cublas_ms", dict(backend="cublas")),
                                     ("cublas_blocks_ms", dict(backend="cublas", bd_gemm="blocks")),
                                     ("cublas_maskdrop_ms", dict(backend="cublas"))):
                        opts = K.KernelOptions(fused_dropout=False if name == "cublas_maskdrop_ms" else None, **kw)
                        res[name] = timed(lambda: torch.autograd.grad(
                            K.fused_lora_linear(x, base.weight, None, [0, t], [ad], options=opts).out, kp, gy),
                            iters=iters, batch=batch)
                        if name == "cublas_ms":  # the default route's dropout and dS/dB (the byte model uses them)
                            ran = K.fused_lora_linear(x, base.weight, None, [0, t], [ad], options=opts).dispatch
                            res["cublas_dropout"] = ran.dropout[-1] if dropout else "none"
                            res["cublas_dsdb"] = ran.dsdb[-1]
                    # minimum traffic: fwd reads x, W, writes y; bwd reads dY, W, x (for dA), writes dX; + S, dS
                    lora_w = ad.lora_A.numel() + ad.lora_B.numel()
                    min_bytes = BF16 * (2 * t * d_in + 2 * d_in * d_out + 2 * t * d_out + t * d_in + 4 * t * r
                                        + 3 * lora_w)
                    # cublas path (cublas.py docstring): x read by shrink, base, dA; y written by the expand, read
                    # and written by the base epilogue; dY read by dS, dB (once for both with the dS/dB kernel),
                    # base dX; dX written by the LoRA dX, read and written by the base epilogue; dropout drawn inside
                    # the shrink, LoRA-dX and dA kernels adds nothing (the materialized route added x read, Xin
                    # write, keep (1 B) write + read, and the dX read + write of the masking)
                    y_passes = 5 if res["cublas_dsdb"] == "triton" else 6
                    cublas_bytes = (BF16 * (6 * t * d_in + y_passes * t * d_out + 2 * d_in * d_out + 4 * t * r
                                            + 3 * lora_w)
                                    + (10 * t * d_in if dropout > 0 and res["cublas_dropout"] != "triton" else 0))
                    flops = 4 * t * d_in * d_out + 6 * t * r * (d_in // ad.blocks_a + d_out // ad.blocks_b)
                    res["min_MB"] = min_bytes / 1e6
                    res["cublas_MB"] = cublas_bytes / 1e6
                    res["fused_TFLOPs"] = flops / res["fused_ms"] / 1e9
                    res["speedup_vs_peft"] = res["peft_bd_ms"] / res["fused_ms"]
                    res["cublas_vs_peft"] = res["peft_bd_ms"] / res["cublas_ms"]
                    res["maskdrop_vs_peft"] = res["peft_bd_ms"] / res["cublas_maskdrop_ms"]
                    res["blocks_vs_peft"] = res["peft_bd_ms"] / res["cublas_blocks_ms"]
                    rows.append(res)
    return rows


def bench_grouped(K, t, d, n_adapters_list, nblocks, iters) -> list[dict]:
    rows = []
    dt = torch.bfloat16
    rank_cycle = [16, 32, 64]
    x = torch.randn(t, d, device="cuda", dtype=dt, requires_grad=True)
    gy = torch.randn(t, d, device="cuda", dtype=dt)
    for n_ad in n_adapters_list:
        g = torch.Generator().manual_seed(n_ad)
        cuts = sorted(torch.randint(0, t, (n_ad - 1,), generator=g).tolist())
        seg = [0, *cuts, t]  # ragged segments
        adapters = [make_adapter(K, d, d, rank_cycle[i % 3], "column" if i % 2 == 0 else "row", nblocks, dt)
                    for i in range(n_ad)]
        params = [x] + [p for ad in adapters for p in (ad.lora_A, ad.lora_B)]

        def loop():
            y = torch.cat([K.lora_delta_ref(x[seg[i]:seg[i + 1]], ad) for i, ad in enumerate(adapters)])
            return torch.autograd.grad(y, params, gy)

        res = dict(T=t, d=d, N=nblocks, adapters=n_ad,
                   loop_ms=timed(loop, iters=iters),
                   grouped_ms=timed(lambda: torch.autograd.grad(K.grouped_lora(x, seg, adapters).out, params, gy),
                                    iters=iters))
        lora_bytes = sum(ad.lora_A.numel() + ad.lora_B.numel() for ad in adapters)
        # fwd: x, y; bwd: dY, x, dX; S/dS of rank width; weights read and grads written
        res["min_MB"] = BF16 * (5 * t * d + 4 * t * max(rank_cycle) + 4 * lora_bytes) / 1e6
        res["speedup"] = res["loop_ms"] / res["grouped_ms"]
        rows.append(res)
    return rows


def vllm_punica(max_loras: int, max_rank: int, max_tokens: int):
    """vLLM's own GPU LoRA path (PunicaWrapperGPU: the per-module shrink + expand Triton kernels a LoRA layer runs)
    when vLLM is importable, as (wrapper, set_mapping); else (None, reason). Same API in vLLM 0.26 and 0.32."""
    try:
        from vllm.config import LoRAConfig
        from vllm.lora.layers import LoRAMapping
        from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

        # LoRAConfig accepts only vLLM's rank sizes (8, 16, 32, 64, ...); the kernels take the rank from the tensors
        allowed_rank = max(8, 1 << (max_rank - 1).bit_length())
        wrapper = PunicaWrapperGPU(max_tokens, 256, "cuda",
                                   lora_config=LoRAConfig(max_lora_rank=allowed_rank, max_loras=max_loras))

        def set_mapping(slots: list[int]) -> None:  # token i -> LoRA slot slots[i] (ids are slot + 1)
            ids = tuple(s + 1 for s in slots)
            wrapper.update_metadata(LoRAMapping(ids, ids, is_prefill=False), list(range(1, max_loras + 1)),
                                    max_loras, 32000)

        return wrapper, set_mapping
    except Exception as e:  # not installed, or an API this script does not know
        return None, f"{type(e).__name__}: {e}"[:120]


def bench_decode(K, tokens, shapes, ranks, nbs, max_loras, iters) -> list[dict]:
    """Per module shape (name, d_in, output slices): decode_lora vs vLLM's punica shrink+expand vs a batched torch
    gather, timed eagerly and replayed from a CUDA graph (``graph_timed``, as in serving)."""
    from bdlora.kernels.decode import decode_grid, decode_tiles

    rows = []
    dt = torch.bfloat16
    for r in ranks:
        punica, set_mapping = vllm_punica(max_loras, r, max(tokens))
        if punica is None:
            print(f"vLLM punica column skipped: {set_mapping}")
        for name, d_in, slices in shapes:
            for n in nbs:
                per = [[(torch.randn(r, d_in, device="cuda", dtype=dt) / 64,
                         torch.randn(d, r // n, device="cuda", dtype=dt)) for _ in range(max_loras)] for d in slices]
                a, b, rk, offs = K.stack_decode_weights(per, r, "column", n)
                scales = torch.ones(max_loras, device="cuda")
                soff = torch.tensor(offs, dtype=torch.int32, device="cuda")
                dense_b = [torch.stack([unpack_block_diagonal(b[l, lo:hi], n) for l in range(max_loras)])
                           for lo, hi in zip(offs, offs[1:])]  # (L, d_s, r), zeros materialized (stock LoRA layout)
                for t in tokens:
                    x = torch.randn(t, d_in, device="cuda", dtype=dt)
                    y = torch.zeros(t, offs[-1], device="cuda", dtype=dt)
                    idx = (torch.arange(t, device="cuda") % max_loras).to(torch.int32)
                    grid = decode_grid(t, len(slices), n, max(slices) // n, d_in, r, decode_tiles(x.device))
                    ws = K.DecodeWorkspace("cuda").reserve(grid)

                    def fused():
                        K.decode_lora(y, x, a, b, idx, rk, scales, offs, nblocks=n, soff=soff, workspace=ws)

                    def gather():  # batched torch: per-token gathered weights (vLLM's CPU path does this)
                        for s, (lo, hi) in enumerate(zip(offs, offs[1:])):
                            sh = torch.einsum("tk,trk->tr", x, a[s][idx])
                            y[:, lo:hi] += torch.einsum("tr,tor->to", sh, dense_b[s][idx])

                    res = dict(module=name, tokens=t, r=r, N=n, slices="+".join(map(str, slices)),
                               programs=t * grid.n_groups * grid.k_splits, k_splits=grid.k_splits,
                               decode_ms=timed(fused, iters=iters), decode_graph_ms=graph_timed(fused, iters=iters),
                               torch_gather_ms=timed(gather, iters=iters), vllm_punica_ms="skipped")
                    if punica is not None:
                        # the stock layer's buffers: A (L, 1, r, d_in), B (L, 1, d_s, r) with the zeros of the
                        # block-diagonal factor materialized, as vLLM's default LoRA stores a BD adapter
                        a_st = tuple(a[s].unsqueeze(1).contiguous() for s in range(len(slices)))
                        b_st = tuple(d.unsqueeze(1).contiguous() for d in dense_b)
                        set_mapping(idx.tolist())

                        def stock():
                            punica.add_lora_linear(y, x, a_st, b_st, 1.0, tuple(slices))

                        try:
                            res["vllm_punica_ms"] = timed(stock, iters=iters)
                            res["vllm_punica_graph_ms"] = graph_timed(stock, iters=iters)
                            res["speedup_vs_punica"] = res["vllm_punica_ms"] / res["decode_ms"]
                            res["graph_speedup_vs_punica"] = res["vllm_punica_graph_ms"] / res["decode_graph_ms"]
                        except Exception as e:
                            res["vllm_punica_ms"] = f"error {type(e).__name__}"
                            print(f"vLLM punica call failed: {type(e).__name__}: {e}"[:300])
                    used = min(t, max_loras)
                    res["min_MB"] = BF16 * (t * d_in + 2 * t * offs[-1]
                                            + used * (len(slices) * r * d_in + offs[-1] * r // n)) / 1e6
                    res["GBps"] = res["min_MB"] / res["decode_graph_ms"]
                    rows.append(res)
    return rows


def bench_module(K, tokens, shapes, r, max_loras, iters) -> list[dict]:
    """Base GEMM + LoRA per module as a BD layer runs it in serving (bf16, replayed from a CUDA graph): base only;
    base GEMM + decode_lora (two launches); decode_lora_folded (one GEMM with [W; A] + one launch); base GEMM +
    vLLM's punica shrink + expand (zero-fill included) when importable."""
    from bdlora.kernels.decode import decode_grid, decode_tiles

    punica, set_mapping = vllm_punica(max_loras, r, max(tokens))
    if punica is None:
        print(f"vLLM punica column skipped: {set_mapping}")
    dt, rows = torch.bfloat16, []
    for name, d_in, slices in shapes:
        d_out = sum(slices)
        per = [[(torch.randn(r, d_in, device="cuda", dtype=dt) / 64, torch.randn(d, r, device="cuda", dtype=dt))
                for _ in range(max_loras)] for d in slices]
        a, b, rk, offs = K.stack_decode_weights(per, r)
        folded = K.fold_weight(torch.randn(d_out, d_in, device="cuda", dtype=dt) / 64, len(slices), max_loras, r)
        folded.lora_a(len(slices), max_loras, r).copy_(a)
        w = folded.base
        scales = torch.ones(max_loras, device="cuda")
        soff = torch.tensor(offs, dtype=torch.int32, device="cuda")
        a_st = tuple(a[s].unsqueeze(1).contiguous() for s in range(len(slices)))
        b_st = tuple(b[:, lo:hi].unsqueeze(1).contiguous() for lo, hi in zip(offs, offs[1:]))
        for t in tokens:
            x = torch.randn(t, d_in, device="cuda", dtype=dt)
            idx = (torch.arange(t, device="cuda") % max_loras).to(torch.int32)
            ws = K.DecodeWorkspace("cuda").reserve(decode_grid(t, len(slices), 1, max(slices), d_in, r,
                                                               decode_tiles(x.device)))

            def base():
                return torch.nn.functional.linear(x, w)

            def two_launch():
                K.decode_lora(base(), x, a, b, idx, rk, scales, offs, soff=soff, workspace=ws)

            def fold():
                K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, soff=soff)

            res = dict(module=name, tokens=t, r=r, loras=max_loras, slices="+".join(map(str, slices)),
                       base_graph_ms=graph_timed(base, iters=iters), two_launch_graph_ms=graph_timed(two_launch,
                                                                                                    iters=iters),
                       fold_graph_ms=graph_timed(fold, iters=iters), punica_graph_ms="skipped")
            if punica is not None:
                set_mapping(idx.tolist())

                def stock():
                    punica.add_lora_linear(base(), x, a_st, b_st, 1.0, tuple(slices))

                res["punica_graph_ms"] = graph_timed(stock, iters=iters)
            for k in ("two_launch", "fold", "punica"):
                if isinstance(res[k + "_graph_ms"], float):
                    res[k + "_lora_us"] = 1e3 * (res[k + "_graph_ms"] - res["base_graph_ms"])
            rows.append(res)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results.json")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dropout", type=float, default=0.1, help="LoRA dropout in the layer benchmark")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--batch", type=int, default=5, help="layer section: back-to-back calls per timing sample "
                    "(1 = synchronize after each call, host launch time included in full)")
    ap.add_argument("--quick", action="store_true", help="a smaller sweep (smoke test)")
    ap.add_argument("--sections", default="check,layer,grouped,decode,module",
                    help="comma-separated sections to run (default all; decode's vLLM column needs vLLM importable)")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    unknown = sections - {"check", "layer", "grouped", "decode", "module"}
    if unknown:
        ap.error(f"unknown section(s) {sorted(unknown)}; choose from check, layer, grouped, decode, module")
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU here; run it on a GPU machine. Nothing measured.")
        return 0
    import bdlora.kernels as K

    t0 = time.time()

    def save():  # after every section, so a run cut by a time limit keeps what it measured
        result["seconds"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype="bfloat16",
                  triton=__import__("triton").__version__, args=vars(args))
    if "check" in sections:
        result["check"] = check(K)
        table("check (fp32, vs torch reference)", result["check"])
        save()
        if not all(r["ok"] for r in result["check"]):
            print("correctness check FAILED; timings follow anyway")
    shapes = [(4096, 4096), (4096, 14336)]
    ranks, nbs = [16, 64], ([1, 4] if args.quick else [1, 4, 8])
    if "layer" in sections:
        result["layer"] = bench_layer(K, args.tokens, shapes, ranks, nbs, args.dropout, args.iters, args.batch)
        table(f"layer fwd+bwd, T={args.tokens}, dropout={args.dropout}, {args.batch} calls per sample (ms)",
              result["layer"])
        save()
    if "grouped" in sections:
        result["grouped"] = bench_grouped(K, args.tokens, 4096, [4, 8] if args.quick else [4, 8, 16, 32], 4,
                                          args.iters)
        table("grouped multi-adapter LoRA path fwd+bwd, ranks 16/32/64 mixed, layouts alternating (ms)",
              result["grouped"])
        save()
    if "decode" in sections:
        # Llama-3.1-8B: q/k/v at TP=1 with BD blocks on one GPU (N 1, 4), and every LoRA module of one layer at TP=4
        # as each GPU serves it (its own rank r/4 adapter, N=1 locally)
        tp1 = [("qkv", 4096, [4096, 1024, 1024])]
        tp4 = [("qkv", 4096, [1024, 256, 256]), ("o", 1024, [4096]), ("gate_up", 4096, [3584, 3584]),
               ("down", 3584, [4096])]
        result["decode"] = (bench_decode(K, [1, 4, 16, 64], tp1, [16, 64], [1, 4], 8, args.iters)
                            + bench_decode(K, [1, 8, 64], tp4, [8, 16], [1], 8, args.iters))
        table("decode LoRA per module (all slices in the same launches) (ms)", result["decode"])
        save()
    if "module" in sections:
        tp4 = [("qkv", 4096, [1024, 256, 256]), ("o", 1024, [4096]), ("gate_up", 4096, [3584, 3584]),
               ("down", 3584, [4096])]
        result["module"] = (bench_module(K, [1, 8], tp4, 38, 1, args.iters)
                            + bench_module(K, [1], tp4, 38, 4, args.iters))
        table("module decode: base GEMM + LoRA, one GPU of TP=4, BD rank 152/4 (ms; *_lora_us: over the base)",
              result["module"])
        save()
    print(f"\nwrote {args.out} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
