"""Tile sweep of the cuBLAS layer's dS/dB kernel (``cublas.dsdb_dense``: dS = dY @ B and dB = dY^T @ S from one
read of dY) against the two GEMMs it replaces, at 8192 rows, bf16, one GPU.

    python bench/kernels/tune_dsdb.py      # writes $OUT/tune_dsdb.json (or ./tune_dsdb.json), prints the best

For d_out in (4096, 14336) and r in (16, 32, 64): the two GEMMs (dY @ B, dY^T @ S), every (row tile, column chunk,
column splits, warps) of ``_dsdb_dense_kernel`` (checked against an fp32 reference), fastest first, and
``dsdb_dense`` as shipped. ``cublas.DSDB_TILES`` / ``DSDB_MAX_RANK`` hold the pick. Needs CUDA.
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

from bdlora.kernels import cublas as KT  # noqa: E402  (the kernels sit beside their launchers)
from bdlora.kernels import cublas as C  # noqa: E402


def sweep(rows, d_out, r, dt=torch.bfloat16):
    dy = torch.randn(rows, d_out, device="cuda", dtype=dt)
    s = torch.randn(rows, r, device="cuda", dtype=dt)
    b = torch.randn(d_out, r, device="cuda", dtype=dt) / 8
    ref_ds, ref_db = C.dsdb_dense_ref(dy.float(), s.float(), b.float())
    res = dict(two_gemms=do_bench(lambda: (dy @ b, dy.t() @ s)), tiles=[])
    ds = torch.empty(rows, r, device="cuda")
    db = torch.empty(d_out, r, device="cuda")
    for bt, bn, split, w in itertools.product([64, 128], [64, 128], [2, 4, 8], [4, 8]):
        def launch():
            ds.zero_()
            db.zero_()
            KT._dsdb_dense_kernel[(triton.cdiv(rows, bt), split)](
                ds, db, dy, s, b, rows, d_out, r, dy.stride(0), split, BLOCK_T=bt, BLOCK_N=bn,
                BLOCK_R=max(16, r), PREC="tf32", num_warps=w, num_stages=3)
        cfg = dict(bt=bt, bn=bn, split=split, w=w)
        try:
            launch()
            err = max(float((ds - ref_ds).abs().max() / ref_ds.abs().max()),
                      float((db - ref_db).abs().max() / ref_db.abs().max()))
            res["tiles"].append(dict(cfg, ms=do_bench(launch), err=err))
        except Exception as e:  # a config that does not compile (shared memory) is recorded, not fatal
            res["tiles"].append(dict(cfg, error=str(e)[:100]))
    res["default"] = do_bench(lambda: C.dsdb_dense(dy, s, b))
    return res


def main():
    out = {}
    for d_out, r in itertools.product([4096, 14336], [16, 32, 64]):
        res = out[f"{d_out}_r{r}"] = sweep(8192, d_out, r)
        best, wrong, failed = summarize(res["tiles"], 1e-2, 3)
        print(f"== 8192 x {d_out} r {r}: two GEMMs {res['two_gemms'] * 1000:.1f} us, dsdb_dense as shipped "
              f"{res['default'] * 1000:.1f} us; best (us, tiles): {best} | wrong: {wrong} | failed: {failed}",
              flush=True)
    write_out("tune_dsdb.json", out)


if __name__ == "__main__":
    run_on_gpu(main, "tune_dsdb")
