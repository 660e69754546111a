"""Grouped multi-adapter (Block-Diagonal) LoRA for training, and the LoRAFusion-style fused linear (Triton path;
the fused linear's cuBLAS-composed path is ``cublas``, chosen by ``fused_lora_linear``).

Forward (launches per layer, independent of the number of adapters):
  1. shrink : S = (scale/(1-p)) * (keep * x) @ A          dropout + scale + xA fused; S kept for backward
  2. expand : y (+)= S @ B  [+ x @ W^T + bias]            added in place into the base output, or fused
                                                          with the base GEMM in the same tile (fuse_base)
Backward:
  3. dS = dY @ B^T and dB = S^T dY                        one kernel, one read of dY
  4. dA = (scale/(1-p)) * (keep * x)^T dS                 keep = int8 mask stored by stage 1
  5. dX (+)= (scale/(1-p)) * keep * (dS @ A^T)  [+ dY W]  added into the base dX, or fused with it
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.nn.functional as F

from bdlora.layout import LoraFactors

from . import dispatch
from ._jit import dot, jit, tl
from .cublas import _dsdb_chunks, cublas_lora_linear
from .dispatch import (DEFAULT_OPTIONS, Dispatch, KernelOptions, LoraResult, cdiv, dot_precision, new_output, next_pow2,
                       zero_outside_segments)
from .dropout import _keep, check_counters, dropout_keys
from .reference import fused_lora_linear_ref, grouped_lora_ref, torch_keep_masks


def _config(x: torch.Tensor, fuse_base: bool) -> dict:
    """Tile sizes: big tiles on GPU (bigger still when the tile also runs the base GEMM); small ones under
    the (slow, per-program) interpreter."""
    if not x.is_cuda:
        return dict(BT=16, BM=32, BK=32, BN=32, warps=4, stages=1)
    if fuse_base:
        return dict(BT=128, BM=128, BK=64, BN=64, warps=8, stages=3)
    return dict(BT=64, BM=128, BK=64, BN=64, warps=4, stages=3)


# ---- Triton kernels -----------------------------------------------------------------------------------------------
# All share one addressing scheme for a packed block-diagonal weight of adapter i: the weight is a slice of a flat
# buffer at offset ``woff`` and stored (M, K/nb) row-major (PEFT orientation); kernel-output column c belongs to block
# c // (M/nb) and reads input columns of the same block only. Rows are routed by a host-built tile map: each tile is
# (adapter, row_start, row_end) inside one segment, so tiles never mix adapters and tokens are never padded (the last
# tile of a segment is masked). Column tiles may straddle block boundaries when blocks are narrower than a tile; the
# weight loads are then masked to the diagonal, so memory traffic stays exact and wasted FLOPs only appear for blocks
# smaller than a tile (which are too small for tensor cores anyway). Torch reference: ``grouped_lora_ref``.

@jit
def _tile_meta(tiles_ptr, meta_ptr, tile):
    """A tile's (adapter, first row, end row) and its adapter's 4 int32 meta fields (layout per kernel docstring)."""
    adapter = tl.load(tiles_ptr + tile * 3)
    row0 = tl.load(tiles_ptr + tile * 3 + 1)
    row_end = tl.load(tiles_ptr + tile * 3 + 2)
    m0 = tl.load(meta_ptr + adapter * 4)
    m1 = tl.load(meta_ptr + adapter * 4 + 1)
    m2 = tl.load(meta_ptr + adapter * 4 + 2)
    m3 = tl.load(meta_ptr + adapter * 4 + 3)
    return adapter, row0, row_end, m0, m1, m2, m3


@jit(do_not_specialize=["key0", "key1"])  # its threshold comes from p in fmeta
def _sgmm_kernel(
    out_ptr, in_ptr, w_ptr, tiles_ptr, meta_ptr, fmeta_ptr,
    base_in_ptr, base_w_ptr, bias_ptr, mask_ptr, key0, key1,
    stride_out, stride_in, stride_bin, base_sw_c, base_sw_k, base_K, drop_cols,
    HAS_BASE: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, TRANS_W: tl.constexpr,
    DROP_IN: tl.constexpr, DROP_OUT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KB: tl.constexpr,
    PREC: tl.constexpr,
):
    """out[rows_i, :M_i] (+)= [base_in @ base_W^T + bias] + alpha_i * keep_out * ((keep_in * in) @ blockdiag(W_i))

    meta[i] = (K_i, M_i, nb_i, woff_i) (int32), fmeta[i] = (alpha_i, p_i).  TRANS_W reads W_i as stored
    (K, M/nb) instead of (M, K/nb) (used for dS = dY B and dX = dS A). DROP_IN draws the dropout mask from
    the keys and stores it (int8, (T, drop_cols)) at mask_ptr; DROP_OUT reads that stored mask.
    """
    tile = tl.program_id(0)
    adapter, row0, row_end, K, M, nb, woff = _tile_meta(tiles_ptr, meta_ptr, tile)
    alpha = tl.load(fmeta_ptr + adapter * 2)
    p = tl.load(fmeta_ptr + adapter * 2 + 1)

    c0 = tl.program_id(1) * BLOCK_M
    if c0 < M:
        rows = row0 + tl.arange(0, BLOCK_T)
        rmask = rows < row_end
        cols = c0 + tl.arange(0, BLOCK_M)
        cmask = cols < M
        acc = tl.zeros((BLOCK_T, BLOCK_M), dtype=tl.float32)

        if HAS_BASE:  # frozen base GEMM sharing this output tile (LoRAFusion op 2 / op 5)
            for k0 in range(0, base_K, BLOCK_KB):
                ks = k0 + tl.arange(0, BLOCK_KB)
                kmask = ks < base_K
                a = tl.load(base_in_ptr + rows[:, None] * stride_bin + ks[None, :],
                            mask=rmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(base_w_ptr + ks[:, None] * base_sw_k + cols[None, :] * base_sw_c,
                            mask=kmask[:, None] & cmask[None, :], other=0.0)
                acc += dot(a, w, PREC)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]

        bs_out = M // nb
        bs_in = K // nb
        col_blk = cols // bs_out
        k_lo = (c0 // bs_out) * bs_in
        k_hi = ((tl.minimum(c0 + BLOCK_M, M) - 1) // bs_out + 1) * bs_in
        lacc = tl.zeros((BLOCK_T, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < k_hi
            a = tl.load(in_ptr + rows[:, None] * stride_in + ks[None, :],
                        mask=rmask[:, None] & kmask[None, :], other=0.0)
            k_blk = ks // bs_in
            if DROP_IN:  # draw the mask once; the tile holding its block's first column stores it (int8)
                moffs = rows[:, None] * drop_cols + ks[None, :]
                keep = _keep(key0, key1, rows[:, None], ks[None, :], (drop_cols + 1) // 2,
                             tl.math.ceil(p * 65536.0).to(tl.int32))
                first = k_blk * bs_out
                owner = (first >= c0) & (first < c0 + BLOCK_M)
                tl.store(mask_ptr + moffs, keep.to(tl.int8), mask=rmask[:, None] & (kmask & owner)[None, :])
                a = a * keep.to(a.dtype)
            wmask = kmask[:, None] & cmask[None, :] & (k_blk[:, None] == col_blk[None, :])
            if TRANS_W:
                widx = ks[:, None] * bs_out + (cols - col_blk * bs_out)[None, :]
            else:
                widx = cols[None, :] * bs_in + (ks - k_blk * bs_in)[:, None]
            w = tl.load(w_ptr + woff + widx, mask=wmask, other=0.0)
            lacc += dot(a, w, PREC)
        lacc = lacc * alpha
        if DROP_OUT:  # backward: the mask stored by the forward shrink
            keep = tl.load(mask_ptr + rows[:, None] * drop_cols + cols[None, :],
                           mask=rmask[:, None] & cmask[None, :], other=0)
            lacc = tl.where(keep != 0, lacc, 0.0)
        acc += lacc

        omask = rmask[:, None] & cmask[None, :]
        optrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
        if ACCUMULATE:
            acc += tl.load(optrs, mask=omask, other=0.0).to(tl.float32)
        tl.store(optrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@jit
def _dsdb_kernel(
    ds_ptr, db_ptr, dy_ptr, s_ptr, b_ptr, tiles_ptr, meta_ptr,
    stride_ds, stride_dy, stride_s, col_split,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr,
):
    """Backward of the expand, reading each dY tile once (LoRAFusion op 3):

    dS[rows_i, rank_j] += dY[rows_i, out_j] @ B_j        (B_j = lora_b rows out_j, stored (d_out/nb, r/nb))
    dB_j               += dY[rows_i, out_j]^T @ S[rows_i, rank_j]

    Both are fp32 atomics (ds_ptr, db_ptr zeroed): program (tile, c, q) takes every col_split-th column chunk and
    rank chunk q (BLOCK_R ranks of each block), so a few programs share a row tile, the grid fills the GPU, and
    the two fp32 accumulators stay (BLOCK_T + BLOCK_N) x BLOCK_R however large the rank.

    meta[i] = (r_i, d_out, nb_i, boff_i).
    """
    tile = tl.program_id(0)
    adapter, row0, row_end, r, d_out, nb, boff = _tile_meta(tiles_ptr, meta_ptr, tile)
    rb = r // nb
    bs_out = d_out // nb

    rows = row0 + tl.arange(0, BLOCK_T)
    rmask = rows < row_end
    rr = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    rrmask = rr < rb
    for j in range(0, nb):
        smask = rmask[:, None] & rrmask[None, :]
        s_j = tl.load(s_ptr + rows[:, None] * stride_s + (j * rb + rr)[None, :], mask=smask, other=0.0)
        acc = _dsdb_chunks(db_ptr, dy_ptr, b_ptr, s_j, rows, rmask, rr, rrmask, stride_dy, j * bs_out, bs_out, rb,
                           boff, tl.program_id(1), col_split, tile, BLOCK_T, BLOCK_N, BLOCK_R, PREC, 1)
        tl.atomic_add(ds_ptr + rows[:, None] * stride_ds + (j * rb + rr)[None, :], acc, mask=smask, sem="relaxed")


@jit
def _wgrad_kernel(
    g_ptr, dout_ptr, in_ptr, tiles_ptr, meta_ptr, fmeta_ptr, mask_ptr,
    stride_dout, stride_in, drop_cols,
    DROP_IN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
):
    """Weight gradient of the block-diagonal shrink (LoRAFusion op 4), fp32 atomics into g_ptr:

    G_i[m, kl] += alpha_i * sum_{t in tile} dOut[t, m] * (mask * in)[t, blk(m) * K/nb + kl]

    with G_i stored (M, K/nb) at woff_i; meta[i] = (K_i, M_i, nb_i, woff_i), fmeta[i] = (alpha_i, p_i); mask is
    the int8 dropout keep-mask the forward shrink stored.
    Tiles here are row chunks of a segment (split-K over tokens).
    """
    tile = tl.program_id(0)
    adapter, row0, row_end, K, M, nb, woff = _tile_meta(tiles_ptr, meta_ptr, tile)
    alpha = tl.load(fmeta_ptr + adapter * 2)
    bs_out = M // nb
    bs_in = K // nb

    m0 = tl.program_id(1) * BLOCK_R
    k0 = tl.program_id(2) * BLOCK_K
    if (m0 < M) & (k0 < bs_in):
        ms = m0 + tl.arange(0, BLOCK_R)
        mmask = ms < M
        m_blk = ms // bs_out
        kls = k0 + tl.arange(0, BLOCK_K)
        kmask = kls < bs_in
        j_lo = m0 // bs_out
        j_hi = (tl.minimum(m0 + BLOCK_R, M) - 1) // bs_out
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for t0 in range(row0, row_end, BLOCK_T):
            rows = t0 + tl.arange(0, BLOCK_T)
            rmask = rows < row_end
            g = tl.load(dout_ptr + rows[:, None] * stride_dout + ms[None, :],
                        mask=rmask[:, None] & mmask[None, :], other=0.0)
            for j in range(j_lo, j_hi + 1):
                ks = j * bs_in + kls
                xv = tl.load(in_ptr + rows[:, None] * stride_in + ks[None, :],
                             mask=rmask[:, None] & kmask[None, :], other=0.0)
                if DROP_IN:  # the mask stored by the forward shrink
                    keep = tl.load(mask_ptr + rows[:, None] * drop_cols + ks[None, :],
                                   mask=rmask[:, None] & kmask[None, :], other=0)
                    xv = xv * keep.to(xv.dtype)
                gj = tl.where((m_blk == j)[None, :], g, 0.0).to(xv.dtype)
                acc += dot(tl.trans(gj), xv, PREC)
        tl.atomic_add(g_ptr + woff + ms[:, None] * bs_in + kls[None, :], acc * alpha,
                      mask=mmask[:, None] & kmask[None, :])


def _clamp_pow2(v: int, lo: int, hi: int) -> int:
    return min(hi, max(lo, next_pow2(v)))


def _seg_list(seg, n: int, t: int) -> list[int]:
    seg = [int(v) for v in (seg.tolist() if torch.is_tensor(seg) else seg)]  # host copy (syncs if on GPU)
    if len(seg) != n + 1 or any(b < a for a, b in zip(seg, seg[1:])) or seg[0] < 0 or seg[-1] > t:
        raise ValueError(f"seg must be {n + 1} non-decreasing offsets within [0, {t}], got {seg}")
    return seg


def _tiles(seg: list[int], rows: int) -> list[tuple[int, int, int]]:
    """(adapter, row_start, row_end) per tile; tiles stay inside a segment, empty segments have none."""
    return [(i, r0, min(r0 + rows, seg[i + 1])) for i in range(len(seg) - 1) for r0 in range(seg[i], seg[i + 1], rows)]


class _Plan:
    """Host-side metadata of one call: per-stage adapter tables, tile maps, flat weight offsets."""

    SHRINK, EXPAND, DX, DSDB, WGRAD = range(5)

    def __init__(self, x: torch.Tensor, seg: list[int], adapters: Sequence[LoraFactors], seed: int | None,
                 fuse_base: bool, options: KernelOptions = DEFAULT_OPTIONS):
        self.options = options
        self.cfg = cfg = _config(x, fuse_base)
        self.seg, self.n, self.seed, self.fuse_base = seg, len(adapters), seed, fuse_base
        self.d_in, self.d_out = adapters[0].d_in, adapters[0].d_out
        self.t = x.shape[0]
        ranks = [ad.rank for ad in adapters]
        self.r_max = max(ranks)
        self.a_shapes = [ad.lora_A.shape for ad in adapters]
        self.b_shapes = [ad.lora_B.shape for ad in adapters]
        a_off, b_off, ao, bo = [], [], 0, 0
        for ad in adapters:
            a_off.append(ao)
            b_off.append(bo)
            ao += ad.lora_A.numel()
            bo += ad.lora_B.numel()
        self.a_numel, self.b_numel = ao, bo
        self.has_dropout = seed is not None and any(ad.dropout > 0 for ad in adapters)
        self.keys = dropout_keys(seed, 0) if self.has_dropout else (0, 0)
        if self.has_dropout:
            check_counters(self.t, self.d_in)
        # (K, M, nb, woff) per adapter and stage: kernel-input width, kernel-output width, blocks, offset
        rows = {
            self.SHRINK: [(self.d_in, r, ad.blocks_a, a_off[i]) for i, (ad, r) in enumerate(zip(adapters, ranks))],
            self.EXPAND: [(r, self.d_out, ad.blocks_b, b_off[i]) for i, (ad, r) in enumerate(zip(adapters, ranks))],
            self.DX: [(r, self.d_in, ad.blocks_a, a_off[i]) for i, (ad, r) in enumerate(zip(adapters, ranks))],
            self.DSDB: [(r, self.d_out, ad.blocks_b, b_off[i]) for i, (ad, r) in enumerate(zip(adapters, ranks))],
            self.WGRAD: [(self.d_in, r, ad.blocks_a, a_off[i]) for i, (ad, r) in enumerate(zip(adapters, ranks))],
        }
        dev = x.device
        self.meta = torch.tensor([rows[k] for k in range(5)], dtype=torch.int32).to(dev, non_blocking=True)
        p = [ad.dropout if self.has_dropout else 0.0 for ad in adapters]
        fmeta = [[(ad.scale / (1.0 - pi), pi) for ad, pi in zip(adapters, p)], [(1.0, 0.0)] * self.n]
        self.fmeta = torch.tensor(fmeta, dtype=torch.float32).to(dev, non_blocking=True)
        tiles = _tiles(seg, cfg["BT"])
        self.n_tiles = len(tiles)
        self.tiles = torch.tensor(tiles or [(0, 0, 0)], dtype=torch.int32).to(dev, non_blocking=True)
        # weight-gradient tiles: longer row chunks (split-K over tokens), enough programs to fill the GPU
        self.br_w = min(64, max(16, next_pow2(max(r // ad.blocks_a for ad, r in zip(adapters, ranks)))))
        self.bk_w = cfg["BK"]
        per_tile = -(-self.r_max // self.br_w) * -(-max(self.d_in // ad.blocks_a for ad in adapters) // self.bk_w)
        want = max(1, 1024 // per_tile)
        chunk = max(cfg["BT"], next_pow2(max(1, (seg[-1] - seg[0]) // want)))
        wtiles = _tiles(seg, min(chunk, 4096))
        self.n_wtiles = len(wtiles)
        self.wtiles = torch.tensor(wtiles or [(0, 0, 0)], dtype=torch.int32).to(dev, non_blocking=True)
        self.block_r = max(16, next_pow2(max(r // ad.blocks_b for ad, r in zip(adapters, ranks))))
        # dS/dB kernel: ranks in chunks of at most 64 (32 under the interpreter, so CPU tests cover several chunks):
        # two fp32 (rows x BLOCK_R) accumulators of BLOCK_R = 128 spilled registers on the H200 (a profile:
        # 4 ms a call at the 8B shape with rank 128)
        self.dsdb_block_r = min(self.block_r, 64 if x.is_cuda else 32)
        self.dsdb_rank_chunks = cdiv(self.block_r, self.dsdb_block_r)
        # per-stage (BLOCK_M, BLOCK_K): the rank side of a tile is sized to the rank (block), not padded to 128
        rb_a = max(r // ad.blocks_a for ad, r in zip(adapters, ranks))
        self.tile_mk = {
            self.SHRINK: (_clamp_pow2(self.r_max, 16, cfg["BM"]), cfg["BK"]),
            self.EXPAND: (cfg["BM"], _clamp_pow2(self.block_r, 16, cfg["BK"])),
            self.DX: (cfg["BM"], _clamp_pow2(rb_a, 16, cfg["BK"])),
        }
        self.prec = dot_precision(x.dtype)

    def zero_gaps(self, t: torch.Tensor) -> None:
        """Rows outside every segment get no LoRA; kernels never touch them."""
        zero_outside_segments(t, self.seg)

    # ---- launches -------------------------------------------------------------------------------
    def sgmm(self, stage, out, inp, w, fstage, *, accumulate, trans=False, mask=None, drop_in=False,
             drop_out=False, base_in=None, base_w=None, base_trans=False, bias=None):

        if self.n_tiles == 0:
            return
        cfg = self.cfg
        m_max = {self.SHRINK: self.r_max, self.EXPAND: self.d_out, self.DX: self.d_in}[stage]
        has_base = base_in is not None
        if has_base:
            sw_c, sw_k = (base_w.stride(1), base_w.stride(0)) if base_trans else (base_w.stride(0), base_w.stride(1))
            base_k = base_in.shape[1]
        else:
            base_in, base_w, sw_c, sw_k, base_k = inp, w, 0, 0, 0
        block_m, block_k = self.tile_mk[stage]
        grid = (self.n_tiles, cdiv(m_max, block_m))
        _sgmm_kernel[grid](
            out, inp, w, self.tiles, self.meta[stage], self.fmeta[fstage],
            base_in, base_w, bias if bias is not None else w, mask if mask is not None else w, *self.keys,
            out.stride(0), inp.stride(0), base_in.stride(0), sw_c, sw_k, base_k, self.d_in,
            HAS_BASE=has_base, HAS_BIAS=bias is not None, ACCUMULATE=accumulate, TRANS_W=trans,
            DROP_IN=drop_in, DROP_OUT=drop_out,
            BLOCK_T=cfg["BT"], BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_KB=cfg["BK"], PREC=self.prec,
            num_warps=cfg["warps"], num_stages=cfg["stages"],
        )

    def dsdb(self, ds, db32, dy, s, b_flat):

        if self.n_tiles == 0:
            return
        cfg = self.cfg
        # split each row tile's output columns over a few programs (dS partials meet in fp32 atomics)
        if dy.is_cuda:
            split = max(1, min(8, cdiv(4 * dispatch.sm_count(dy.device), self.n_tiles)))
        else:
            split = 2  # exercises the split path under the interpreter
        _dsdb_kernel[(self.n_tiles, split, self.dsdb_rank_chunks)](
            ds, db32, dy, s, b_flat, self.tiles, self.meta[self.DSDB],
            ds.stride(0), dy.stride(0), s.stride(0), split,
            BLOCK_T=cfg["BT"], BLOCK_N=cfg["BN"], BLOCK_R=self.dsdb_block_r, PREC=self.prec,
            num_warps=cfg["warps"], num_stages=cfg["stages"],
        )

    def wgrad_a(self, da32, ds, x, mask):

        if self.n_wtiles == 0:
            return
        cfg = self.cfg
        bs_in_max = self.d_in  # upper bound of K/nb over adapters
        grid = (self.n_wtiles, cdiv(self.r_max, self.br_w), cdiv(bs_in_max, self.bk_w))
        _wgrad_kernel[grid](
            da32, ds, x, self.wtiles, self.meta[self.WGRAD], self.fmeta[0], mask if mask is not None else x,
            ds.stride(0), x.stride(0), self.d_in,
            DROP_IN=self.has_dropout, BLOCK_T=cfg["BT"], BLOCK_R=self.br_w, BLOCK_K=self.bk_w, PREC=self.prec,
            num_warps=cfg["warps"], num_stages=cfg["stages"],
        )

    def split(self, flat: torch.Tensor, shapes, dtype) -> list[torch.Tensor]:
        out, off = [], 0
        for shp in shapes:
            n = shp[0] * shp[1]
            out.append(flat[off:off + n].view(shp).to(dtype))
            off += n
        return out


def _plan_key(x: torch.Tensor, seg: list[int], adapters: Sequence[LoraFactors], seed: int | None, fuse_base: bool,
              options: KernelOptions) -> tuple:
    """What a plan depends on besides the dropout seed: the call's rows and segments, the adapters' shapes, blocks,
    scales and dropout rates (not the factors' values or storage: kernels get those per call)."""
    return (x.dtype, x.device, x.shape[0], tuple(seg), fuse_base, options, seed is not None,
            tuple((ad.d_in, ad.d_out, ad.rank, ad.blocks_a, ad.blocks_b, tuple(ad.lora_A.shape),
                   tuple(ad.lora_B.shape), ad.scale, ad.dropout) for ad in adapters))


def _plan(x: torch.Tensor, seg: list[int], adapters: Sequence[LoraFactors], seed: int | None, fuse_base: bool,
          options: KernelOptions, cache: dict | None) -> _Plan:
    """The call's plan, from ``cache`` when a call with the same rows, segments and adapter shapes built one (the
    layers of one micro-batch: building a plan costs ~0.5 ms of host time with twenty adapters, more than their
    kernels on a GPU). A cached plan is shared read-only; a dropout call gets a copy with its own seed."""
    if cache is None:
        return _Plan(x, seg, adapters, seed, fuse_base, options)
    key = _plan_key(x, seg, adapters, seed, fuse_base, options)
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = _Plan(x, seg, adapters, seed, fuse_base, options)
    elif seed is not None and plan.seed != seed:
        plan = copy.copy(plan)
        plan.seed = seed
        plan.keys = dropout_keys(seed, 0) if plan.has_dropout else (0, 0)
    return plan


class _LoraLinearFn(torch.autograd.Function):
    """y = [x W^T + b | out | 0] + grouped LoRA(x); see the module docstring for the five stages."""

    @staticmethod
    def forward(ctx, plan: _Plan, x, out, weight, bias, *factors):
        # factors stored wider than x (fp32 master weights beside a bf16 base) enter the products in x's dtype, as
        # under torch.autocast; their gradients come back in their own dtype from the fp32 accumulators
        ctx.factor_dtype = factors[0].dtype
        a_flat = torch.cat([f.reshape(-1) for f in factors[0::2]]).to(x.dtype)
        b_flat = torch.cat([f.reshape(-1) for f in factors[1::2]]).to(x.dtype)
        s = new_output(x, (plan.t, plan.r_max), plan.options)  # rows outside segments are never read
        # int8 keep-mask written by the shrink, read by the dA and dX stages (cheaper than redrawing it)
        mask = torch.empty(x.shape, dtype=torch.int8, device=x.device) if plan.has_dropout else None
        plan.sgmm(plan.SHRINK, s, x, a_flat, 0, accumulate=False, mask=mask, drop_in=plan.has_dropout)
        if weight is not None and plan.fuse_base:  # base GEMM and LoRA expand in one tile
            y = new_output(x, (plan.t, plan.d_out), plan.options)
            plan.sgmm(plan.EXPAND, y, s, b_flat, 1, accumulate=False, base_in=x, base_w=weight, bias=bias)
        else:
            if weight is not None:
                y = F.linear(x, weight, bias)
            elif out is not None:
                y = out
                ctx.mark_dirty(out)
            else:
                y = new_output(x, (plan.t, plan.d_out), plan.options)
                plan.zero_gaps(y)
            plan.sgmm(plan.EXPAND, y, s, b_flat, 1, accumulate=weight is not None or out is not None)
        ctx.plan, ctx.has_out, ctx.has_bias = plan, out is not None, bias is not None
        ctx.save_for_backward(x, s, weight, a_flat, b_flat, mask)
        return y

    @staticmethod
    def backward(ctx, dy):
        plan: _Plan = ctx.plan
        x, s, weight, a_flat, b_flat, mask = ctx.saved_tensors
        dy = dy.contiguous()
        ds32 = torch.zeros(plan.t, plan.r_max, device=x.device, dtype=torch.float32)
        db32 = torch.zeros(plan.b_numel, device=x.device, dtype=torch.float32)
        plan.dsdb(ds32, db32, dy, s, b_flat)
        ds = ds32.to(x.dtype)
        da32 = torch.zeros(plan.a_numel, device=x.device, dtype=torch.float32)
        plan.wgrad_a(da32, ds, x, mask)

        dx = None
        if ctx.needs_input_grad[1]:
            lora_dx = dict(trans=True, mask=mask, drop_out=plan.has_dropout)
            if weight is not None and plan.fuse_base:
                dx = new_output(x, x.shape, plan.options)
                plan.sgmm(plan.DX, dx, ds, a_flat, 0, accumulate=False, base_in=dy, base_w=weight,
                          base_trans=True, **lora_dx)
            elif weight is not None:
                dx = dy @ weight
                plan.sgmm(plan.DX, dx, ds, a_flat, 0, accumulate=True, **lora_dx)
            else:
                dx = new_output(x, x.shape, plan.options)
                plan.zero_gaps(dx)
                plan.sgmm(plan.DX, dx, ds, a_flat, 0, accumulate=False, **lora_dx)
        dw = dy.t() @ x if weight is not None and ctx.needs_input_grad[3] else None
        dbias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[4] else None
        dout = dy if ctx.has_out else None
        das = plan.split(da32, plan.a_shapes, ctx.factor_dtype)
        dbs = plan.split(db32, plan.b_shapes, ctx.factor_dtype)
        grads = [g for pair in zip(das, dbs) for g in pair]
        return (None, dx, dout, dw, dbias, *grads)


def _check(x: torch.Tensor, adapters: Sequence[LoraFactors | None]) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be (T, d_in), got {tuple(x.shape)}")
    live = [ad for ad in adapters if ad is not None]
    if not live:
        raise ValueError("need at least one adapter")
    for ad in live:
        if ad.d_in != x.shape[1] or ad.d_out != live[0].d_out:
            raise ValueError(f"adapter shapes d_in={ad.d_in}, d_out={ad.d_out} do not match x {tuple(x.shape)}")


def _dropout_on(adapters: Sequence[LoraFactors | None]) -> bool:
    """Dropout is on when an adapter has dropout > 0 and autograd records (training)."""
    return torch.is_grad_enabled() and any(ad is not None and ad.dropout > 0 for ad in adapters)


def _seed(adapters: Sequence[LoraFactors | None], seed: int | None, backend: str, options: KernelOptions
          ) -> int | None:
    """The dropout seed of a call that runs ``backend``: None when dropout is off or the torch backend draws
    ``F.dropout`` masks (torch_dropout="bernoulli"); else ``seed``, or one drawn from torch's CPU RNG."""
    if not _dropout_on(adapters) or (backend == "torch" and options.torch_dropout == "bernoulli"):
        return None
    return int(torch.randint(0, 2**31 - 1, (1,)).item()) if seed is None else int(seed)


def _factors(adapters: Sequence[LoraFactors | None]) -> list[torch.Tensor]:
    return [t for ad in adapters if ad is not None for t in (ad.lora_A, ad.lora_B)]


def _triton_why_not(x: torch.Tensor, adapters, extra=(), *, mixed: bool = False) -> str | None:
    """Why the grouped Triton kernels cannot run this call (None: they can). ``mixed``: factors may come in another
    dtype than x (they then run on x cast to it)."""
    if any(ad is None for ad in adapters):
        return "a segment without adapter"
    if x.stride(1) != 1 or any(t.stride(1) != 1 for t in extra):
        return "x or out without unit column stride"
    factors = _factors(adapters)
    compute = [x, *extra]
    if mixed and len({t.dtype for t in factors}) == 1 and factors[0].dtype != x.dtype:
        if len({t.device for t in compute + factors}) != 1:
            return "tensors on several devices"
        return dispatch.triton_why_not(*compute) or dispatch.triton_why_not(*factors)
    return dispatch.triton_why_not(*compute, *factors)


def _masks_kw(x, seg, adapters, seed, options: KernelOptions) -> dict:
    """The torch reference's dropout arguments for this call."""
    if options.torch_dropout == "bernoulli":
        return dict(bernoulli=_dropout_on(adapters))
    return dict(keep_masks=torch_keep_masks(x, seg, adapters, seed))


def grouped_lora(x: torch.Tensor, seg, adapters: Sequence[LoraFactors | None], *, out: torch.Tensor | None = None,
                 dropout_seed: int | None = None, options: KernelOptions = DEFAULT_OPTIONS,
                 plan_cache: dict | None = None) -> LoraResult:
    """Segmented multi-adapter (BD-)LoRA, Punica SGMV semantics with mixed ranks and block-diagonal factors:

        y[seg[i]:seg[i+1]] = scale[i] * dropout_i(x[seg[i]:seg[i+1]]) @ A[i] @ B[i]

    x (T, d_in); seg: n_adapters+1 non-decreasing row offsets (host list/tensor; segments may be empty);
    adapters: LoraFactors per segment (PEFT-orientation packed factors, see ``bdlora.layout``), or None for a segment
    that gets no LoRA (torch backend only). Rows outside all segments get 0. With ``out`` (T, d_out) the result is added
    into it in place (``out += ...``) and ``out`` is returned. Dropout applies while autograd is recording and an
    adapter has dropout > 0; the mask comes from ``dropout_seed`` (drawn from torch's RNG if None; see
    ``KernelOptions.torch_dropout`` for the torch backend). Differentiable in x, out and factors. ``plan_cache``: a
    dict the caller keeps while calls share rows, segments and adapter shapes (the layers of one micro-batch), so the
    Triton path builds its host-side plan once for them; the caller clears it when the segments change.

    Backends (``options.backend``): "triton" (the five-stage kernels above; "auto" on CUDA, and on CPU under
    TRITON_INTERPRET=1 with ``options.interpreter``), "torch" (``grouped_lora_ref``). Returns
    ``LoraResult(y, Dispatch)``.
    """
    _check(x, adapters)
    seg = _seg_list(seg, len(adapters), x.shape[0])
    why = _triton_why_not(x, adapters, () if out is None else (out,))
    use, note = dispatch.resolve("grouped_lora", options, x.device.type, triton=why)
    seed = _seed(adapters, dropout_seed, use, options)
    if use == "torch":
        delta = grouped_lora_ref(x, seg, adapters, **_masks_kw(x, seg, adapters, seed, options))
        y = delta if out is None else out.add_(delta)
    else:
        plan = _plan(x, seg, adapters, seed, False, options, plan_cache)
        y = _LoraLinearFn.apply(plan, x, out, None, None, *[t.contiguous() for t in _factors(adapters)])
    return LoraResult(y, Dispatch("grouped_lora", options.backend, use, note, seed))


def fused_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seg,
                      adapters: Sequence[LoraFactors | None], *, dropout_seed: int | None = None,
                      options: KernelOptions = DEFAULT_OPTIONS, plan_cache: dict | None = None) -> LoraResult:
    """LoRAFusion FusedLoRA / FusedMultiLoRA linear layer (weight frozen or not, PEFT orientation (d_out, d_in)):

        y = x @ weight^T + bias;  y[seg[i]:seg[i+1]] += scale[i] * dropout_i(x[seg[i]:seg[i+1]]) @ A[i] @ B[i]

    (adapters[i] None: segment i gets the base output only; torch backend only.) Returns ``LoraResult(y, Dispatch)``.

    Backends (``options.backend``; "auto" picks as listed):
      cublas : ``cublas.CublasLoraLinearFn``, every product one cuBLAS GEMM whose alpha/beta epilogue does the
               scale and the accumulation into the base output / base dX (no Triton); products in x's dtype (factors
               may be stored in another). "auto" takes it on CUDA with one non-empty segment or a large layer
               (``dispatch.cublas_preferred``) and fuse_base=False, dropout included. ``options.bd_gemm`` ("auto" |
               "dense" | "blocks") says how it runs block-diagonal factors, ``fused_dropout`` / ``fused_dsdb`` which
               Triton kernels replace GEMMs (``Dispatch.dropout`` / ``.dsdb`` report them per adapter). Explicitly
               requested it also runs on CPU (the same torch ops on the CPU BLAS).
      triton : the LoRA expand added in place into the cuBLAS base output (fuse_base=False) or computed inside
               the Triton base-GEMM tile (``options.fuse_base``; needs seg to cover all rows); backward adds the LoRA
               dX into the base dX the same way, dS and dB share one read of dY. Factors stored wider than x (fp32
               beside a bf16 base): products in x's dtype with fp32 accumulation, as cuBLAS and autocast; the
               factors' gradients in their own dtype. "auto" on CUDA otherwise, and on CPU under TRITON_INTERPRET=1 with ``options.interpreter``.
      torch  : ``fused_lora_linear_ref`` (autograd; LoRA products in the factors' dtype), "auto" otherwise.
    Dropout masks come from ``dropout_seed`` (drawn from torch's RNG if None) and differ by backend: Triton draws
    ``dropout_keep_mask`` (one mask over the call's rows), cublas and torch ``segment_keep_mask`` (one per segment;
    both in ``dropout.py``), or torch ``F.dropout`` with ``options.torch_dropout="bernoulli"``. ``plan_cache``: as
    for :func:`grouped_lora`.
    """
    _check(x, adapters)
    seg = _seg_list(seg, len(adapters), x.shape[0])
    fuse_base = options.fuse_base
    if fuse_base and (seg[0] != 0 or seg[-1] != x.shape[0]):
        raise ValueError("fuse_base=True needs the segments to cover every row of x")
    if fuse_base and options.backend == "cublas":
        raise ValueError("fuse_base=True runs the base GEMM in a Triton tile; the cublas backend does not have it")
    factors = _factors(adapters)
    compute = [x, weight] + ([bias] if bias is not None else [])
    t_why = _triton_why_not(x, adapters, mixed=True) or dispatch.triton_why_not(*compute)
    if any(ad is None for ad in adapters):
        c_why = "a segment without adapter"
    elif fuse_base:
        c_why = "fuse_base runs the base GEMM in a Triton tile"
    else:
        c_why = dispatch.cublas_why_not(compute, factors)
    n_seg = sum(e > s for s, e in zip(seg, seg[1:]))
    use, note = dispatch.resolve("fused_lora_linear", options, x.device.type, triton=t_why, cublas=c_why,
                                 prefer_cublas=dispatch.cublas_preferred(x.device.type, n_seg, *weight.shape[::-1]))
    seed = _seed(adapters, dropout_seed, use, options)
    if use == "torch":
        y = fused_lora_linear_ref(x, weight, bias, seg, adapters, **_masks_kw(x, seg, adapters, seed, options))
        return LoraResult(y, Dispatch("fused_lora_linear", options.backend, use, note, seed))
    if use == "cublas":
        y, drop, dsdb = cublas_lora_linear(x, weight, bias, seg, adapters, seed, options)
        return LoraResult(y, Dispatch("fused_lora_linear", options.backend, use, note, seed, drop, dsdb))
    factors = [t.contiguous() for t in factors]
    if factors[0].dtype != x.dtype:
        note = (note + "; " if note else "") + "LoRA products in x's dtype"
    plan = _plan(x, seg, adapters, seed, fuse_base, options, plan_cache)
    y = _LoraLinearFn.apply(plan, x, None, weight, bias, *factors)
    return LoraResult(y, Dispatch("fused_lora_linear", options.backend, use, note, seed))
