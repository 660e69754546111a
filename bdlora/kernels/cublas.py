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
  With dropout on CUDA (dense A_i, r_i <= 128; ``KernelOptions.fused_dropout``), the three products that touch the mask are
  Triton kernels of ``dropout.py`` that draw it from its counter hash where they read or write the element:
  S_i (drop_shrink: reads X once, no Xin, no mask), the LoRA dX (drop_expand_t: written masked, then the base
  GEMM adds onto it as above) and dA_i (drop_wgrad_a: reads X again); only X is saved. The materialized route
  (bernoulli, `logical_not`, masked_fill twice) took ~0.25 ms of a ~1 ms layer at 8192 x 4096 bf16 on an H200.
  On CUDA, for B_i dense as the GEMMs see it and r_i <= 64 (``KernelOptions.fused_dsdb``), dS_i and dB_i come from one Triton
  kernel that reads dY once (``dsdb_dense``, fp32 atomics; dY is the widest operand of an MLP up-projection:
  8192 x 14336, r 16 on an H200: 80 us vs 129 us for the two GEMMs).

Block-diagonal factors (see ``bdlora.layout``: column layout has B block-diagonal, row layout A), bd_gemm:
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

from types import MappingProxyType
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from bdlora.layout import LoraFactors, pack_block_diagonal, unpack_block_diagonal

from . import dispatch
from ._jit import dot, jit, tl
from .dispatch import KernelOptions, new_output, rows, zero_outside_segments
from .dropout import drop_expand_t, drop_shrink, drop_wgrad_a, dropout_keys, fused_ok, segment_keep_mask
from .launch import launch

BD_GEMMS = ("auto", "dense", "blocks")
DENSE_MAX_RANK = 128

# Tiles and splits: the best of a sweep at 8192 rows x 4096 / 14336 columns, r 16 / 32 / 64 (H200), as shipped:
# 8192 x 14336:
# r 16 80 us vs 129 us for the two GEMMs, r 32 92 vs 130, r 64 122 vs 133; 8192 x 4096: r 16 34 vs 50, r 64 45 vs
# 51. Not taken above rank 64 (not swept; the grouped path's dS/dB kernel spilled registers at rank 128, grouped.py).
DSDB_MAX_RANK = 64
DSDB_TILES = MappingProxyType(dict(BT=128, BN=128, num_warps=8, num_stages=3))  # read-only data


