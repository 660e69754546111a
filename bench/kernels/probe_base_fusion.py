"""Probes of two ways to fold the LoRA products into the frozen base GEMMs (to drop the LoRA output write and
a read of dY), kept because both lost on an H200 (results in BENCHMARKS.md, raw in bench/results/kernels/
h200-probe-base-fusion-2026-11-22.json):

  concat  LoRA as extra K columns of cuBLAS's base GEMM: Y = [X | S] @ [W | c B]^T (forward, X copied next to S)
          and [dX_base | dS] = dY @ [W | c B] (backward, dS for free). cuBLAS runs K = 4096 + r (or N = 4096 + r)
          slower than 4096 by about what the separate LoRA GEMMs cost.
  triton  Y = X W^T + S B^T in one Triton GEMM (the LoRA product as an epilogue), several tile configs: the plain
          Triton GEMM alone stays ~25% behind cuBLAS at these shapes, far more than the ~0.1 ms it would save.

    python bench/kernels/probe_base_fusion.py      # writes $OUT/probe_base_fusion.json (or ./...)
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

T = 8192


@triton.jit
def gemm_lora_kernel(y_ptr, x_ptr, w_ptr, s_ptr, b_ptr, M, N, K, R: tl.constexpr, LORA: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """y (M, N) = x (M, K) @ w (N, K)^T [+ s (M, R) @ b (N, R)^T]; M, N, K multiples of the tiles (probe only)."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gsz = tl.minimum(num_m - first_m, GROUP_M)
    pm, pn = first_m + (pid % group) % gsz, (pid % group) // gsz
    rm, rn, rk = pm * BM + tl.arange(0, BM), pn * BN + tl.arange(0, BN), tl.arange(0, BK)
    xp, wp = x_ptr + rm[:, None] * K + rk[None, :], w_ptr + rn[None, :] * K + rk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BK)):
        acc = tl.dot(tl.load(xp), tl.load(wp), acc)
        xp += BK
        wp += BK
    if LORA:
        rr = tl.arange(0, R)
        acc = tl.dot(tl.load(s_ptr + rm[:, None] * R + rr[None, :]), tl.load(b_ptr + rn[None, :] * R + rr[:, None]),
                     acc)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty))


def us(fn):
    return round(do_bench(fn) * 1000, 1)


def probe(d_in, d_out, r, dt=torch.bfloat16):
    x = torch.randn(T, d_in, device="cuda", dtype=dt)
    w = torch.randn(d_out, d_in, device="cuda", dtype=dt) / 64
    a = torch.randn(r, d_in, device="cuda", dtype=dt) / 64
    b = torch.randn(d_out, r, device="cuda", dtype=dt) / 8
    dy = torch.randn(T, d_out, device="cuda", dtype=dt)
    s = x @ a.t()
    y = torch.empty(T, d_out, device="cuda", dtype=dt)
    dx = torch.empty(T, d_in, device="cuda", dtype=dt)
    ds = torch.empty(T, r, device="cuda", dtype=dt)
    res = dict(d_in=d_in, d_out=d_out, r=r)
    # what the cuBLAS layer runs now (forward: LoRA written, base GEMM adds with beta=1; backward: dS GEMM, base
    # dX GEMM with beta=1 onto the LoRA dX)
    res["base_fwd"] = us(lambda: torch.mm(x, w.t(), out=y))
    res["layer_fwd_expand_then_base"] = us(lambda: (y.addmm_(s, b.t(), beta=0), y.addmm_(x, w.t())))
    res["base_dx"] = us(lambda: torch.mm(dy, w, out=dx))
    res["layer_bwd_ds_lora_dx_base"] = us(lambda: (torch.mm(dy, b, out=ds), dx.addmm_(ds, a, beta=0),
                                                   dx.addmm_(dy, w)))
    for pad in sorted({r, -(-r // 64) * 64}):  # K / N grown by r, or by r rounded up to 64
        wc = torch.zeros(d_out, d_in + pad, device="cuda", dtype=dt)
        wc[:, :d_in], wc[:, d_in:d_in + r] = w, b
        xc = torch.zeros(T, d_in + pad, device="cuda", dtype=dt)
        xc[:, d_in:d_in + r] = s
        g = torch.empty(T, d_in + pad, device="cuda", dtype=dt)
        res[f"concat{pad}_fwd_copy_x_then_gemm"] = us(lambda: (xc[:, :d_in].copy_(x), torch.mm(xc, wc.t(), out=y)))
        res[f"concat{pad}_bwd_gemm_then_lora_dx"] = us(lambda: (torch.mm(dy, wc, out=g),
                                                                g[:, :d_in].addmm_(g[:, d_in:d_in + r], a)))
    ref = (x.float() @ w.float().t() + s.float() @ b.float().t())
    for bm, bn, bk, nw, st in [(128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 128, 8, 3)]:
        for lora in (False, True):
            grid = (triton.cdiv(T, bm) * triton.cdiv(d_out, bn),)
            run = lambda: gemm_lora_kernel[grid](y, x, w, s, b, T, d_out, d_in, R=r, LORA=lora, BM=bm, BN=bn, BK=bk,
                                                 GROUP_M=8, num_warps=nw, num_stages=st)  # noqa: E731
            key = f"triton_{bm}x{bn}x{bk}_w{nw}_s{st}_{'lora' if lora else 'base'}"
            try:
                run()
                if lora:
                    assert float((y.float() - ref).abs().max() / ref.abs().max()) < 2e-2
                res[key] = us(run)
            except Exception as e:  # a config that does not compile is recorded, not fatal
                res[key] = str(e)[:100]
    return res


def main():
    rows = [probe(d_in, d_out, r) for d_in, d_out in [(4096, 4096), (4096, 14336)] for r in (16, 64)]
    for row in rows:
        print(json.dumps(row), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "probe_base_fusion.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("probe_base_fusion: no CUDA GPU here")
        sys.exit(0)
    main()
