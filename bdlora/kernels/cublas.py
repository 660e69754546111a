"""The fused (BD-)LoRA linear layer composed from cuBLAS GEMMs: ``fused_lora_linear(..., backend="cublas")``.

Instead of Triton tiles, every product is one torch GEMM call (cuBLAS on CUDA, the CPU BLAS elsewhere) whose
alpha/beta epilogue carries the LoRA scale and the accumulation (``addmm_``/``baddbmm_`` in place, beta = 0 writes
without reading, beta = 1 accumulates), on views of the activations: one contiguous row slice per adapter segment,
and (bd_gemm="blocks") (N, T, d/N) block views with strides (d/N, d, 1) that cuBLAS takes as a strided batch
(batch stride d/N, leading dimension d) -- so no scale, add, cat or copy kernel ever touches an activation.

Per adapter i with rows R_i = seg[i]:seg[i+1] and c_i = scale_i / (1 - p_i) (p_i = 0 when dropout is off):

  forward                                                        activation traffic (T x d units)
    Xin_i = X[R_i] * keep_i        only with dropout: drop_i = ~keep_i (bool), Xin_i = X[R_i].masked_fill(drop_i, 0)
                                                                   read X, write Xin (+ bool masks)
    S_i   = c_i Xin_i @ A_i        addmm_(beta=0, alpha=c_i)      read Xin; S_i is (|R_i|, r), kept for backward
    Y[R_i] = S_i @ B_i             addmm_(beta=0)                 write Y (rows outside every segment: 0)
    Y    += X @ W^T                addmm_(beta=1): the frozen base GEMM adds onto it in its epilogue
  with a bias the order flips: Y = X W^T + bias (bias in the cuBLASLt epilogue), then Y[R_i] += S_i @ B_i (beta=1).
  backward
    dS_i   = dY[R_i] @ B_i^T       beta=0                         read dY
    dB_i   = S_i^T dY[R_i]                                        read dY
    dA_i   = c_i Xin_i^T dS_i                                     read Xin (= X without dropout)
    dX[R_i] = c_i dS_i @ A_i^T     beta=0                         write dX
    dX[R_i] *= keep_i              only with dropout: masked_fill_(drop_i, 0)   read dX + drop, write dX
    dX    += dY @ W                addmm_(beta=1)
  Saved for backward: X (only without dropout or for dW), Xin_i and drop_i (dropout), S_i, the factors.
  With dropout on CUDA (dense A_i, r_i <= 128; ``FUSED_DROPOUT``), the three products that touch the mask are
  Triton kernels of ``dropout.py`` that draw it from its counter hash where they read or write the element:
  S_i (drop_shrink: reads X once, no Xin, no mask), the LoRA dX (drop_expand_t: written masked, then the base
  GEMM adds onto it as above) and dA_i (drop_wgrad_a: reads X again); only X is saved. The materialized route
  (bernoulli, `logical_not`, masked_fill twice) took ~0.25 ms of a ~1 ms layer at 8192 x 4096 bf16 on an H200
  (bench/results/kernels/*profile*2026-11-22*).
  On CUDA, for B_i dense as the GEMMs see it and r_i <= 64 (``FUSED_DSDB``), dS_i and dB_i come from one Triton
  kernel that reads dY once (``dsdb_dense``, fp32 atomics; dY is the widest operand of an MLP up-projection:
  8192 x 14336, r 16 on an H200: 80 us vs 129 us for the two GEMMs).

Block-diagonal factors (see ``layout``: column layout has B block-diagonal, row layout A), bd_gemm:
  "dense"  expand the packed factor into its (M, K) block-diagonal matrix with zeros, once per call (r x d
           elements, 0.5 MB at r=64, d=4096), so each LoRA GEMM is one plain GEMM of exactly the shape of plain LoRA
           (which cuBLAS is tuned for, split-K for the weight gradients included); the zeros cost FLOPs, no
           activation bytes (at r <= 128 these GEMMs stay memory bound). Weight gradients are computed dense and
           their diagonal blocks gathered (r x d elements).
  "blocks" strided-batched GEMMs over the N blocks (``baddbmm_`` on block views, in place, no copies); no FLOPs
           on zeros, but per-block GEMMs as narrow as r/N columns and weight gradients with only N (d/N x r/N) outputs.
  "auto"   "dense" for rank <= 128, else "blocks" (per adapter).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import dispatch
from .dispatch import LAST_BACKEND
from .dropout import drop_expand_t, drop_shrink, drop_wgrad_a, dropout_keys, fused_ok, segment_keep_mask
from .layout import LoraAdapter

BD_GEMMS = ("auto", "dense", "blocks")
DENSE_MAX_RANK = 128

# Tests set this to fill every output buffer with NaN first, so elements a GEMM forgets (or reads with beta=0) fail.
POISON_OUTPUTS = False
# Dropout inside the LoRA-A products (``dropout.py`` kernels) instead of a materialized mask: None = on CUDA where
# they apply (dense A of rank <= 128), True = also under the CPU Triton interpreter (tests), False = never.
FUSED_DROPOUT: bool | None = None
# dS and dB of an adapter from one Triton kernel reading dY once (``dsdb_dense``) instead of two GEMMs that read it
# twice: None = on CUDA for B dense as the GEMMs see it and rank <= DSDB_MAX_RANK, True = also under the interpreter,
# False = never (dB then sums in a fixed order: the kernel's fp32 atomics are not bit-reproducible run to run).
FUSED_DSDB: bool | None = None
# Tiles and splits: the best of a sweep at 8192 rows x 4096 / 14336 columns, r 16 / 32 / 64 (H200, 2026-11-22;
# bench/kernels/tune_dsdb.py; bench/results/kernels/h200-dsdb-dense-sweep-shipped-*), as shipped: 8192 x 14336:
# r 16 80 us vs 129 us for the two GEMMs, r 32 92 vs 130, r 64 122 vs 133; 8192 x 4096: r 16 34 vs 50, r 64 45 vs
# 51. Not taken above rank 64 (not swept; the grouped path's dS/dB kernel spilled registers at rank 128, grouped.py).
DSDB_MAX_RANK = 64
DSDB_TILES = dict(BT=128, BN=128, num_warps=8, num_stages=3)


def _new(ref: torch.Tensor, *shape: int) -> torch.Tensor:
    out = ref.new_empty(shape)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def unpack_dense(w: torch.Tensor, nb: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Packed (M, K/nb) -> block-diagonal (M, K) with zeros, in ``dtype`` (default w's): one zero fill and one
    strided copy (which also casts)."""
    m, kb = w.shape
    full = w.new_zeros(m, kb * nb, dtype=dtype)
    full.view(nb, m // nb, nb, kb).diagonal(dim1=0, dim2=2).copy_(w.view(nb, m // nb, kb).permute(1, 2, 0))
    return full


def pack_dense(full: torch.Tensor, nb: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(M, K) -> its nb diagonal blocks packed (M, K/nb), in ``dtype`` (default full's): one small copy (none for
    nb = 1 in full's dtype)."""
    if nb == 1:
        return full.to(dtype or full.dtype)
    m, k = full.shape
    out = full.new_empty(nb, m // nb, k // nb, dtype=dtype)
    out.copy_(full.view(nb, m // nb, nb, k // nb).diagonal(dim1=0, dim2=2).permute(2, 0, 1))
    return out.view(m, k // nb)


def bd_mm_(out: torch.Tensor, inp: torch.Tensor, w: torch.Tensor, nb: int, alpha: float, beta: float) -> None:
    """out (T, M) = beta * out + alpha * inp (T, K) @ blockdiag(w)^T, w packed (M, K/nb); in place, no copies."""
    if nb == 1:
        out.addmm_(inp, w.t(), beta=beta, alpha=alpha)
        return
    t, (m, kb) = inp.shape[0], w.shape
    out.view(t, nb, m // nb).transpose(0, 1).baddbmm_(
        inp.view(t, nb, kb).transpose(0, 1), w.view(nb, m // nb, kb).transpose(1, 2), beta=beta, alpha=alpha)


def bd_mm_t_(out: torch.Tensor, inp: torch.Tensor, w: torch.Tensor, nb: int, alpha: float, beta: float) -> None:
    """out (T, K) = beta * out + alpha * inp (T, M) @ blockdiag(w), w packed (M, K/nb); in place, no copies."""
    if nb == 1:
        out.addmm_(inp, w, beta=beta, alpha=alpha)
        return
    t, (m, kb) = inp.shape[0], w.shape
    out.view(t, nb, kb).transpose(0, 1).baddbmm_(
        inp.view(t, nb, m // nb).transpose(0, 1), w.view(nb, m // nb, kb), beta=beta, alpha=alpha)


def bd_wgrad(gout: torch.Tensor, inp: torch.Tensor, nb: int, alpha: float, dense: bool,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gradient of a packed (M, K/nb) factor w used as gout-side of ``bd_mm_``: the nb diagonal blocks of
    alpha * gout (T, M)^T @ inp (T, K) -- dense (one GEMM, then gather the blocks) or per block (strided batch);
    returned in ``dtype`` (the factor's; default gout's), cast by the gather where there is one."""
    t, m, k = gout.shape[0], gout.shape[1], inp.shape[1]
    dtype = dtype or gout.dtype
    if nb == 1 or dense:
        return pack_dense(_new(gout, m, k).addmm_(gout.t(), inp, beta=0.0, alpha=alpha), nb, dtype)
    out = _new(gout, m, k // nb)
    out.view(nb, m // nb, k // nb).baddbmm_(gout.view(t, nb, m // nb).permute(1, 2, 0),
                                            inp.view(t, nb, k // nb).transpose(0, 1), beta=0.0, alpha=alpha)
    return out.to(dtype)


def dsdb_ok(dy: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``dsdb_dense`` runs for dY and a dense B (d_out, r) (see FUSED_DSDB)."""
    return b.shape[1] <= DSDB_MAX_RANK and dispatch.gpu_kernel_on(FUSED_DSDB, dy, b)


def dsdb_dense(dy: torch.Tensor, s: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dS, dB) = (dy @ b, dy^T @ s) in fp32 from one read of dy: dy (rows, d_out) with unit column stride, s (rows,
    r) and b (d_out, r) contiguous (``_dsdb_dense_kernel``; reference ``dsdb_dense_ref``)."""
    from ._triton import _dsdb_dense_kernel

    rows, (d_out, r) = dy.shape[0], b.shape
    ds = torch.zeros((rows, r), dtype=torch.float32, device=dy.device)
    db = torch.zeros((d_out, r), dtype=torch.float32, device=dy.device)  # its own storage: it may be returned as dB
    if rows == 0:
        return ds, db
    if dy.is_cuda:  # at most one wave of programs (row tiles x column splits; 64 x 2 at 8192 rows was best)
        tiles = DSDB_TILES
        split = max(2, min(16, dispatch.sm_count(dy.device) // dispatch.cdiv(rows, tiles["BT"])))
    else:  # small tiles under the interpreter, several splits and chunks per program
        tiles, split = dict(BT=16, BN=32, num_warps=4, num_stages=1), 2
    _dsdb_dense_kernel[(dispatch.cdiv(rows, tiles["BT"]), split)](
        ds, db, dy, s, b, rows, d_out, r, dy.stride(0), split,
        BLOCK_T=tiles["BT"], BLOCK_N=tiles["BN"], BLOCK_R=max(16, dispatch.next_pow2(r)),
        PREC=dispatch.dot_precision(dy.dtype), num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])
    return ds, db


def dsdb_dense_ref(dy: torch.Tensor, s: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``dsdb_dense`` (float64 in tests)."""
    return dy @ b, dy.t() @ s


class _Cfg:
    """Host-side description of one call (segments, per-adapter scale/dropout/blocks, GEMM mode)."""

    def __init__(self, seg: list[int], adapters: Sequence[LoraAdapter], seed: int | None, bd_gemm: str):
        if bd_gemm not in BD_GEMMS:
            raise ValueError(f"bd_gemm must be one of {BD_GEMMS}, got {bd_gemm!r}")
        self.seg, self.seed = seg, seed
        self.p = [ad.dropout if seed is not None else 0.0 for ad in adapters]
        self.c = [ad.scale / (1.0 - p) for ad, p in zip(adapters, self.p)]
        self.rank = [ad.rank for ad in adapters]
        self.nb_a = [ad.blocks_a for ad in adapters]
        self.nb_b = [ad.blocks_b for ad in adapters]
        self.dense = [bd_gemm == "dense" or (bd_gemm == "auto" and ad.rank <= DENSE_MAX_RANK) for ad in adapters]
        self.a_shapes = [tuple(ad.lora_a.shape) for ad in adapters]
        self.b_shapes = [tuple(ad.lora_b.shape) for ad in adapters]
        self.factor_dtypes = [(ad.lora_a.dtype, ad.lora_b.dtype) for ad in adapters]
        self.keys = [dropout_keys(seed, i) if p > 0 else None for i, p in enumerate(self.p)]
        self.fused = [False] * len(adapters)  # set by forward: adapter i's dropout runs in the Triton kernels


def _eff(w: torch.Tensor, nb: int, dense: bool, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The factor as the GEMMs read it, in the compute dtype: dense block-diagonal (blocks 1) or packed (nb
    blocks). The cast rides on the unpacking copy where there is one."""
    return (unpack_dense(w, nb, dtype), 1) if dense and nb > 1 else (w.to(dtype), nb)


class CublasLoraLinearFn(torch.autograd.Function):
    """Fused (BD-)LoRA linear from cuBLAS GEMMs. Inputs (cfg, x, weight, bias, a_0, b_0, a_1, b_1, ...):

        y = x @ weight^T + bias
        y[seg[i]:seg[i+1]] += scale_i * dropout_i(x[seg[i]:seg[i+1]]) @ A_i @ B_i

    with x (T, d_in), weight (d_out, d_in), bias (d_out,) or None, A_i = blockdiag(a_i)^T (d_in, r_i),
    B_i = blockdiag(b_i)^T (r_i, d_out) from the packed PEFT-orientation factors a_i (r_i, d_in/Na_i) and
    b_i (d_out, r_i/Nb_i) (``layout``), and dropout_i(u) = keep_i * u / (1 - p_i), keep_i the bool mask
    ``segment_keep_mask(seed, i, rows_i, d_in, p_i)`` (no dropout when cfg.seed is None or p_i = 0). With
    S_i = scale_i * dropout_i(x_i) @ A_i and g = dL/dy, the gradients are, per segment (rows R_i):

        dL/dx[R_i]  = g[R_i] @ weight + (scale_i / (1 - p_i)) * keep_i * ((g[R_i] @ B_i^T) @ A_i^T)
        dL/dx[rows in no segment] = g @ weight
        dL/dA_i     = scale_i * dropout_i(x_i)^T (g[R_i] @ B_i^T)   (its diagonal blocks, packed like a_i)
        dL/dB_i     = S_i^T g[R_i]                                   (its diagonal blocks, packed like b_i)
        dL/dweight  = g^T x,   dL/dbias = sum over rows of g

    Every product is one GEMM with its scale in alpha and its accumulation in beta (module docstring).
    Factors may be stored in another floating dtype than x and weight (fp32 master weights beside a bf16 base):
    the products then run in x's dtype, as under ``torch.autocast``, and the factors' gradients come back in the
    factors' own dtype (the cast rides on the block gather / unpack copies where there is one).
    Adapters of empty segments get zero gradients. Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, cfg: _Cfg, x, weight, bias, *factors):
        t, d_in = x.shape
        seg = cfg.seg
        nig = ctx.needs_input_grad
        lora_s, lora_b, saved = [], [], []
        for i in range(len(cfg.c)):
            a_eff, na = _eff(factors[2 * i], cfg.nb_a[i], cfg.dense[i], x.dtype)
            b_eff, nb = _eff(factors[2 * i + 1], cfg.nb_b[i], cfg.dense[i], x.dtype)
            s0, s1 = seg[i], seg[i + 1]
            s = xin = drop = None
            if s1 > s0:
                xin = x[s0:s1]
                s = _new(x, s1 - s0, cfg.rank[i])
                cfg.fused[i] = cfg.p[i] > 0 and fused_ok(x, a_eff, FUSED_DROPOUT)
                if cfg.p[i] > 0:
                    LAST_BACKEND["cublas_dropout"] = "triton" if cfg.fused[i] else "mask"
                if cfg.fused[i]:  # mask drawn in the kernel, again in backward: nothing but x saved
                    drop_shrink(s, xin, a_eff, cfg.keys[i], cfg.p[i], cfg.c[i])
                    xin = None
                else:
                    if cfg.p[i] > 0:
                        drop = segment_keep_mask(cfg.seed, i, s1 - s0, d_in, cfg.p[i], x.device).logical_not_()
                        xin = xin.masked_fill(drop, 0)
                    bd_mm_(s, xin, a_eff, na, cfg.c[i], 0.0)
            lora_s.append(s)
            lora_b.append((b_eff, nb))
            saved += [a_eff, b_eff, s, xin if drop is not None else None, drop]
        if bias is None:  # LoRA first, then the base GEMM accumulates onto it (beta=1) in its epilogue
            y = _new(x, t, weight.shape[0])
            y[: seg[0]].zero_()
            y[seg[-1]:].zero_()
            for i, s in enumerate(lora_s):
                if s is not None:
                    bd_mm_(y[seg[i]:seg[i + 1]], s, *lora_b[i], 1.0, 0.0)
            y.addmm_(x, weight.t())
        else:  # base GEMM + bias (cuBLASLt epilogue) first, LoRA added in place
            y = F.linear(x, weight, bias)
            for i, s in enumerate(lora_s):
                if s is not None:
                    bd_mm_(y[seg[i]:seg[i + 1]], s, *lora_b[i], 1.0, 1.0)
        # x itself is needed for dW, and for dA of adapters without dropout or with it fused
        need_x = nig[2] or any(nig[4 + 2 * i] and (cfg.p[i] == 0 or cfg.fused[i]) for i in range(len(cfg.c)))
        ctx.cfg, ctx.x_shape, ctx.has_bias = cfg, (t, d_in), bias is not None
        ctx.save_for_backward(x if need_x else None, weight, *saved)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        cfg: _Cfg = ctx.cfg
        x, weight, *saved = ctx.saved_tensors
        nig = ctx.needs_input_grad
        seg, (t, d_in) = cfg.seg, ctx.x_shape
        dy = dy.contiguous()
        dx = None
        if nig[1]:
            dx = _new(dy, t, d_in)
            dx[: seg[0]].zero_()
            dx[seg[-1]:].zero_()
        grads = []
        for i in range(len(cfg.c)):
            a_eff, b_eff, s, xin, drop = saved[5 * i:5 * i + 5]
            need_da, need_db = nig[4 + 2 * i], nig[5 + 2 * i]
            s0, s1 = seg[i], seg[i + 1]
            a_dtype, b_dtype = cfg.factor_dtypes[i]
            if s1 == s0:
                grads += [dy.new_zeros(cfg.a_shapes[i], dtype=a_dtype) if need_da else None,
                          dy.new_zeros(cfg.b_shapes[i], dtype=b_dtype) if need_db else None]
                continue
            na, nb = (1 if cfg.dense[i] else cfg.nb_a[i]), (1 if cfg.dense[i] else cfg.nb_b[i])
            dyi = dy[s0:s1]
            need_ds = need_da or dx is not None
            da = db = ds = None
            if need_ds and need_db and nb == 1 and dsdb_ok(dyi, b_eff):  # dS and dB from one read of dY
                LAST_BACKEND["cublas_dsdb"] = "triton"
                ds, db = dsdb_dense(dyi, s, b_eff)
                db = pack_dense(db, cfg.nb_b[i], b_dtype)
                ds = ds if cfg.fused[i] else ds.to(dy.dtype)  # the dropout kernels round fp32 dS themselves
            else:
                LAST_BACKEND["cublas_dsdb"] = "cublas"
                db = bd_wgrad(dyi, s, cfg.nb_b[i], 1.0, cfg.dense[i], b_dtype) if need_db else None
                if need_ds:
                    ds = _new(dy, s1 - s0, cfg.rank[i])
                    bd_mm_t_(ds, dyi, b_eff, nb, 1.0, 0.0)
            if need_ds:
                if need_da and cfg.fused[i]:
                    da = pack_dense(drop_wgrad_a(x[s0:s1], ds, cfg.keys[i], cfg.p[i], cfg.c[i]), cfg.nb_a[i], a_dtype)
                elif need_da:
                    da = bd_wgrad(ds, x[s0:s1] if xin is None else xin, cfg.nb_a[i], cfg.c[i], cfg.dense[i],
                                  a_dtype)
                if dx is not None and cfg.fused[i]:
                    drop_expand_t(dx[s0:s1], ds, a_eff, cfg.keys[i], cfg.p[i], cfg.c[i])
                elif dx is not None:
                    dxi = dx[s0:s1]
                    bd_mm_t_(dxi, ds, a_eff, na, cfg.c[i], 0.0)
                    if drop is not None:
                        dxi.masked_fill_(drop, 0)
            grads += [da, db]
        if dx is not None:
            dx.addmm_(dy, weight)  # base dX accumulates onto the LoRA dX in the GEMM epilogue
        dw = dy.t() @ x if nig[2] else None
        dbias = dy.sum(0) if ctx.has_bias and nig[3] else None
        return (None, dx, dw, dbias, *grads)


def cublas_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seg: list[int],
                       adapters: Sequence[LoraAdapter], seed: int | None, bd_gemm: str = "auto") -> torch.Tensor:
    """Apply ``CublasLoraLinearFn`` (arguments already validated by ``fused_lora_linear``; seg a host list)."""
    cfg = _Cfg(seg, adapters, seed, bd_gemm)
    factors = [t.contiguous() for ad in adapters for t in (ad.lora_a, ad.lora_b)]
    return CublasLoraLinearFn.apply(cfg, x.contiguous(), weight, bias, *factors)
