"""Tile sweep of the cuBLAS path's dropout kernels (bdlora/kernels/dropout.py) at 8192 rows, bf16, one GPU.

    python bench/kernels/tune_dropout.py      # writes $OUT/tune.json (or ./tune.json), prints the best tiles

For d_in x r in (4096 x 16, 4096 x 64, 14336 x 16): the plain GEMMs the kernels replace, torch's bernoulli mask
draw and masked_fill, then every tile config of drop_shrink / drop_expand_t / drop_wgrad_a (checked against an fp32
reference), fastest first. ``dropout.GPU_TILES`` holds the pick. Needs CUDA.
"""
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from triton.testing import do_bench  # noqa: E402
from tune_common import run_on_gpu, summarize, write_out  # noqa: E402

from bdlora.kernels import dropout as KT  # noqa: E402  (the kernels sit beside their launchers)
from bdlora.kernels import dropout as D  # noqa: E402


def sweep(rows, d_in, r, dt=torch.bfloat16):
    x = torch.randn(rows, d_in, device="cuda", dtype=dt)
    a = torch.randn(r, d_in, device="cuda", dtype=dt) / 64
    ds = torch.randn(rows, r, device="cuda", dtype=dt)
    keys, p, alpha = D.dropout_keys(3, 0), 0.1, 2.0
    thr, rp = D.keep_threshold(p), max(16, r)
    keep = D.keep_mask_triton(keys, rows, d_in, p, "cuda")
    refs = dict(shrink=alpha * (x.float() * keep) @ a.float().t(), expand=alpha * keep * (ds.float() @ a.float()),
                wgrad=alpha * ds.float().t() @ (x.float() * keep))
    base = dict(gemm_xa=do_bench(lambda: x @ a.t()), gemm_dsa=do_bench(lambda: ds @ a),
                gemm_da=do_bench(lambda: ds.t() @ x),
                bernoulli=do_bench(lambda: torch.empty(rows, d_in, dtype=torch.bool, device="cuda").bernoulli_(0.9)),
                masked_fill=do_bench(lambda: x.masked_fill(~keep, 0)))
    res = dict(base=base, shrink=[], expand=[], wgrad=[])
    s = torch.empty(rows, r, device="cuda", dtype=dt)
    dx = torch.empty(rows, d_in, device="cuda", dtype=dt)
    common = dict(R=rp, PREC="tf32")

    def run(kind, cfg, launch, out):
        try:
            result = launch()
            got = result if out is None else out
            err = float((got.float() - refs[kind]).abs().max() / refs[kind].abs().max())
            res[kind].append(dict(cfg, ms=do_bench(launch), err=err))
        except Exception as e:  # a config that does not compile (shared memory) is recorded, not fatal
            res[kind].append(dict(cfg, error=str(e)[:100]))

    for bt, bk, w, st in itertools.product([32, 64], [64, 128], [4, 8], [3, 4]):
        run("shrink", dict(bt=bt, bk=bk, w=w, st=st), lambda: KT._drop_shrink_kernel[(triton.cdiv(rows, bt),)](
            x, a, s, rows, d_in, r, x.stride(0), *keys, thr, alpha, BLOCK_T=bt, BLOCK_K=bk, num_warps=w,
            num_stages=st, **common), s)
    for bt, bk in itertools.product([32, 64, 128], [64, 128, 256]):
        grid = (triton.cdiv(rows, bt), triton.cdiv(d_in, bk))
        run("expand", dict(bt=bt, bk=bk), lambda: KT._drop_expand_t_kernel[grid](
            ds, a, dx, rows, d_in, r, dx.stride(0), *keys, thr, alpha, BLOCK_T=bt, BLOCK_K=bk, num_warps=4,
            num_stages=1, **common), dx)
    for bt, bk, w, target in itertools.product([32, 64, 128], [32, 64, 128], [4, 8], [264, 528, 1056]):
        n_k = triton.cdiv(d_in, bk)
        splits = max(1, min(triton.cdiv(rows, 4 * bt), target // n_k))
        per = triton.cdiv(triton.cdiv(rows, splits), bt) * bt
        splits = triton.cdiv(rows, per)
        part = torch.empty(splits, r, d_in, device="cuda")

        def wgrad():
            KT._drop_wgrad_a_kernel[(n_k, splits)](x, ds, part, rows, d_in, r, x.stride(0), *keys, thr, per,
                                                   BLOCK_T=bt, BLOCK_K=bk, num_warps=w, num_stages=3, **common)
            return part.sum(0).mul_(alpha)
        run("wgrad", dict(bt=bt, bk=bk, w=w, target=target), wgrad, None)
    sd = torch.empty(rows, r, device="cuda", dtype=dt)
    res["default"] = dict(shrink=do_bench(lambda: D.drop_shrink(sd, x, a, keys, p, alpha)),
                          expand=do_bench(lambda: D.drop_expand_t(dx, ds, a, keys, p, alpha)),
                          wgrad=do_bench(lambda: D.drop_wgrad_a(x, ds, keys, p, alpha)))
    return res


def main():
    out = {}
    for d_in, r in [(4096, 16), (4096, 64), (14336, 16)]:
        res = out[f"{d_in}_r{r}"] = sweep(8192, d_in, r)
        us = lambda d: {k: round(v * 1000, 1) for k, v in d.items()}  # noqa: E731
        print(f"== {d_in}_r{r} torch ops (us) {us(res['base'])}; defaults (us) {us(res['default'])}")
        for kind in ("shrink", "expand", "wgrad"):
            best, wrong, failed = summarize(res[kind], 2e-2, 4)
            print(kind, "best (us, tiles):", best, "| wrong:", wrong, "| failed:", failed, flush=True)
    write_out("tune.json", out)


if __name__ == "__main__":
    run_on_gpu(main, "tune_dropout")