@jit
def _dsdb_chunks(db_ptr, dy_ptr, b_ptr, s_tile, rows, rmask, rr, rrmask, stride_dy, o_lo, width, rb, boff,
                 first, step, rot, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                 PREC: tl.constexpr, DB_BLOCKS: tl.constexpr):
    """The shared body of the dS/dB kernels: over the BLOCK_N column chunks c = first, first + step, ... of output
    columns [o_lo, o_lo + width) (visited rotated by ``rot``, so concurrent programs add into different dB rows):

        returns sum_c dY[rows, c] @ B[c, rr]               (fp32 (BLOCK_T, BLOCK_R), the caller stores it)
        dB[c, rr] += dY[rows, c]^T @ s_tile                 (fp32 atomics; s_tile = S[rows, rr])

    with B stored (d_out, rb) row-major at b_ptr + boff (dB alike at db_ptr + boff). DB_BLOCKS > 1 (o_lo and boff
    0): B is block-diagonal with that many blocks, its zeros stored, and only dB's diagonal blocks are added, packed
    (d_out, rb / DB_BLOCKS) as ``pack_block_diagonal`` lays them out: a DB_BLOCKS-th of the atomics."""
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    n_ch = tl.cdiv(width, BLOCK_N)
    for it in range(first, n_ch, step):
        os_ = o_lo + ((it + rot) % n_ch) * BLOCK_N + tl.arange(0, BLOCK_N)
        omask = os_ < o_lo + width
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + os_[None, :],
                     mask=rmask[:, None] & omask[None, :], other=0.0)
        bmask = omask[:, None] & rrmask[None, :]
        bidx = boff + os_[:, None] * rb + rr[None, :]
        b = tl.load(b_ptr + bidx, mask=bmask, other=0.0)
        acc += dot(dy, b, PREC)
        db = dot(tl.trans(dy), s_tile, PREC)
        if DB_BLOCKS == 1:
            tl.atomic_add(db_ptr + bidx, db, mask=bmask, sem="relaxed")
        else:
            rbp = rb // DB_BLOCKS
            rblk = rr // rbp
            diag = bmask & ((os_ // (width // DB_BLOCKS))[:, None] == rblk[None, :])
            tl.atomic_add(db_ptr + os_[:, None] * rbp + (rr - rblk * rbp)[None, :], db, mask=diag, sem="relaxed")
    return acc


# rows and splits change with every micro-batch: a variant per divisibility pattern would compile mid-run
@jit(do_not_specialize=["rows_total", "col_split"])
def _dsdb_dense_kernel(ds_ptr, db_ptr, dy_ptr, s_ptr, b_ptr, rows_total, d_out, r, stride_dy, col_split,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr,
                       DB_BLOCKS: tl.constexpr):
    """One adapter, dense B (d_out, r), every row (the cuBLAS layer's segment): dY read once for both products,

    dS[t, :] += dY[t, :] @ B          dB += dY^T @ S            (fp32 atomics into zeroed ds (rows, r), db (d_out, r))

    With DB_BLOCKS > 1, B is block-diagonal (zeros stored) and db holds only dB's diagonal blocks, packed
    (d_out, r / DB_BLOCKS).

    Program (row tile, c) takes every col_split-th BLOCK_N column chunk. dy has unit column stride; s and b
    are contiguous. Grid: (cdiv(rows, BLOCK_T), col_split)."""
    tile = tl.program_id(0)
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < rows_total
    rr = tl.arange(0, BLOCK_R)
    rrmask = rr < r
    smask = rmask[:, None] & rrmask[None, :]
    s_tile = tl.load(s_ptr + rows[:, None] * r + rr[None, :], mask=smask, other=0.0)
    acc = _dsdb_chunks(db_ptr, dy_ptr, b_ptr, s_tile, rows, rmask, rr, rrmask, stride_dy, 0, d_out, r, 0,
                       tl.program_id(1), col_split, tile, BLOCK_T, BLOCK_N, BLOCK_R, PREC, DB_BLOCKS)
    tl.atomic_add(ds_ptr + rows[:, None] * r + rr[None, :], acc, mask=smask, sem="relaxed")


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
             dtype: torch.dtype | None = None, options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """Gradient of a packed (M, K/nb) factor w used as gout-side of ``bd_mm_``: the nb diagonal blocks of
    alpha * gout (T, M)^T @ inp (T, K) -- dense (one GEMM, then gather the blocks) or per block (strided batch);
    returned in ``dtype`` (the factor's; default gout's), cast by the gather where there is one."""
    t, m, k = gout.shape[0], gout.shape[1], inp.shape[1]
    dtype = dtype or gout.dtype
    if nb == 1 or dense:
        return pack_block_diagonal(new_output(gout, (m, k), options).addmm_(gout.t(), inp, beta=0.0, alpha=alpha), nb, dtype)
    out = new_output(gout, (m, k // nb), options)
    out.view(nb, m // nb, k // nb).baddbmm_(gout.view(t, nb, m // nb).permute(1, 2, 0),
                                            inp.view(t, nb, k // nb).transpose(0, 1), beta=0.0, alpha=alpha)
    return out.to(dtype)


def dsdb_ok(dy: torch.Tensor, b: torch.Tensor, enabled: bool | None = None) -> bool:
    """Whether ``dsdb_dense`` runs for dY (or a tensor of its dtype and device) and a dense B (d_out, r):
    ``enabled`` is ``KernelOptions.fused_dsdb`` (None = on CUDA, True = also under the interpreter, False = never);
    rank at most DSDB_MAX_RANK."""
    return b.shape[1] <= DSDB_MAX_RANK and dispatch.gpu_kernel_on(enabled, dy, b)


def dsdb_dense(dy: torch.Tensor, s: torch.Tensor, b: torch.Tensor, db_blocks: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dS, dB) = (dy @ b, dy^T @ s) in fp32 from one read of dy: dy (rows, d_out) with unit column stride, s (rows,
    r) and b (d_out, r) contiguous (``_dsdb_dense_kernel``; reference ``dsdb_dense_ref``). ``db_blocks`` N > 1: b is
    block-diagonal with N blocks (zeros stored, as the layer's dense GEMMs read it) and dB comes back packed, its N
    diagonal blocks (d_out, r/N) (``pack_block_diagonal``'s layout): no dense dB is accumulated or gathered."""
    rows, (d_out, r) = dy.shape[0], b.shape
    if db_blocks < 1 or r % db_blocks or d_out % db_blocks:
        raise ValueError(f"dsdb_dense: db_blocks {db_blocks} does not divide B's shape {(d_out, r)}")
    ds = torch.zeros((rows, r), dtype=torch.float32, device=dy.device)
    db = torch.zeros((d_out, r // db_blocks), dtype=torch.float32, device=dy.device)  # may be returned as dB
    if rows == 0:
        return ds, db
    if dy.is_cuda:  # at most one wave of programs (row tiles x column splits; 64 x 2 at 8192 rows was best)
        tiles = DSDB_TILES
        split = max(2, min(16, dispatch.sm_count(dy.device) // dispatch.cdiv(rows, tiles["BT"])))
    else:  # small tiles under the interpreter, several splits and chunks per program
        tiles, split = dict(BT=16, BN=32, num_warps=4, num_stages=1), 2
    launch(_dsdb_dense_kernel, (dispatch.cdiv(rows, tiles["BT"]), split),
        ds, db, dy, s, b, rows, d_out, r, dy.stride(0), split,
        BLOCK_T=tiles["BT"], BLOCK_N=tiles["BN"], BLOCK_R=max(16, dispatch.next_pow2(r)),
        PREC=dispatch.dot_precision(dy.dtype), DB_BLOCKS=db_blocks, num_warps=tiles["num_warps"],
        num_stages=tiles["num_stages"])
    return ds, db


def dsdb_dense_ref(dy: torch.Tensor, s: torch.Tensor, b: torch.Tensor, db_blocks: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``dsdb_dense`` (float64 in tests)."""
    return dy @ b, pack_block_diagonal(dy.t() @ s, db_blocks)


class _Cfg:
    """Host-side description of one call (segments, per-adapter scale/dropout/blocks, GEMM mode)."""

    def __init__(self, seg: list[int], adapters: Sequence[LoraFactors], seed: int | None, options: KernelOptions):
        bd_gemm = options.bd_gemm
        if bd_gemm not in BD_GEMMS:
            raise ValueError(f"bd_gemm must be one of {BD_GEMMS}, got {bd_gemm!r}")
        self.seg, self.seed = seg, seed
        self.p = [ad.dropout if seed is not None else 0.0 for ad in adapters]
        self.c = [ad.scale / (1.0 - p) for ad, p in zip(adapters, self.p)]
        self.rank = [ad.rank for ad in adapters]
        self.nb_a = [ad.blocks_a for ad in adapters]
        self.nb_b = [ad.blocks_b for ad in adapters]
        self.dense = [bd_gemm == "dense" or (bd_gemm == "auto" and ad.rank <= DENSE_MAX_RANK) for ad in adapters]
        self.a_shapes = [tuple(ad.lora_A.shape) for ad in adapters]
        self.b_shapes = [tuple(ad.lora_B.shape) for ad in adapters]
        self.factor_dtypes = [(ad.lora_A.dtype, ad.lora_B.dtype) for ad in adapters]
        self.keys = [dropout_keys(seed, i) if p > 0 else None for i, p in enumerate(self.p)]
        self.options = options
        # set by forward, per adapter: its dropout runs in the Triton kernels; its dS/dB route ("triton" | "cublas" |
        # "none"), decided there too so the call's ``Dispatch`` can report it
        self.fused = [False] * len(adapters)
        self.dsdb = ["none"] * len(adapters)


def _eff(w: torch.Tensor, nb: int, dense: bool, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The factor as the GEMMs read it, in the compute dtype: dense block-diagonal (blocks 1) or packed (nb
    blocks). The cast rides on the unpacking copy where there is one."""
    if dense and nb > 1:
        return unpack_block_diagonal(w, nb, dtype), 1
    return (w if w.dtype == dtype else w.to(dtype)), nb


def _shrink(cfg: _Cfg, i: int, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, need_da: bool, need_db: bool,
            need_dx: bool) -> tuple[torch.Tensor | None, tuple[torch.Tensor, int], list]:
    """Adapter i's forward up to its rank-r product: (S_i or None for an empty segment, (B_i as the GEMMs read it, its
    blocks), the five tensors its backward needs); decides its dropout and dS/dB routes (``cfg.fused``, ``cfg.dsdb``)."""
    a_eff, na = _eff(a, cfg.nb_a[i], cfg.dense[i], x.dtype)
    b_eff, nb = _eff(b, cfg.nb_b[i], cfg.dense[i], x.dtype)
    s0, s1 = cfg.seg[i], cfg.seg[i + 1]
    s = xin = drop = None
    if s1 > s0:
        xin = rows(x, s0, s1)
        s = new_output(x, (s1 - s0, cfg.rank[i]), cfg.options)
        cfg.fused[i] = cfg.p[i] > 0 and fused_ok(x, a_eff, cfg.options.fused_dropout)
        _decide_dsdb(cfg, i, x, b_eff, need_db, need_da or need_dx)
        if cfg.fused[i]:  # mask drawn in the kernel, again in backward: nothing but x saved
            drop_shrink(s, xin, a_eff, cfg.keys[i], cfg.p[i], cfg.c[i])
            xin = None
        else:
            if cfg.p[i] > 0:
                drop = segment_keep_mask(cfg.seed, i, s1 - s0, x.shape[1], cfg.p[i], x.device).logical_not_()
                xin = xin.masked_fill(drop, 0)
            bd_mm_(s, xin, a_eff, na, cfg.c[i], 0.0)
    return s, (b_eff, nb), [a_eff, b_eff, s, xin if drop is not None else None, drop]


def _decide_dsdb(cfg: _Cfg, i: int, x: torch.Tensor, b_eff: torch.Tensor, need_db: bool, need_ds: bool) -> None:
    """Adapter i's dS/dB route (``cfg.dsdb``): one Triton kernel reading dY once where dS and dB are both wanted, B is
    dense as the GEMMs see it and ``dsdb_ok``; else two GEMMs."""
    if need_db or need_ds:
        dense_b = cfg.dense[i] or cfg.nb_b[i] == 1
        fuse = need_db and need_ds and dense_b and dsdb_ok(x, b_eff, cfg.options.fused_dsdb)
        cfg.dsdb[i] = "triton" if fuse else "cublas"


def _needs_x(cfg: _Cfg, need_da: Sequence[bool]) -> bool:
    """Whether an adapter's dA reads x itself (no dropout, or dropout drawn again inside the kernel)."""
    return any(d and (cfg.p[i] == 0 or cfg.fused[i]) for i, d in enumerate(need_da))


def _expand_backward(cfg: _Cfg, i: int, dy: torch.Tensor, x: torch.Tensor | None, saved: Sequence,
                     need_da: bool, need_db: bool, dx: torch.Tensor | None) -> tuple:
    """Adapter i's backward: (dA_i, dB_i) packed like its factors (None where not needed); its share of dX written
    into ``dx``'s segment rows (beta = 0: the caller adds the base's share after)."""
    a_eff, b_eff, s, xin, drop = saved
    s0, s1 = cfg.seg[i], cfg.seg[i + 1]
    a_dtype, b_dtype = cfg.factor_dtypes[i]
    if s1 == s0:
        return (dy.new_zeros(cfg.a_shapes[i], dtype=a_dtype) if need_da else None,
                dy.new_zeros(cfg.b_shapes[i], dtype=b_dtype) if need_db else None)
    na, nb = (1 if cfg.dense[i] else cfg.nb_a[i]), (1 if cfg.dense[i] else cfg.nb_b[i])
    dyi = rows(dy, s0, s1)
    need_ds = need_da or dx is not None
    da = db = ds = None
    if need_ds and need_db and cfg.dsdb[i] == "triton":  # dS and dB from one read of dY (forward decided)
        ds, db = dsdb_dense(dyi, s, b_eff, cfg.nb_b[i])  # B dense as the GEMMs read it: dB comes back packed
        db = db.to(b_dtype)
        ds = ds if cfg.fused[i] else ds.to(dy.dtype)  # the dropout kernels round fp32 dS themselves
    else:
        db = bd_wgrad(dyi, s, cfg.nb_b[i], 1.0, cfg.dense[i], b_dtype, cfg.options) if need_db else None
        if need_ds:
            ds = new_output(dy, (s1 - s0, cfg.rank[i]), cfg.options)
            bd_mm_t_(ds, dyi, b_eff, nb, 1.0, 0.0)
    if need_ds:
        if need_da and cfg.fused[i]:
            da = pack_block_diagonal(drop_wgrad_a(rows(x, s0, s1), ds, cfg.keys[i], cfg.p[i], cfg.c[i]), cfg.nb_a[i],
                                     a_dtype)
        elif need_da:
            da = bd_wgrad(ds, rows(x, s0, s1) if xin is None else xin, cfg.nb_a[i], cfg.c[i], cfg.dense[i],
                          a_dtype, cfg.options)
        if dx is not None and cfg.fused[i]:
            drop_expand_t(rows(dx, s0, s1), ds, a_eff, cfg.keys[i], cfg.p[i], cfg.c[i])
        elif dx is not None:
            dxi = rows(dx, s0, s1)
            bd_mm_t_(dxi, ds, a_eff, na, cfg.c[i], 0.0)
            if drop is not None:
                dxi.masked_fill_(drop, 0)
    return da, db


class CublasLoraLinearFn(torch.autograd.Function):
    """Fused (BD-)LoRA linear from cuBLAS GEMMs. Inputs (cfg, x, weight, bias, a_0, b_0, a_1, b_1, ...):

        y = x @ weight^T + bias
        y[seg[i]:seg[i+1]] += scale_i * dropout_i(x[seg[i]:seg[i+1]]) @ A_i @ B_i

    with x (T, d_in), weight (d_out, d_in), bias (d_out,) or None, A_i = blockdiag(a_i)^T (d_in, r_i),
    B_i = blockdiag(b_i)^T (r_i, d_out) from the packed PEFT-orientation factors a_i (r_i, d_in/Na_i) and
    b_i (d_out, r_i/Nb_i) (``bdlora.layout``), and dropout_i(u) = keep_i * u / (1 - p_i), keep_i the bool mask
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
        t = x.shape[0]
        seg = cfg.seg
        nig = ctx.needs_input_grad
        need_da = [nig[4 + 2 * i] for i in range(len(cfg.c))]
        lora_s, lora_b, saved = [], [], []
        for i in range(len(cfg.c)):
            s, b_eff, kept = _shrink(cfg, i, x, factors[2 * i], factors[2 * i + 1], need_da[i], nig[5 + 2 * i], nig[1])
            lora_s.append(s)
            lora_b.append(b_eff)
            saved += kept
        if bias is None:  # LoRA first, then the base GEMM accumulates onto it (beta=1) in its epilogue
            y = new_output(x, (t, weight.shape[0]), cfg.options)
            zero_outside_segments(y, seg)
            for i, s in enumerate(lora_s):
                if s is not None:
                    bd_mm_(rows(y, seg[i], seg[i + 1]), s, *lora_b[i], 1.0, 0.0)
            y.addmm_(x, weight.t())
        else:  # base GEMM + bias (cuBLASLt epilogue) first, LoRA added in place
            y = F.linear(x, weight, bias)
            for i, s in enumerate(lora_s):
                if s is not None:
                    bd_mm_(rows(y, seg[i], seg[i + 1]), s, *lora_b[i], 1.0, 1.0)
        # x itself is needed for dW, and for dA of adapters without dropout or with it fused
        need_x = nig[2] or _needs_x(cfg, need_da)
        ctx.cfg, ctx.x_shape, ctx.has_bias = cfg, x.shape, bias is not None
        ctx.save_for_backward(x if need_x else None, weight, *saved)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        cfg: _Cfg = ctx.cfg
        x, weight, *saved = ctx.saved_tensors
        nig = ctx.needs_input_grad
        seg = cfg.seg
        dy = dy.contiguous()
        dx = None
        if nig[1]:
            dx = new_output(dy, tuple(ctx.x_shape), cfg.options)
            zero_outside_segments(dx, seg)
        grads = []
        for i in range(len(cfg.c)):
            grads += _expand_backward(cfg, i, dy, x, saved[5 * i:5 * i + 5], nig[4 + 2 * i], nig[5 + 2 * i], dx)
        if dx is not None:
            dx.addmm_(dy, weight)  # base dX accumulates onto the LoRA dX in the GEMM epilogue
        dw = dy.t() @ x if nig[2] else None
        dbias = dy.sum(0) if ctx.has_bias and nig[3] else None
        return (None, dx, dw, dbias, *grads)


class CublasLoraAddFn(torch.autograd.Function):
    """One (BD-)LoRA added in place onto a layer's output: inputs (cfg, out, x, a, b) with out (..., d_out) the base
    layer's output (contiguous), x (..., d_in):

        out += scale * dropout(x) @ A @ B        (one adapter, cfg.seg = [0, T] over the flattened rows)

    The products and gradients are those of ``CublasLoraLinearFn``'s adapter without the base GEMM; the expand
    product accumulates into ``out`` in its GEMM epilogue (beta = 1), so no add kernel touches an activation.
    dL/dout passes through; dL/dx is the LoRA's share only (autograd adds the base layer's).
    """

    @staticmethod
    def forward(ctx, cfg: _Cfg, out, x, a, b):
        ctx.mark_dirty(out)
        x2 = x.reshape(-1, x.shape[-1])
        nig = ctx.needs_input_grad
        s, (b_eff, nb), saved = _shrink(cfg, 0, x2, a, b, nig[3], nig[4], nig[2])
        if s is not None:
            bd_mm_(out.view(-1, out.shape[-1]), s, b_eff, nb, 1.0, 1.0)
        ctx.cfg, ctx.x_shape = cfg, x.shape
        ctx.save_for_backward(x2 if _needs_x(cfg, [nig[3]]) else None, *saved)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        cfg: _Cfg = ctx.cfg
        x2, *saved = ctx.saved_tensors
        nig = ctx.needs_input_grad
        dy = dout.reshape(-1, dout.shape[-1]).contiguous()
        dx = new_output(dy, (dy.shape[0], ctx.x_shape[-1]), cfg.options) if nig[2] else None
        da, db = _expand_backward(cfg, 0, dy, x2, saved, nig[3], nig[4], dx)
        return None, dout, None if dx is None else dx.view(ctx.x_shape), da, db


def cublas_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seg: list[int],
                       adapters: Sequence[LoraFactors], seed: int | None, options: KernelOptions
                       ) -> tuple[torch.Tensor, tuple[str, ...], tuple[str, ...]]:
    """Apply ``CublasLoraLinearFn`` (arguments already validated by the caller: ``fused_lora_linear``, or the PEFT
    layer of ``bdlora.peft_model`` for its one adapter; seg a host list): (y, per-adapter dropout route, per-adapter
    dS/dB route) as ``dispatch.Dispatch`` reports them."""
    cfg = _Cfg(seg, adapters, seed, options)
    factors = [t.contiguous() for ad in adapters for t in (ad.lora_A, ad.lora_B)]
    y = CublasLoraLinearFn.apply(cfg, x.contiguous(), weight, bias, *factors)
    return y, tuple(_dropout_route(cfg, i, e - s) for i, (s, e) in enumerate(zip(seg, seg[1:]))), tuple(cfg.dsdb)


def _dropout_route(cfg: "_Cfg", i: int, rows: int) -> str:
    """How adapter i's dropout ran, as ``dispatch.Dispatch`` names it: none, in the Triton kernels, or a mask."""
    return "none" if cfg.p[i] == 0 or rows == 0 else ("triton" if cfg.fused[i] else "mask")


def cublas_lora_add_(out: torch.Tensor, x: torch.Tensor, adapter: LoraFactors, seed: int | None,
                     options: KernelOptions = KernelOptions()) -> tuple[torch.Tensor, str, str]:
    """``out += adapter.scale * dropout(x) @ A @ B`` in place through ``CublasLoraAddFn`` (out: a layer's output
    (..., d_out), contiguous; x (..., d_in); dropout with p = ``adapter.dropout`` when ``seed`` is not None):
    (out, dropout route, dS/dB route) as ``dispatch.Dispatch`` names them. A PEFT layer's LoRA term on bdlora's
    GEMMs and kernels: ``bdlora.peft_model.use_bdlora_kernels``."""
    if not out.is_contiguous():
        raise ValueError("cublas_lora_add_: the output must be contiguous (it is written in place)")
    rows = out.numel() // out.shape[-1]
    cfg = _Cfg([0, rows], [adapter], seed, options)
    out = CublasLoraAddFn.apply(cfg, out, x.contiguous(), adapter.lora_A.contiguous(), adapter.lora_B.contiguous())
    return out, _dropout_route(cfg, 0, rows), cfg.dsdb[0]


# The same layer as a torch custom op, for compiled graphs: dynamo cannot trace ``CublasLoraLinearFn`` (its ``_Cfg``
# is host-side state), so a compiled model breaks its graph at every such layer; a custom op with a fake impl and
# registered autograd stays inside the graph. One adapter over every row, no dropout, a frozen base: what a
# compiled PEFT model's BD layer runs (``bdlora.peft_model``); the products, routes and numerics are the Function's.
DENSE_LAYOUT = "dense"  # the op's name for a layout of None (a schema takes str, not Optional)


def _op_cfg(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, layout: str, nblocks: int,
            scale: float) -> _Cfg:
    ad = LoraFactors(lora_a, lora_b, None if layout == DENSE_LAYOUT else layout, nblocks, scale, 0.0)
    return _Cfg([0, x.shape[0]], [ad], None, KernelOptions())


@torch.library.custom_op("bdlora::train_lora_linear", mutates_args=())
def lora_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                   lora_b: torch.Tensor, layout: str, nblocks: int, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, S): y = x @ weight^T + bias + scale * x @ A @ B over every row of x (T, d_in), the factors packed in PEFT
    orientation with ``layout`` "column" / "row" / "dense" (``bdlora.layout``); S = scale * x @ A (T, r), the rank-r
    product its backward reads (not differentiable)."""
    cfg = _op_cfg(x, lora_a, lora_b, layout, nblocks, scale)
    s, (b_eff, nb), _ = _shrink(cfg, 0, x, lora_a, lora_b, True, True, True)
    if s is None:  # no rows
        return x.new_empty((0, weight.shape[0])), x.new_empty((0, lora_a.shape[0]))
    if bias is None:
        y = x.new_empty((x.shape[0], weight.shape[0]))
        bd_mm_(y, s, b_eff, nb, 1.0, 0.0)
        y.addmm_(x, weight.t())
    else:
        y = F.linear(x, weight, bias)
        bd_mm_(y, s, b_eff, nb, 1.0, 1.0)
    return y, s


@lora_linear_op.register_fake
def _lora_linear_fake(x, weight, bias, lora_a, lora_b, layout, nblocks, scale):
    return x.new_empty((x.shape[0], weight.shape[0])), x.new_empty((x.shape[0], lora_a.shape[0]))


@torch.library.custom_op("bdlora::train_lora_linear_backward", mutates_args=())
def lora_linear_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor,
                            lora_b: torch.Tensor, s: torch.Tensor, layout: str, nblocks: int, scale: float,
                            need_dx: bool, need_da: bool, need_db: bool
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dX, dA, dB) of :func:`lora_linear_op` (``CublasLoraLinearFn``'s backward for one adapter without dropout; the
    dS/dB route decided as its forward would); a gradient not asked for comes back empty."""
    cfg = _op_cfg(x, lora_a, lora_b, layout, nblocks, scale)
    dy = dy.contiguous()
    a_eff, _ = _eff(lora_a, cfg.nb_a[0], cfg.dense[0], x.dtype)
    b_eff, _ = _eff(lora_b, cfg.nb_b[0], cfg.dense[0], x.dtype)
    _decide_dsdb(cfg, 0, x, b_eff, need_db, need_da or need_dx)
    dx = new_output(dy, tuple(x.shape), cfg.options) if need_dx else None
    da, db = _expand_backward(cfg, 0, dy, x, [a_eff, b_eff, s, None, None], need_da, need_db, dx)
    if dx is not None:
        dx.addmm_(dy, weight)
    return (x.new_empty(0) if dx is None else dx, lora_a.new_empty(0) if da is None else da,
            lora_b.new_empty(0) if db is None else db)


@lora_linear_backward_op.register_fake
def _lora_linear_backward_fake(dy, x, weight, lora_a, lora_b, s, layout, nblocks, scale, need_dx, need_da, need_db):
    return (torch.empty_like(x) if need_dx else x.new_empty(0), torch.empty_like(lora_a) if need_da
            else lora_a.new_empty(0), torch.empty_like(lora_b) if need_db else lora_b.new_empty(0))


def _lora_linear_setup(ctx, inputs, output):
    x, weight, _bias, lora_a, lora_b, layout, nblocks, scale = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, lora_a, lora_b, output[1])
    ctx.meta = (layout, nblocks, scale)


def _lora_linear_grad(ctx, dy, _ds):
    x, weight, lora_a, lora_b, s = ctx.saved_tensors
    nig = ctx.needs_input_grad
    if nig[1] or nig[2]:
        raise RuntimeError("bdlora::train_lora_linear: the base weight and bias are frozen (no gradient for them)")
    dx, da, db = lora_linear_backward_op(dy, x, weight, lora_a, lora_b, s, *ctx.meta, nig[0], nig[3], nig[4])
    return (dx if nig[0] else None, None, None, da if nig[3] else None, db if nig[4] else None, None, None, None)


torch.library.register_autograd("bdlora::train_lora_linear", _lora_linear_grad, setup_context=_lora_linear_setup)


def compiled_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         adapter: LoraFactors) -> torch.Tensor:
    """``x @ weight^T + bias + adapter's LoRA term`` through :func:`lora_linear_op` (one adapter over every row of x
    (T, d_in), no dropout, a frozen base): the cuBLAS layer inside a compiled graph."""
    if adapter.dropout:
        raise ValueError("compiled_lora_linear: LoRA dropout is drawn by the eager layer (cublas_lora_linear)")
    return lora_linear_op(x.contiguous(), weight, bias, adapter.lora_A.contiguous(), adapter.lora_B.contiguous(),
                          adapter.layout or DENSE_LAYOUT, adapter.nblocks, float(adapter.scale))[0]
