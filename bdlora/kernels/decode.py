"""Serving decode path: shrink+expand over several slices of a layer (e.g. q, k, v) in two launches for all slices
(``decode_lora``), or with the shrink folded into the base layer's GEMM and one launch after it
(``decode_lora_folded``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from . import dispatch
from ._jit import dot, jit, tl
from .launch import KeptLaunch, launch
from .dispatch import DEFAULT_OPTIONS, Dispatch, KernelOptions, LoraResult, next_pow2
from bdlora.layout import LAYOUTS
from .reference import decode_lora_folded_torch, decode_lora_torch


def stack_decode_weights(per_slice: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor] | None]],
                         max_rank: int, layout: str = "column", nblocks: int = 1):
    """Build the decode buffers from per-slice lists of (lora_a, lora_b) per LoRA slot (None = empty slot).

    Returns lora_a (S, L, max_rank, d_in/N_a), lora_b (L, sum_s d_out_s, max_rank/N_b), ranks (L,), slice
    offsets. All adapters of a slot must share one rank across slices. Done once per adapter load in serving.
    """
    n_s, n_l = len(per_slice), len(per_slice[0])
    ref = next(p for sl in per_slice for p in sl if p is not None)
    nb = nblocks if layout == "column" else 1
    d_outs = [next(p[1].shape[0] for p in sl if p is not None) for sl in per_slice]
    offs = [0]
    for d in d_outs:
        offs.append(offs[-1] + d)
    a = ref[0].new_zeros(n_s, n_l, max_rank, ref[0].shape[1])
    b = ref[1].new_zeros(n_l, offs[-1], max_rank // nb)
    ranks = torch.zeros(n_l, dtype=torch.int32)
    for s, sl in enumerate(per_slice):
        for slot, pair in enumerate(sl):
            if pair is None:
                continue
            la, lb = pair
            a[s, slot, : la.shape[0]] = la
            b[slot, offs[s]:offs[s + 1], : lb.shape[1]] = lb
            ranks[slot] = la.shape[0]
    return a, b, ranks.to(a.device), offs


@dataclass(frozen=True)
class DecodeTiles:
    """Tile sizes of ``decode_lora``'s two Triton kernels on one kind of device."""

    block_k: int  # input columns per shrink program (one load of x and of A's rank block)
    block_n: int  # output columns per expand program
    block_s: int  # partial shrinks the expand kernel sums per load
    warps: int


def decode_tiles(device: torch.device) -> DecodeTiles:
    """The tiles for ``device``. GPU: one memory round trip per program and enough programs at batch 1 to spread
    the LoRA weights' read over the SMs (traces of served decode steps: with the base model's
    weights streaming through L2 between layers, a kernel's latency chain is what a decode step pays)."""
    if device.type == "cuda":
        return DecodeTiles(block_k=128, block_n=64, block_s=16, warps=4)
    # small tiles under the interpreter: several splits and tiles, so both are exercised on CPU
    return DecodeTiles(block_k=32, block_n=32, block_s=2, warps=1)


@dataclass(frozen=True)
class DecodeGrid:
    """One ``decode_lora`` call: shrink grid (tokens, groups, k_splits), expand grid (tokens, groups, n_tiles);
    groups = slices x output blocks."""

    tokens: int
    n_groups: int
    k_splits: int
    n_tiles: int
    block_r: int

    @property
    def partials(self) -> int:  # fp32 entries of the workspace
        return self.tokens * self.n_groups * self.k_splits * self.block_r


def decode_grid(tokens: int, n_slices: int, nb: int, max_block: int, d_in: int, r_max: int,
                tiles: DecodeTiles) -> DecodeGrid:
    """The launches ``decode_lora`` makes for these shapes: the input dimension in ``block_k`` splits (shrink), the
    widest output block in ``block_n`` tiles (expand; a narrower block's surplus tiles exit at once)."""
    return DecodeGrid(tokens, n_slices * nb, -(-d_in // tiles.block_k), -(-max_block // tiles.block_n),
                      max(16, next_pow2(r_max // nb)))


@jit
def _decode_shrink_kernel(
    x_ptr, a_ptr, idx_ptr, ranks_ptr, part_ptr,
    stride_x, d_in, n_loras, R, KA, n_groups, k_splits,
    NA: tl.constexpr, NB: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
):
    """First half of ``decode_lora``: for token t, group g = slice * NB + j and input split k (one program each),

    a = idx[t] (nothing if a < 0 or ranks[a] == 0); ks = k * BLOCK_K + [0, BLOCK_K)
    part[t, g, k, :ranks[a] / NB] = x[t, ks] @ A[slice, a][j * ranks[a] / NB + :ranks[a] / NB, ks]^T   (fp32)

    Row layout (NA > 1): rank block rb of A only reads input block rb (the other products are masked to 0).
    One load of x and one of A per program, no loop: at batch 1 the latency is one memory round trip, and the
    d_in / BLOCK_K programs of a slice spread the read of A over the SMs. USE_GDC (programmatic dependent launch):
    idx, ranks and A are read before ``gdc_wait``, x after it, and every program waits (so this launch ends after
    the kernel before it: the expand launch that waits on this one may then write y).
    """
    t = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    a = tl.load(idx_ptr + t)
    r = tl.load(ranks_ptr + tl.maximum(a, 0))
    on = (a >= 0) & (r > 0)  # -1 = no LoRA; an empty slot (rank 0) adds nothing either
    sl = g // NB
    j = g % NB
    r_cnt = r // NB
    rr = tl.arange(0, BLOCK_R)
    rs = j * r_cnt + rr
    rmask = rr < tl.where(on, r_cnt, 0)  # nothing loaded for a token without LoRA
    bs_in = d_in // NA
    r_blk = rs // tl.maximum(r // NA, 1)
    ks = split * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = ks < d_in
    k_blk = ks // bs_in
    a_base = a_ptr + ((sl * n_loras + tl.maximum(a, 0)) * R).to(tl.int64) * KA
    amask = rmask[:, None] & kmask[None, :] & (r_blk[:, None] == k_blk[None, :])
    av = tl.load(a_base + rs[:, None] * KA + (ks - k_blk * bs_in)[None, :], mask=amask, other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    if on:
        xv = tl.load(x_ptr + t * stride_x + ks, mask=kmask, other=0.0).to(tl.float32)
        s = tl.sum(av.to(tl.float32) * xv[None, :], axis=1)
        tl.store(part_ptr + ((t * n_groups + g) * k_splits + split) * BLOCK_R + rr, s)


@jit
def _decode_expand_kernel(
    y_ptr, b_ptr, idx_ptr, ranks_ptr, scales_ptr, soff_ptr, part_ptr,
    stride_y, d_total, RB, n_groups,
    NB: tl.constexpr, K_SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Second half of ``decode_lora``: for token t, group g = slice * NB + j and column tile c (one program each),

    a = idx[t] (nothing if a < 0 or ranks[a] == 0); w = (soff[slice + 1] - soff[slice]) / NB
    cols = soff[slice] + j * w + c * BLOCK_N + [0, BLOCK_N)  (within output block j)
    y[t, cols] += scales[a] * (sum over k of part[t, g, k]) @ B[a, cols, :ranks[a] / NB]^T

    The partial shrinks are summed in split order (deterministic; y is rounded once). Every tile sums them again
    (K_SPLITS x BLOCK_R floats from L2): cheaper than a third launch. USE_GDC (programmatic dependent launch): idx,
    ranks, scales, soff and B are read before ``gdc_wait``, the partials and y after it.
    """
    t = tl.program_id(0)
    g = tl.program_id(1)
    tile = tl.program_id(2)
    a = tl.load(idx_ptr + t)
    r = tl.load(ranks_ptr + tl.maximum(a, 0))
    if (a >= 0) & (r > 0):
        sl = g // NB
        j = g % NB
        o_lo = tl.load(soff_ptr + sl)
        bs_out = (tl.load(soff_ptr + sl + 1) - o_lo) // NB
        c_lo = j * bs_out + tile * BLOCK_N
        c_end = (j + 1) * bs_out
        if c_lo < c_end:  # a narrower slice's surplus tiles have no columns
            rr = tl.arange(0, BLOCK_R)
            cs = c_lo + tl.arange(0, BLOCK_N)
            cmask = cs < c_end
            b_base = b_ptr + (a.to(tl.int64) * d_total) * RB
            # masked by RB, not by the slot's rank (a loaded value: 2-byte loads); its shrink is 0 past the rank
            bv = tl.load(b_base + (o_lo + cs)[:, None] * RB + rr[None, :], mask=cmask[:, None] & (rr < RB)[None, :],
                         other=0.0)
            sc = tl.load(scales_ptr + a)
            if USE_GDC:
                tl.extra.cuda.gdc_wait()
            base = (t * n_groups + g) * K_SPLITS
            s = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for i0 in tl.static_range(0, K_SPLITS, BLOCK_S):
                ii = i0 + tl.arange(0, BLOCK_S)
                p = tl.load(part_ptr + (base + ii)[:, None] * BLOCK_R + rr[None, :], mask=(ii < K_SPLITS)[:, None],
                            other=0.0)
                s += tl.sum(p, axis=0)
            s = s * sc
            upd = tl.sum(bv.to(tl.float32) * s[None, :], axis=1)
            yp = y_ptr + t * stride_y + o_lo + cs
            yv = tl.load(yp, mask=cmask, other=0.0).to(tl.float32)
            tl.store(yp, (yv + upd).to(y_ptr.dtype.element_ty), mask=cmask)


@jit
def _slice_bounds(sl, O1, O2, O3, O4):
    """Columns [lo, hi) of slice ``sl`` from the slice offsets 0, O1, O2, O3, O4 passed as kernel arguments (no load:
    the offsets are constants of a layer, so the first loads of a program do not wait on them)."""
    lo = tl.where(sl == 0, 0, tl.where(sl == 1, O1, tl.where(sl == 2, O2, O3)))
    hi = tl.where(sl == 0, O1, tl.where(sl == 1, O2, tl.where(sl == 2, O3, O4)))
    return lo, hi


@jit
def _tile_columns(sl, tile, O1, O2, O3, O4, BLOCK_N: tl.constexpr):
    """Column tile ``tile`` of slice ``sl`` (the expand kernels' grid is sized by the widest slice): (live, cols,
    cmask), live False for a tile past the slice's end, cmask the columns within it."""
    o_lo, o_hi = _slice_bounds(sl, O1, O2, O3, O4)
    c_lo = o_lo + tile * BLOCK_N
    cs = c_lo + tl.arange(0, BLOCK_N)
    return c_lo < o_hi, cs, cs < o_hi


@jit
def _decode_folded_expand_kernel(
    y_ptr, h_ptr, b_ptr, idx_ptr, ranks_ptr, scales_ptr,
    stride_y, stride_h, d_out, n_loras, R, O1, O2, O3, O4,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ONE_SLOT: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """``decode_lora_folded``'s per-token launch after the base GEMM (kernel="decode"): for token t, slice s and
    column tile c (one program each), with h = x @ [W; A]^T (the shrink of every slice and slot is in h's columns past
    d_out) and the slice's columns [lo, hi) = [O_s, O_s+1) (O_0 = 0):

    cols = lo + c * BLOCK_N + [0, BLOCK_N)  (within the slice); a = idx[t]
    y[t, cols] = h[t, cols] + scales[a] * h[t, d_out + (s * L + a) * R + :ranks[a]] @ B[a, cols, :ranks[a]]^T

    (the second term only for a >= 0 and ranks[a] > 0: every column of y is written, LoRA or not). The slot's rank and
    scale come from one load of the whole (L,) vectors, issued with the loads of idx and of h, so a program waits on
    one memory round trip before it reads the slot's shrink and B; with one slot (ONE_SLOT, L == 1) even those are
    loaded speculatively at once and masked afterwards: one round trip in all. USE_GDC (launched with programmatic
    dependent launch): idx, ranks, scales and the one slot's B are read before ``gdc_wait`` (the GEMM before this
    launch does not write them), h after it.
    """
    t = tl.program_id(0)
    sl = tl.program_id(1)
    live, cs, cmask = _tile_columns(sl, tl.program_id(2), O1, O2, O3, O4, BLOCK_N)
    if live:  # a narrower slice's surplus tiles have no columns
        h_row = h_ptr + t.to(tl.int64) * stride_h
        a = tl.load(idx_ptr + t)
        ll = tl.arange(0, BLOCK_L)
        lmask = ll < n_loras
        rk_all = tl.load(ranks_ptr + ll, mask=lmask, other=0)
        sc_all = tl.load(scales_ptr + ll, mask=lmask, other=0.0)
        r = tl.sum(tl.where(ll == a, rk_all, 0), axis=0)
        sc = tl.sum(tl.where(ll == a, sc_all, 0.0), axis=0)
        rr = tl.arange(0, BLOCK_R)
        if ONE_SLOT:
            bv = tl.load(b_ptr + cs[:, None] * R + rr[None, :], mask=cmask[:, None] & (rr < R)[None, :], other=0.0)
            if USE_GDC:
                tl.extra.cuda.gdc_wait()
            acc = tl.load(h_row + cs, mask=cmask, other=0.0).to(tl.float32)
            s = tl.load(h_row + d_out + sl * R + rr, mask=rr < R, other=0.0)
            s = tl.where((rr < r) & (a == 0), s.to(tl.float32) * sc, 0.0)
            acc += tl.sum(bv.to(tl.float32) * s[None, :], axis=1)
        else:
            if USE_GDC:
                tl.extra.cuda.gdc_wait()
            acc = tl.load(h_row + cs, mask=cmask, other=0.0).to(tl.float32)
            if (a >= 0) & (r > 0):
                rmask = rr < r
                s = tl.load(h_row + d_out + (sl * n_loras + a) * R + rr, mask=rmask, other=0.0)
                s = s.to(tl.float32) * sc
                bv = tl.load(b_ptr + (a.to(tl.int64) * d_out + cs[:, None]) * R + rr[None, :],  # masked by R, not
                             mask=cmask[:, None] & (rr < R)[None, :], other=0.0)  # the rank: vector loads (s is 0)
                acc += tl.sum(bv.to(tl.float32) * s[None, :], axis=1)
        tl.store(y_ptr + t.to(tl.int64) * stride_y + cs, acc.to(y_ptr.dtype.element_ty), mask=cmask)


@jit
def _tile_slot(a, rowmask):
    """The slot every row of a token tile that has one uses (rows without LoRA, a = -1, aside), or -1 when they use
    several or none: then the tile's expand can take that slot's B loaded up front (``_slot_factors``)."""
    hi = tl.max(tl.where(rowmask, a, -1), axis=0)
    lo = tl.min(tl.where(rowmask & (a >= 0), a, hi), axis=0)
    return tl.where(lo == hi, hi, -1)


@jit
def _slot_factors(b_ptr, ranks_ptr, scales_ptr, slot, cs, cmask, d_out, R, BLOCK_R: tl.constexpr):
    """Slot ``slot``'s B tile (BLOCK_R x cols, rows past R zero), rank and scale, for ``_add_slot_expand``: loaded by
    the folded kernels up front, before they wait on the GEMM or the shrink (nothing before them in the launch
    writes these). ``slot``: 0 with one slot (ONE_SLOT), else a scalar tensor from ``_tile_slot`` (-1: zeros,
    nothing read)."""
    rr = tl.arange(0, BLOCK_R)
    ok = slot >= 0
    l = tl.maximum(slot, 0)  # slot 0's rank and scale are read for -1 (a valid address), then dropped
    rmask = (rr < R) & (rr * 0 + slot >= 0)  # per element: the interpreter's bool & 0-d bool is not a bool mask
    bv = tl.load(b_ptr + (l * d_out + cs[None, :]).to(tl.int64) * R + rr[:, None],
                 mask=rmask[:, None] & cmask[None, :], other=0.0)
    return bv, tl.where(ok, tl.load(ranks_ptr + l), 0), tl.where(ok, tl.load(scales_ptr + l), 0.0)


@jit
def _all_slot_factors(b_ptr, ranks_ptr, scales_ptr, a, rowmask, cs, cmask, d_out, n_loras, R,
                      BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr):
    """Every slot's B as ONE (BLOCK_J x cols) tile for ``_add_all_slot_expand``: row j is (slot l, rank r) = (j //
    BLOCK_R, j % BLOCK_R), zero past the slots or past R; the slot's rank per row j; each token row's scale (0
    without a slot). Loaded by the folded kernels before they wait on the GEMM or the shrink: one round trip for all
    slots, where the per-slot loop pays one or two per slot. Rows are BLOCK_R apart and masked only per slot and by
    R, so each slot's B rows load as contiguous vectors (a mask by the slot's rank, a loaded value, would split them
    into 2-byte loads); the rank masks the shrink instead, as the one-slot path does."""
    j = tl.arange(0, BLOCK_J)
    l_j = j // BLOCK_R
    r_j = j % BLOCK_R
    on = (l_j < n_loras) & (r_j < R)
    bt = tl.load(b_ptr + (l_j[:, None] * d_out + cs[None, :]).to(tl.int64) * R + r_j[:, None],
                 mask=on[:, None] & cmask[None, :], other=0.0)
    rank_j = tl.load(ranks_ptr + l_j, mask=l_j < n_loras, other=0)
    return bt, rank_j, tl.load(scales_ptr + a, mask=rowmask & (a >= 0), other=0.0)


@jit
def _add_all_slot_expand(acc, s_rows, a, rowmask, cmask, n_loras, R, sl, bt, rank_j, scale_t,
                         BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, PREC: tl.constexpr, CACHE: tl.constexpr):
    """``_add_slot_expand`` of slice ``sl`` for tiles of several slots in one tl.dot over every slot's rank rows:

    acc[t, c] + scale_t[t] * (S[t, (sl * L + l) * R + r] for j = (l, r) of t's slot, r < its rank; else 0) @ bt[j, c]

    with ``bt``, ``rank_j``, ``scale_t`` from ``_all_slot_factors`` (``cmask`` picks this slice's columns of bt). A
    row's other slots' shrinks are masked out, so each row gets its own slot's term, as the loop gives."""
    j = tl.arange(0, BLOCK_J)
    l_j = j // BLOCK_R
    r_j = j % BLOCK_R
    sv = tl.load(s_rows + (sl * n_loras + l_j[None, :]) * R + r_j[None, :],
                 mask=rowmask[:, None] & (a[:, None] == l_j[None, :]) & (r_j < R)[None, :], other=0.0,
                 cache_modifier=CACHE)
    sv = tl.where((r_j < rank_j)[None, :], sv, 0.0).to(bt.dtype)
    bv = tl.where(cmask[None, :], bt, 0.0)
    return acc + dot(sv, bv, PREC) * scale_t[:, None]


@jit
def _gemv_dot(a, b, PREC: tl.constexpr):
    """a (M, K) @ b (K, N) in fp32: tl.dot, or for M == 1 (tl.dot takes M >= 16) a broadcast multiply-and-sum."""
    if a.shape[0] == 1:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return dot(a, b, PREC)


@jit
def _gemv_x(x_ptr, rows, stride_x, ks, rowmask, kmask, BLOCK_M: tl.constexpr):
    """x's columns ``ks`` for one K step of the one-launch kernels: (BLOCK_M, BLOCK_K) for ``tl.dot``, or for one
    token (BLOCK_M == 1, ``GemvTiles.one_token``) a (BLOCK_K, 1) fp32 column."""
    if BLOCK_M == 1:  # if / else, one return: Triton type-checks every return statement, taken or not
        xv = tl.load(x_ptr + ks[:, None], mask=kmask[:, None], other=0.0).to(tl.float32)
    else:
        xv = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=rowmask[:, None] & kmask[None, :],
                     other=0.0)
    return xv


@jit
def _gemv_step(xv, wv, PREC: tl.constexpr, BLOCK_M: tl.constexpr):
    """One K step's contribution: x @ w (BLOCK_M, BLOCK_N) by tl.dot, or for one token the fp32 products per
    (k, column), (BLOCK_K, BLOCK_N): summed over k once after the loop (``_gemv_total``), not per step (a
    cross-thread reduction each step), and without tl.dot's padding of the token to 16 rows."""
    if BLOCK_M == 1:
        prod = xv * wv.to(tl.float32)
    else:
        prod = dot(xv, wv, PREC)
    return prod


@jit
def _gemv_total(acc, BLOCK_M: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) result of the ``_gemv_step`` sums (one token: the sum over k)."""
    if BLOCK_M == 1:
        acc = tl.sum(acc, axis=0)[None, :]
    return acc


@jit
def _add_loaded_slot_expand(acc, s_rows, a, rowmask, cmask, n_loras, R, sl, one_l, one_b, one_r, one_scale,
                            BLOCK_R: tl.constexpr, PREC: tl.constexpr, CACHE: tl.constexpr):
    """``_add_slot_expand`` for the rows of slot ``one_l`` whose B tile, rank and scale were loaded up front."""
    rr = tl.arange(0, BLOCK_R)
    sv = tl.load(s_rows + (sl * n_loras + one_l) * R + rr[None, :], mask=rowmask[:, None] & (rr < R)[None, :],
                 other=0.0, cache_modifier=CACHE)
    sv = tl.where((a == one_l)[:, None] & (rr < one_r)[None, :], sv, 0.0).to(one_b.dtype)
    bv = tl.where(cmask[None, :], one_b, 0.0)  # a tile straddling two slices: only this slice's columns
    return acc + dot(sv, bv, PREC) * one_scale


@jit
def _add_slot_expand(acc, s_rows, a, rowmask, cs, cmask, b_ptr, ranks_ptr, scales_ptr, d_out, n_loras, R, sl,
                     one_l, one_b, one_r, one_scale,
                     BLOCK_R: tl.constexpr, ONE_SLOT: tl.constexpr, PREC: tl.constexpr, CACHE: tl.constexpr):
    """The folded kernels' expand of slice ``sl`` into a (rows x cols) tile: returns

    acc[t, c] + scales[a[t]] * S[t, (sl * L + a[t]) * R + :ranks[a[t]]] @ B[a[t], c, :ranks[a[t]]]^T

    for the rows with a slot (a[t] >= 0, rank > 0) and the columns in ``cmask``; ``s_rows`` (rows x 1 pointers) is
    where each row's shrink S starts. When every row with a slot uses slot ``one_l`` (always with ONE_SLOT, L == 1,
    one_l = 0; else ``_tile_slot``, -1 when rows use several), its B, rank and scale come in as ``one_b``, ``one_r``,
    ``one_scale`` (``_slot_factors``, the tile's columns, loaded before the caller waited; ``cmask`` picks this
    slice's columns of it): one tl.dot. Otherwise a loop over the slots that skips (in the kernel) those no row
    uses, one tl.dot each, B read there. CACHE: the cache modifier of S's load ("" or ".cg" for a shrink another
    program of the same launch wrote)."""
    rr = tl.arange(0, BLOCK_R)
    if ONE_SLOT:
        acc = _add_loaded_slot_expand(acc, s_rows, a, rowmask, cmask, n_loras, R, sl, 0, one_b, one_r, one_scale,
                                      BLOCK_R, PREC, CACHE)
    elif one_l >= 0:
        acc = _add_loaded_slot_expand(acc, s_rows, a, rowmask, cmask, n_loras, R, sl, one_l, one_b, one_r,
                                      one_scale, BLOCK_R, PREC, CACHE)
    else:
        for l in range(0, n_loras):
            r = tl.load(ranks_ptr + l)
            if (tl.max((a == l).to(tl.int32), axis=0) > 0) & (r > 0):
                bv = tl.load(b_ptr + (l * d_out + cs[None, :]).to(tl.int64) * R + rr[:, None],  # masked by R, not
                             mask=(rr < R)[:, None] & cmask[None, :], other=0.0)  # the rank: vector loads (S is 0)
                acc = _add_loaded_slot_expand(acc, s_rows, a, rowmask, cmask, n_loras, R, sl, l, bv, r,
                                              tl.load(scales_ptr + l), BLOCK_R, PREC, CACHE)
    return acc


@jit(do_not_specialize=["T"])  # one compiled kernel for every token count (no JIT when a new T shows up mid-serving)
def _fold_expand_gemm_kernel(
    y_ptr, h_ptr, b_ptr, idx_ptr, ranks_ptr, scales_ptr,
    T, stride_y, stride_h, d_out, n_loras, R, O1, O2, O3, O4,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ONE_SLOT: tl.constexpr,
    PREC: tl.constexpr, USE_GDC: tl.constexpr, BLOCK_J: tl.constexpr = 0,
):
    """``decode_lora_folded``'s tiled launch after the base GEMM (kernel="gemm", any token count): for token tile m,
    slice s and column tile c (one program each), with h = x @ [W; A]^T and the slice's columns [lo, hi):

    rows = m * BLOCK_M + [0, BLOCK_M) (< T); cols = lo + c * BLOCK_N + [0, BLOCK_N)  (within the slice)
    y[rows, cols] = h[rows, cols] + sum over slots a used in rows of
                    scales[a] * (mask_a * h[rows, d_out + (s * L + a) * R + :ranks[a]]) @ B[a, cols, :ranks[a]]^T

    where mask_a keeps the rows t with idx[t] == a (-1 = no LoRA matches no slot): for every token, the same sum as
    the per-token kernel. Tokens need not be sorted by slot: a tile loops over the slots and skips (inside the
    kernel, no host sync) those no row of the tile uses, so a tile of one adapter does one (BLOCK_M x R) @ (R x
    BLOCK_N) tl.dot and a tile mixing k adapters k of them; nothing is padded to the largest rank beyond BLOCK_R.
    A tile whose rows with a slot all use one (always with ONE_SLOT, L == 1; one token always) does one tl.dot with
    that slot's B loaded at once, before the GEMM's output is awaited. Products in fp32 (PREC for fp32 inputs).
    BLOCK_J > 0 (several slots whose L x R rank rows fit one tile, ``all_slots_block``): every tile does ONE tl.dot
    over all slots' rank rows instead (``_add_all_slot_expand``), their B read at once.
    USE_GDC (programmatic dependent launch): idx and that slot's B (or every used slot's), rank and scale are read
    before ``gdc_wait``, h (the GEMM's output) after it.
    """
    pid_m = tl.program_id(0)
    sl = tl.program_id(1)
    live, cs, cmask = _tile_columns(sl, tl.program_id(2), O1, O2, O3, O4, BLOCK_N)
    if live:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rowmask = rows < T
        rows64 = rows.to(tl.int64)
        a = tl.load(idx_ptr + rows, mask=rowmask, other=-1)
        if BLOCK_J > 0:
            bt, rank_j, scale_t = _all_slot_factors(b_ptr, ranks_ptr, scales_ptr, a, rowmask, cs, cmask, d_out,
                                                    n_loras, R, BLOCK_R, BLOCK_J)
        else:
            if ONE_SLOT:
                one_l = 0
            else:
                one_l = _tile_slot(a, rowmask)
            one_b, one_r, one_scale = _slot_factors(b_ptr, ranks_ptr, scales_ptr, one_l, cs, cmask, d_out, R,
                                                    BLOCK_R)
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
        acc = tl.load(h_ptr + rows64[:, None] * stride_h + cs[None, :], mask=rowmask[:, None] & cmask[None, :],
                      other=0.0).to(tl.float32)
        s_rows = h_ptr + rows64[:, None] * stride_h + d_out
        if BLOCK_J > 0:
            acc = _add_all_slot_expand(acc, s_rows, a, rowmask, cmask, n_loras, R, sl, bt, rank_j, scale_t,
                                       BLOCK_R, BLOCK_J, PREC, "")
        else:
            acc = _add_slot_expand(acc, s_rows, a, rowmask, cs, cmask, b_ptr, ranks_ptr, scales_ptr, d_out, n_loras,
                                   R, sl, one_l, one_b, one_r, one_scale, BLOCK_R, ONE_SLOT, PREC, "")
        tl.store(y_ptr + rows64[:, None] * stride_y + cs[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rowmask[:, None] & cmask[None, :])


@jit(do_not_specialize=["T"])  # one compiled kernel for every token count, as the unsorted one
def _fold_expand_sorted_kernel(
    y_ptr, h_ptr, b_ptr, order_ptr, starts_ptr, ranks_ptr, scales_ptr,
    T, stride_y, stride_h, d_out, n_loras, R, O1, O2, O3, O4,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
    PREC: tl.constexpr, USE_GDC: tl.constexpr,
):
    """``_fold_expand_gemm_kernel`` on tokens grouped by slot (``SlotSegments``; SGMV's segments): token tile m,
    slice s and column tile c (one program each). Group g < L is slot g's tokens, group L the tokens without LoRA;
    ``order[starts[g]:starts[g + 1]]`` are group g's tokens. Group g < L takes ceil(count_g / BLOCK_M) tiles, in
    group order, and group L every program after them (grid: min(ceil(T / BLOCK_M) + L, T) tiles cover every
    group, as no tile is empty; tokens >= T, the padding of a longer slot map, are masked). For tile m of group g,
    starting at position p0:

    rows = order[p0 + [0, BLOCK_M)] (within the group, < T); cols = lo + c * BLOCK_N + [0, BLOCK_N)
    y[rows, cols] = h[rows, cols] + scales[g] * h[rows, d_out + (s * L + g) * R + :ranks[g]] @ B[g, cols, :ranks[g]]^T
                    (g < L; group L: the copy alone)

    Every tile has one slot, so each program reads that slot's B tile alone (the unsorted kernel, with tokens of
    several slots in a tile, reads every slot's B or loops over them). USE_GDC: the groups, the slot's B, rank and
    scale are read before ``gdc_wait`` (nothing before this launch writes them), h after it."""
    pid_m = tl.program_id(0)
    sl = tl.program_id(1)
    live, cs, cmask = _tile_columns(sl, tl.program_id(2), O1, O2, O3, O4, BLOCK_N)
    if live:
        g = tl.arange(0, BLOCK_G)
        lo_g = tl.load(starts_ptr + g, mask=g <= n_loras, other=0)
        hi_g = tl.load(starts_ptr + g + 1, mask=g <= n_loras, other=0)
        tiles_g = tl.where(g < n_loras, (hi_g - lo_g + BLOCK_M - 1) // BLOCK_M, 0)
        ends_g = tl.cumsum(tiles_g, axis=0)  # the first tile past group g
        grp = tl.sum(((ends_g <= pid_m) & (g < n_loras)).to(tl.int32), axis=0)  # L: no slot
        first = tl.sum(tl.where(g == grp, ends_g - tiles_g, 0), axis=0)  # group L: every slot's tiles
        p0 = tl.sum(tl.where(g == grp, lo_g, 0), axis=0) + (pid_m - first) * BLOCK_M
        p_end = tl.sum(tl.where(g == grp, hi_g, 0), axis=0)
        ps = p0 + tl.arange(0, BLOCK_M)
        rows = tl.load(order_ptr + ps, mask=ps < p_end, other=T)
        rowmask = rows < T
        rows64 = rows.to(tl.int64)
        slot = tl.where(grp < n_loras, grp, -1)
        one_b, one_r, one_scale = _slot_factors(b_ptr, ranks_ptr, scales_ptr, slot, cs, cmask, d_out, R, BLOCK_R)
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
        acc = tl.load(h_ptr + rows64[:, None] * stride_h + cs[None, :], mask=rowmask[:, None] & cmask[None, :],
                      other=0.0).to(tl.float32)
        if slot >= 0:
            acc = _add_loaded_slot_expand(acc, h_ptr + rows64[:, None] * stride_h + d_out, rows * 0 + slot, rowmask,
                                          cmask, n_loras, R, sl, slot, one_b, one_r, one_scale, BLOCK_R, PREC, "")
        tl.store(y_ptr + rows64[:, None] * stride_y + cs[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rowmask[:, None] & cmask[None, :])


@jit(do_not_specialize=["T"])
def _fold_gemv_kernel(
    y_ptr, x_ptr, w_ptr, b_ptr, idx_ptr, ranks_ptr, scales_ptr, s_ptr, part_ptr, cnt_ptr, sync_ptr,
    T, stride_x, stride_y, d_in, d_out, a_rows, n_loras, R, O1, O2, O3, O4, n_a_tiles, n_w_tiles, k_chunk,
    N_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, ONE_SLOT: tl.constexpr, PREC: tl.constexpr,
    USE_GDC: tl.constexpr, BLOCK_J: tl.constexpr = 0,
):
    """``decode_lora_folded``'s one-launch path (kernel="gemv", T <= BLOCK_M tokens): the base GEMM, every slot's
    shrink and the expand in ONE kernel. Tile i is BLOCK_N rows of [W; A]: tiles 0 .. n_a_tiles-1 are A's rows
    (first, so their programs have the lowest ids), then W's. Program p computes tile i = p // SPLIT_K over the
    input columns [k * k_chunk, (k + 1) * k_chunk), k = p % SPLIT_K, of h = x @ [W; A]^T; with SPLIT_K > 1 it stores
    its fp32 partial and the last of the tile's programs to arrive (cnt[i]) sums them in split order (deterministic)
    and finishes the tile:

    A tile (rows d_out + j): s[:T, j] = h[:T, d_out + j] (rounded to x's dtype, as the folded GEMM rounds it), then
                             sync[0] += 1 (release); only the rows j = (s, l, r) the expand reads are read from A
                             (slot l used by a token, r < ranks[l]), the others are left zero
    W tile (cols c):         waits until sync[0] == n_a_tiles (acquire), then for each slice s its columns get
                             y[t, c] = h[t, c] + scales[a] * s[t, (s * L + a) * R + :ranks[a]] @ B[a, c, :ranks[a]]^T
                             with a = idx[t] (-1 / rank 0: no LoRA term); the last W tile finished resets sync.

    Counters are zero between calls (each is reset by its last user). The wait is safe: A programs have the lowest
    ids, so they are scheduled first and never wait themselves (the Triton interpreter runs programs in id order).
    When every token with a slot uses the same one (always with one slot, and for one token), a W tile's B for that
    slot is loaded before the GEMM loop (it does not depend on the shrink), not after the wait; with BLOCK_J > 0
    (several slots whose rank rows fit one tile, ``all_slots_block``) every used slot's B is, for one tl.dot over
    all of them (``_add_all_slot_expand``). USE_GDC (programmatic dependent launch): those loads and idx come before
    ``gdc_wait``, x (the previous kernel's output) after.
    (No one-token variant: with one-token products this kernel lost to its tl.dot form on every module measured
    on an H200.)
    """
    pid = tl.program_id(0)
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    is_a = tile < n_a_tiles
    n0 = tl.where(is_a, d_out + tile * BLOCK_N, (tile - n_a_tiles) * BLOCK_N)
    n_end = tl.where(is_a, d_out + a_rows, d_out)
    rows = tl.arange(0, BLOCK_M)
    rowmask = rows < T
    cs = n0 + tl.arange(0, BLOCK_N)
    cmask = cs < n_end
    a = tl.load(idx_ptr + rows, mask=rowmask, other=-1)
    if BLOCK_J > 0:
        bt, bt_rank, scale_t = _all_slot_factors(b_ptr, ranks_ptr, scales_ptr, a, rowmask, cs, cmask & (cs < d_out),
                                                 d_out, n_loras, R, BLOCK_R, BLOCK_J)
    else:
        if ONE_SLOT:
            one_l = 0
        else:
            one_l = _tile_slot(a, rowmask)
        one_b, one_r, one_scale = _slot_factors(b_ptr, ranks_ptr, scales_ptr, one_l, cs, cmask & (cs < d_out), d_out,
                                                R, BLOCK_R)
    # an A tile reads only the rows (l, r) the expand uses: slot l used by a token, r < ranks[l] (W tiles: j < 0)
    j = cs - d_out
    l_j = (j // R) % n_loras
    used = tl.max(((a[:, None] == l_j[None, :]) & rowmask[:, None]).to(tl.int32), axis=0) > 0
    keep = used & (j % R < tl.load(ranks_ptr + l_j, mask=cmask & (j >= 0), other=0))
    cmask_k = cmask & (keep | (j < 0))
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    k_lo = split * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, d_in)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k_hi
        xv = _gemv_x(x_ptr, rows, stride_x, ks, rowmask, kmask, BLOCK_M)
        wv = tl.load(w_ptr + cs.to(tl.int64)[None, :] * d_in + ks[:, None], mask=kmask[:, None] & cmask_k[None, :],
                     other=0.0)
        acc += _gemv_step(xv, wv, PREC, BLOCK_M)
    acc = _gemv_total(acc, BLOCK_M)
    finish = True
    if SPLIT_K > 1:
        tile_parts = part_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
        mn = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(tile_parts + split * (BLOCK_M * BLOCK_N) + mn, acc)
        tl.debug_barrier()  # every thread's stores are issued before the release below
        finish = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
        if finish:
            tl.debug_barrier()
            acc = tl.load(tile_parts + mn, cache_modifier=".cg")
            for k in range(1, SPLIT_K):
                acc += tl.load(tile_parts + k * (BLOCK_M * BLOCK_N) + mn, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
    if finish:
        if is_a:
            tl.store(s_ptr + rows[:, None] * a_rows + (cs - d_out)[None, :], acc.to(s_ptr.dtype.element_ty),
                     mask=rowmask[:, None] & cmask[None, :])
            tl.debug_barrier()
            tl.atomic_add(sync_ptr, 1, sem="release")
        else:
            seen = tl.load(sync_ptr, volatile=True)
            while seen < n_a_tiles:  # plain polling reads: no read-modify-write traffic on the counter while waiting
                seen = tl.load(sync_ptr, volatile=True)
            tl.atomic_add(sync_ptr, 0, sem="acquire")  # then one acquire: the shrink stores are visible below
            tl.debug_barrier()
            for sl in tl.static_range(N_SLICES):
                lo, hi = _slice_bounds(sl, O1, O2, O3, O4)
                if (n0 < hi) & (n0 + BLOCK_N > lo):  # a tile may straddle two slices: each adds its own columns
                    if BLOCK_J > 0:
                        acc = _add_all_slot_expand(acc, s_ptr + rows[:, None] * a_rows, a, rowmask,
                                                   cmask & (cs >= lo) & (cs < hi), n_loras, R, sl, bt, bt_rank,
                                                   scale_t, BLOCK_R, BLOCK_J, PREC, ".cg")
                    else:
                        acc = _add_slot_expand(acc, s_ptr + rows[:, None] * a_rows, a, rowmask, cs,
                                               cmask & (cs >= lo) & (cs < hi), b_ptr, ranks_ptr, scales_ptr, d_out,
                                               n_loras, R, sl, one_l, one_b, one_r, one_scale, BLOCK_R, ONE_SLOT,
                                               PREC, ".cg")
            tl.store(y_ptr + rows[:, None] * stride_y + cs[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=rowmask[:, None] & cmask[None, :])
            done = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
            if done == n_w_tiles - 1:  # every W tile is past its wait: ready for the next call
                tl.atomic_xchg(sync_ptr + 1, 0)
                tl.atomic_xchg(sync_ptr, 0)


@jit(do_not_specialize=["T"])
def _fold_gemv_local_kernel(
    y_ptr, x_ptr, w_ptr, b_ptr, idx_ptr, ranks_ptr, scales_ptr, part_ptr, cnt_ptr,
    T, stride_x, stride_y, d_in, d_out, n_loras, R, O1, O2, O3, k_chunk,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_J: tl.constexpr, PREC: tl.constexpr, USE_GDC: tl.constexpr, BLOCK_R: tl.constexpr = 16,
    STAGES: tl.constexpr = 1,
):
    """``decode_lora_folded``'s one-launch path with the shrink computed per tile (kernel="gemv",
    ``GemvTiles.local_shrink``; T <= BLOCK_M tokens, every slice offset a multiple of BLOCK_N). Program p computes
    output tile i = p // SPLIT_K (columns cs = i * BLOCK_N + [0, BLOCK_N), all in one slice s) over the input columns
    [k * k_chunk, (k + 1) * k_chunk), k = p % SPLIT_K, of both

        x @ W[cs]^T                                   (BLOCK_M x BLOCK_N)
        S = x @ A[s, l, r]^T for the rows (l, r) of slice s with slot l used by a token and r < ranks[l], row j =
                                       (j // BLOCK_R, j % BLOCK_R) of BLOCK_J (one token, BLOCK_M == 1: (its
                                       slot, j), its own slot's rows only)

    and with SPLIT_K > 1 stores its fp32 partials; the last of the tile's programs to arrive (cnt[i]) sums them in
    split order (deterministic) and resets cnt[i]. The tile is then finished as

        y[t, cs] = x[t] @ W[cs]^T + scales[a] * round(S[t, (a, :)]) @ B[a, cs, :]^T,  a = idx[t] (-1: no term)

    round: to x's dtype, as the folded GEMM rounds the shrink. BLOCK_M == 1 (``GemvTiles.one_token``, T == 1): the
    fp32 products accumulate per (k, column) through the loop and are summed over k once after it, not tl.dot,
    which pads the token to 16 rows (``_gemv_step``). Every tile reads A's rows of its slice again (from L2: A is
    S * L * R rows against W's d_out), so no program waits on another: no grid-wide hand-off, unlike
    ``_fold_gemv_kernel``. The slot ids, ranks, scales, the tile's B and the first BLOCK_K columns of its W and A rows
    are read before ``gdc_wait`` (USE_GDC), x after it. STAGES (``GemvTiles.stages``): the K loop's pipeline depth,
    its W, A (and x) tiles loaded STAGES - 1 steps ahead; 1: each step's loads wait for the step before."""
    pid = tl.program_id(0)
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    c_lo = tile * BLOCK_N
    sl = (c_lo >= O1).to(tl.int32) + (c_lo >= O2).to(tl.int32) + (c_lo >= O3).to(tl.int32)  # absent offsets = d_out
    rows = tl.arange(0, BLOCK_M)
    rowmask = rows < T
    cs = c_lo + tl.arange(0, BLOCK_N)
    cmask = cs < d_out
    j = tl.arange(0, BLOCK_J)
    a = tl.load(idx_ptr + rows, mask=rowmask, other=-1)
    if BLOCK_M == 1:  # one token: only its slot's R rows (l, r) = (a, j), however many slots the layer has
        l_j = j * 0 + tl.max(a, axis=0)
        r_j = j
    else:  # every slot's rows of this slice's A, BLOCK_R apart (a power of two: each slot's rows are contiguous)
        l_j = j // BLOCK_R
        r_j = j % BLOCK_R
    used = tl.max(((a[:, None] == l_j[None, :]) & rowmask[:, None]).to(tl.int32), axis=0) > 0
    # B rows masked per slot and by R only, not by use or rank (contiguous: vector loads); S is 0 there (A's mask)
    bmask = (l_j >= 0) & (l_j < n_loras) & (r_j < R)
    jmask = bmask & used
    jmask = jmask & (r_j < tl.load(ranks_ptr + l_j, mask=jmask, other=0))
    bt = tl.load(b_ptr + (l_j[:, None] * d_out + cs[None, :]).to(tl.int64) * R + r_j[:, None],
                 mask=bmask[:, None] & cmask[None, :], other=0.0)
    scale_t = tl.load(scales_ptr + a, mask=a >= 0, other=0.0)
    w_rows = cs.to(tl.int64)[None, :] * d_in
    a_rows = (d_out + sl * (n_loras * R) + l_j * R + r_j).to(tl.int64)[None, :] * d_in
    k_lo = split * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, d_in)
    # the first BLOCK_K columns of the W and A tiles are weights: read before the wait, while the kernel before drains
    ks = k_lo + tl.arange(0, BLOCK_K)
    kmask = ks < k_hi
    wv = tl.load(w_ptr + w_rows + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
    av = tl.load(w_ptr + a_rows + ks[:, None], mask=kmask[:, None] & jmask[None, :], other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    xv = _gemv_x(x_ptr, rows, stride_x, ks, rowmask, kmask, BLOCK_M)
    acc = _gemv_step(xv, wv, PREC, BLOCK_M)  # one token (BLOCK_M == 1): fp32 products per (k, column)
    s_acc = _gemv_step(xv, av, PREC, BLOCK_M)
    # STAGES: the loop's loads issued that many steps ahead (cp.async); Triton pipelines a loop without tl.dot (one
    # token) only when told so here, and with tl.dot the launch's num_stages = STAGES gives the same code as before
    for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k_hi
        xv = _gemv_x(x_ptr, rows, stride_x, ks, rowmask, kmask, BLOCK_M)
        wv = tl.load(w_ptr + w_rows + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
        av = tl.load(w_ptr + a_rows + ks[:, None], mask=kmask[:, None] & jmask[None, :], other=0.0)
        acc += _gemv_step(xv, wv, PREC, BLOCK_M)
        s_acc += _gemv_step(xv, av, PREC, BLOCK_M)
    acc = _gemv_total(acc, BLOCK_M)
    s_acc = _gemv_total(s_acc, BLOCK_M)
    finish = True
    if SPLIT_K > 1:
        per_split = BLOCK_M * (BLOCK_N + BLOCK_J)
        tile_parts = part_ptr + tile.to(tl.int64) * (SPLIT_K * per_split)
        mn = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        mj = BLOCK_M * BLOCK_N + rows[:, None] * BLOCK_J + j[None, :]
        tl.store(tile_parts + split * per_split + mn, acc)
        tl.store(tile_parts + split * per_split + mj, s_acc)
        tl.debug_barrier()  # every thread's stores are issued before the release below
        finish = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
        if finish:
            tl.debug_barrier()
            acc = tl.load(tile_parts + mn, cache_modifier=".cg")
            s_acc = tl.load(tile_parts + mj, cache_modifier=".cg")
            for k in range(1, SPLIT_K):
                acc += tl.load(tile_parts + k * per_split + mn, cache_modifier=".cg")
                s_acc += tl.load(tile_parts + k * per_split + mj, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
    if finish:
        sv = tl.where(a[:, None] == l_j[None, :], s_acc, 0.0).to(x_ptr.dtype.element_ty).to(bt.dtype)
        acc += _gemv_dot(sv, bt, PREC) * scale_t[:, None]
        tl.store(y_ptr + rows[:, None] * stride_y + cs[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rowmask[:, None] & cmask[None, :])


class DecodeWorkspace:
    """Scratch of ``decode_lora``: the fp32 partial shrinks the first kernel writes and the second sums.

    Every entry a call reads was written by the same call, so one workspace serves every layer of a model whose
    launches run one after another on one stream. Size it before CUDA-graph capture (``reserve``): a captured
    launch keeps the addresses it saw.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.partials = torch.empty(0, dtype=torch.float32, device=self.device)

    def reserve(self, grid: DecodeGrid) -> "DecodeWorkspace":
        """Grow (never shrink) to fit ``grid``."""
        if grid.partials > self.partials.numel():
            self.partials = torch.empty(grid.partials, dtype=torch.float32, device=self.device)
        return self

    def fits(self, grid: DecodeGrid) -> bool:
        return grid.partials <= self.partials.numel()


def decode_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                token_lora_indices: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                slice_offsets: Sequence[int], *, layout: str = "column", nblocks: int = 1,
                options: KernelOptions = DEFAULT_OPTIONS, soff: torch.Tensor | None = None,
                workspace: DecodeWorkspace | None = None, pdl: bool = False) -> LoraResult:
    """Multi-slice BGMV, in place, all slices in the same launches (Punica/vLLM semantics, -1 = no LoRA):

        for t with a = token_lora_indices[t] >= 0, for each slice s (columns soff[s]:soff[s+1] of y):
            y[t, soff[s]:soff[s+1]] += scales[a] * x[t] @ A[s, a] @ B[s, a]

    y (T, sum d_out_s); x (T, d_in); lora_a (S, L, R, d_in/N_a) and lora_b (L, sum d_out_s, R/N_b): packed PEFT
    orientation per slot (see ``stack_decode_weights``); ranks (L,) int: slot a uses the first ranks[a] ranks
    (block j of a block-diagonal factor = rank block j of ranks[a]/N); scales (L,) float. Meant for 1-64 tokens.
    Returns ``LoraResult(y, Dispatch)`` (y updated in place). Backends (``options.backend``): "triton" (below;
    "auto" where Triton runs the inputs), "torch" (``decode_lora_torch``; reference ``decode_lora_ref``).

    Triton: two launches, ``_decode_shrink_kernel`` (partial shrinks over ``block_k`` input splits, into
    ``workspace``) then ``_decode_expand_kernel`` (sums them, expands one ``block_n`` column tile per program), see
    ``decode_grid``; ``workspace`` is a ``DecodeWorkspace`` (a temporary one is made when None).

    CUDA-graph use (serving): pass ``token_lora_indices`` as int32 and ``ranks``/``scales`` as int32/float32 on
    y's device, ``soff``, the slice offsets as an int32 tensor on that device (else one is built from
    ``slice_offsets`` per call: a host-to-device copy), and a ``workspace`` reserved for the largest batch
    beforehand. Then a call issues exactly two kernel launches, no allocation and no host sync. Every token index
    outside [0, L) must be -1 for the Triton path (it reads ``ranks[idx]``). The torch fallback
    (``decode_lora_torch``) is sync-free too and ignores out-of-range indices.

    ``pdl``: launch both kernels with programmatic dependent launch where the GPU has it and the call passes what
    serving passes (the tensors above ready, ``soff`` given; ``_pdl_launch``), else ignored. The shrink then reads
    A while the kernel before it drains and x after it; the expand reads B while the shrink runs. Only x and y may
    be written by the kernels just before the call.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}")
    n_s = lora_a.shape[0]
    if len(slice_offsets) != n_s + 1 or slice_offsets[-1] != y.shape[1] or lora_b.shape[1] != y.shape[1]:
        raise ValueError("slice_offsets must have S+1 entries ending at y.shape[1] == lora_b.shape[1]")
    na, nb = (nblocks, 1) if layout == "row" else (1, nblocks)
    why = dispatch.triton_why_not(y, x, lora_a, lora_b)
    if why is None and not (y.stride(1) == 1 and x.stride(1) == 1 and lora_a.is_contiguous()
                            and lora_b.is_contiguous()):
        why = "y/x without unit column stride or LoRA buffers not contiguous"
    use, note = dispatch.resolve("decode_lora", options, x.device.type, triton=why)
    done = LoraResult(y, Dispatch("decode_lora", options.backend, use, note))
    if use == "torch":
        decode_lora_torch(y, x, lora_a, lora_b, token_lora_indices, ranks, scales, slice_offsets, layout, nblocks)
        return done

    t, d_in = x.shape
    if t == 0:
        return done
    n_l, r_max = lora_a.shape[1], lora_a.shape[2]
    max_block = max(slice_offsets[i + 1] - slice_offsets[i] for i in range(n_s)) // nb
    tiles = decode_tiles(x.device)
    grid = decode_grid(t, n_s, nb, max_block, d_in, r_max, tiles)
    if workspace is None:
        workspace = DecodeWorkspace(x.device).reserve(grid)
    elif not workspace.fits(grid) or workspace.partials.device != x.device:
        raise ValueError(f"decode_lora: the workspace on {workspace.partials.device} holds "
                         f"{workspace.partials.numel()} partials, this call needs {grid.partials} on {x.device}: "
                         f"reserve it for the largest batch first")
    gdc = _pdl_launch(pdl, x.device, (token_lora_indices, ranks, soff), (scales,))
    idx = token_lora_indices.to(device=x.device, dtype=torch.int32)
    ranks = ranks.to(device=x.device, dtype=torch.int32)
    scales = scales.to(device=x.device, dtype=torch.float32)
    if soff is None:
        soff = torch.tensor(list(slice_offsets), dtype=torch.int32, device=x.device)
    launch(_decode_shrink_kernel, (t, grid.n_groups, grid.k_splits),
        x, lora_a, idx, ranks, workspace.partials, x.stride(0), d_in, n_l, r_max, lora_a.shape[3], grid.n_groups,
        grid.k_splits, NA=na, NB=nb, BLOCK_R=grid.block_r, BLOCK_K=tiles.block_k, USE_GDC=gdc,
        num_warps=tiles.warps, launch_pdl=gdc,
    )
    launch(_decode_expand_kernel, (t, grid.n_groups, grid.n_tiles),
        y, lora_b, idx, ranks, scales, soff, workspace.partials, y.stride(0), y.shape[1], lora_b.shape[2],
        grid.n_groups, NB=nb, K_SPLITS=grid.k_splits, BLOCK_R=grid.block_r, BLOCK_N=tiles.block_n,
        BLOCK_S=tiles.block_s, USE_GDC=gdc, num_warps=tiles.warps, launch_pdl=gdc,
    )
    return done


def _pdl_launch(pdl: bool, device: torch.device, int32: tuple, float32: tuple) -> bool:
    """Whether a serving launch uses programmatic dependent launch: asked for (``pdl``), the GPU has it, and the
    small tensors its kernels read before they wait (slot ids, ranks, slice offsets: ``int32``; scales: ``float32``)
    are passed ready, as those dtypes on the device (None: not passed). A kernel launched so reads them before it waits
    on the kernel before it, so they must not be written by a conversion launched just before (serving passes them
    ready)."""
    if not (pdl and dispatch.pdl_ok(device)):
        return False
    want = [(v, torch.int32) for v in int32] + [(v, torch.float32) for v in float32]
    return all(v is not None and v.device == device and v.dtype == dt for v, dt in want)


@dataclass(frozen=True)
class FoldedWeight:
    """A base weight W (d_out, d_in) with the LoRA A factors of S slices x L slots of rank R stacked under it in one
    tensor: ``w_ext`` (d_out + S * L * R, d_in) = [W; A], ``base`` = w_ext[:d_out] (a view: hand it to the base
    layer in place of W), ``lora_a`` (S, L, R, d_in), a view of the rows after it. One GEMM with w_ext gives the base
    output and every slot's shrink (see ``decode_lora_folded``)."""

    w_ext: torch.Tensor
    d_out: int

    @property
    def base(self) -> torch.Tensor:
        return self.w_ext[: self.d_out]

    def lora_a(self, n_slices: int, n_loras: int, rank: int) -> torch.Tensor:
        return self.w_ext[self.d_out:].view(n_slices, n_loras, rank, self.w_ext.shape[1])


def fold_weight(weight: torch.Tensor, n_slices: int, n_loras: int, rank: int) -> FoldedWeight:
    """A copy of ``weight`` (d_out, d_in) with S * L * R zero rows under it for the A factors."""
    d_out, d_in = weight.shape
    w_ext = weight.new_empty(d_out + n_slices * n_loras * rank, d_in)
    w_ext[:d_out].copy_(weight)
    w_ext[d_out:].zero_()
    return FoldedWeight(w_ext, d_out)


@dataclass(frozen=True)
class SlotSegments:
    """A token -> slot map grouped by slot, for the tiled expand on sorted tokens (``FoldedLaunch(segments=...)``):
    ``order`` (int32, N) the token positions stably sorted by slot, the tokens without one (-1) last; ``starts``
    (int32, L + 2): group g's tokens are ``order[starts[g]:starts[g + 1]]``, group L those without a slot. Persistent
    buffers, rewritten in place by ``update`` (a CUDA graph that reads them sees each new map)."""

    order: torch.Tensor
    starts: torch.Tensor

    @classmethod
    def empty(cls, n_tokens: int, n_loras: int, device) -> "SlotSegments":
        return cls(torch.zeros(n_tokens, dtype=torch.int32, device=device),
                   torch.zeros(n_loras + 2, dtype=torch.int32, device=device))

    @property
    def n_loras(self) -> int:
        return self.starts.shape[0] - 2

    def update(self, token_lora_indices: torch.Tensor) -> "SlotSegments":
        """Groups ``token_lora_indices`` (N ints, -1 = no LoRA; ids outside [0, L) count as -1) into these buffers,
        on its device and without a host sync (a few small kernels: where, a stable sort, searchsorted)."""
        idx = token_lora_indices.to(device=self.order.device)
        n_l = self.n_loras
        if idx.shape[0] != self.order.shape[0]:
            raise ValueError(f"SlotSegments: {idx.shape[0]} slot ids for buffers of {self.order.shape[0]} tokens")
        key = torch.where((idx >= 0) & (idx < n_l), idx.long(), n_l)
        sorted_key, order = torch.sort(key, stable=True)
        groups = torch.arange(n_l + 2, device=idx.device, dtype=sorted_key.dtype)
        self.order.copy_(order)
        self.starts.copy_(torch.searchsorted(sorted_key, groups))
        return self


def slot_segments(token_lora_indices: torch.Tensor, n_loras: int) -> SlotSegments:
    """New ``SlotSegments`` of ``token_lora_indices`` for ``n_loras`` slots."""
    seg = SlotSegments.empty(token_lora_indices.shape[0], n_loras, token_lora_indices.device)
    return seg.update(token_lora_indices)


def _check_dot_tiles(tiles, dims: tuple[str, ...]) -> None:
    """Raises unless the ``dims`` fields of a tiles dataclass are powers of two >= 16 (tl.dot) and its warps valid."""
    for name in dims:
        v = getattr(tiles, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{type(tiles).__name__}.{name} must be a power of two >= 16 (tl.dot), got {v}")
    if tiles.warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{type(tiles).__name__}.warps must be 1, 2, 4, 8 or 16, got {tiles.warps}")


@dataclass(frozen=True)
class ExpandTiles:
    """Tiles of ``decode_lora_folded``'s kernel="gemm" launch: token rows and output columns per program, warps."""

    block_m: int = 16
    block_n: int = 64
    warps: int = 4

    def __post_init__(self):
        _check_dot_tiles(self, ("block_m", "block_n"))


@dataclass(frozen=True)
class GemvTiles:
    """Tiles of ``decode_lora_folded``'s kernel="gemv" launch: rows of [W; A] per tile, input columns per step,
    programs per tile (each a 1/split_k share of the input columns), warps, pipeline stages; and where the shrink is
    computed: ``local_shrink`` False, by tiles of A's rows that the W tiles wait for (``_fold_gemv_kernel``); True,
    by every W tile for its own slice, so no program waits on another (``_fold_gemv_local_kernel``; every slice
    offset must then be a multiple of block_n). ``one_token`` (with ``local_shrink`` only): a call of one token
    accumulates its fp32 products per (input column, output column) and sums them over the input once, not through
    tl.dot's 16-row tiles, and reads only its own slot's A rows (serving: ``gemv_one_token_shapes``)."""

    block_n: int = 16
    block_k: int = 256
    split_k: int = 4
    warps: int = 4
    stages: int = 3
    local_shrink: bool = False
    one_token: bool = False  # a one-token call sums fp32 products instead of tl.dot's 16-row tiles

    def __post_init__(self):
        _check_dot_tiles(self, ("block_n", "block_k"))
        if not 1 <= self.split_k <= 64 or not 1 <= self.stages <= 8:
            raise ValueError(f"GemvTiles: split_k must be 1-64 and stages 1-8, got {self.split_k}, {self.stages}")
        for name in ("local_shrink", "one_token"):
            if getattr(self, name) not in (True, False):
                raise ValueError(f"GemvTiles: {name} must be true or false, got {getattr(self, name)!r}")
        if self.one_token and not self.local_shrink:
            raise ValueError("GemvTiles: one_token needs local_shrink=True (the shared-shrink kernel has no one-token "
                             "variant: it was measured slower than its tl.dot form)")

    def block_m(self, tokens: int) -> int:
        """The kernels' token rows for a call of ``tokens`` tokens: 1 for one token with ``one_token``, else T
        rounded up to a power of two >= 16 (tl.dot)."""
        return 1 if tokens == 1 and self.one_token else max(16, next_pow2(tokens))

    def shrink_rows(self, tokens: int, n_loras: int, rank: int) -> int:
        """The per-tile shrink's rows (``local_shrink``: BLOCK_J) for a call of ``tokens`` tokens on a layer of
        ``n_loras`` slots of rank ``rank``: every slot's (each slot's rows padded to the rank's power of two, the
        slots to a power of two), or for one token (``block_m`` 1) its own slot's only."""
        if self.block_m(tokens) == 1:
            return max(16, next_pow2(rank))
        return max(16, next_pow2(n_loras) * next_pow2(rank))

    def shrink_stride(self, tokens: int, n_loras: int, rank: int) -> int:
        """The per-tile shrink's rows per slot (BLOCK_R: slot l's rows start at l x BLOCK_R of BLOCK_J) for a call
        of ``tokens`` tokens; one token reads its own slot's rows only, so its BLOCK_R is unused (16)."""
        if self.block_m(tokens) == 1:
            return 16
        return self.shrink_rows(tokens, n_loras, rank) // next_pow2(n_loras)

    def fits_slices(self, slice_offsets: Sequence[int]) -> bool:
        """Whether these tiles take a layer of these slice offsets (local_shrink: no tile straddles two slices)."""
        return not self.local_shrink or all(int(o) % self.block_n == 0 for o in slice_offsets[1:-1])


#: The most tokens the one-launch kernel ("gemv") takes: one token tile per program (BLOCK_M = T rounded up).
GEMV_MAX_TOKENS = 64


class GemvWorkspace:
    """Scratch of kernel="gemv" calls on one device: the shrink (``GEMV_MAX_TOKENS`` x LoRA rows, in the layers'
    dtype) that the A tiles write and the W tiles read, the fp32 split-K partials, one int32 counter per tile and two
    more (all counters zero between calls: the kernel resets each after its last use). Every entry a call reads was
    written by the same call, so the folded layers of a model, run one after another on one stream, share one
    workspace; concurrent calls may not. Size it before CUDA-graph capture (``reserve``): a captured launch keeps the
    addresses it saw."""

    def __init__(self, device: torch.device | str, dtype: torch.dtype):
        self.device, self.dtype = torch.device(device), dtype
        self.shrink = torch.empty(0, dtype=dtype, device=self.device)
        self.partials = torch.empty(0, dtype=torch.float32, device=self.device)
        self.counters = torch.zeros(2, dtype=torch.int32, device=self.device)

    @staticmethod
    def needs(folded: "FoldedWeight", tokens: int, tiles: GemvTiles) -> tuple[int, int, int]:
        """(shrink entries, partial floats, counters) one call needs."""
        a_rows = folded.w_ext.shape[0] - folded.d_out
        block_m = tiles.block_m(tokens)
        if tiles.local_shrink:  # per tile: its columns and (at most, one slice's) shrink; no shared shrink
            n_tiles = -(-folded.d_out // tiles.block_n)
            # BLOCK_J <= 2 x next_pow2(a_rows): next_pow2(L) x next_pow2(R) is a power of two below 4 L R
            width, shrink = tiles.block_n + max(16, 2 * next_pow2(a_rows)), 0
        else:
            n_tiles = -(-a_rows // tiles.block_n) + -(-folded.d_out // tiles.block_n)
            width, shrink = tiles.block_n, GEMV_MAX_TOKENS * max(1, a_rows)
        parts = n_tiles * tiles.split_k * block_m * width if tiles.split_k > 1 else 0
        return shrink, parts, 2 + n_tiles

    def reserve(self, folded: "FoldedWeight", tokens: int, tiles: GemvTiles) -> "GemvWorkspace":
        """Grow (never shrink) to fit a call of ``tokens`` tokens on ``folded`` with ``tiles``."""
        n_s, n_p, n_c = self.needs(folded, tokens, tiles)
        if n_s > self.shrink.numel():
            self.shrink = torch.empty(n_s, dtype=self.dtype, device=self.device)
        if n_p > self.partials.numel():
            self.partials = torch.empty(n_p, dtype=torch.float32, device=self.device)
        if n_c > self.counters.numel():
            self.counters = torch.zeros(n_c, dtype=torch.int32, device=self.device)
        return self

    def fits(self, folded: "FoldedWeight", tokens: int, tiles: GemvTiles) -> bool:
        n_s, n_p, n_c = self.needs(folded, tokens, tiles)
        return n_s <= self.shrink.numel() and n_p <= self.partials.numel() and n_c <= self.counters.numel()


#: The most B elements per thread a tile of the folded kernels holds to expand tokens of several slots in one tl.dot
#: (``all_slots_block``): beyond, its registers spill. Compiled for sm90, the expand kernel's 256 rank rows (4 slots
#: of 64) by 64 columns take 255 registers and 48 bytes of stack at 4 warps, 159 registers and no stack at 8.
ALL_SLOTS_PER_THREAD = 64


def all_slots_block(n_loras: int, rank: int, block_n: int, warps: int) -> int:
    """BLOCK_J of the folded expand kernels for ``n_loras`` slots of buffer rank ``rank``, tiles of ``block_n``
    columns and ``warps`` warps: every slot's BLOCK_R (the rank's power of two, >= 16) rows, the slots padded to a
    power of two, when that B tile fits ``ALL_SLOTS_PER_THREAD`` elements per thread, else 0 (the per-slot loop).
    One slot: 0 (its own path, ONE_SLOT)."""
    if n_loras <= 1:
        return 0
    block_j = next_pow2(n_loras) * max(16, next_pow2(rank))
    return block_j if block_j * block_n <= ALL_SLOTS_PER_THREAD * 32 * warps else 0


def _expand_warps(n_loras: int, rank: int, block_n: int, warps: int) -> int:
    """The tiled expand kernel's warps: the tiles' own, or as many as (up to 8) its all-slots B tile needs to fit
    in registers (it has no K loop, so more warps only split the tile finer)."""
    block_j = all_slots_block(n_loras, rank, block_n, 8)
    if block_j == 0:
        return warps
    return max(warps, -(-block_j * block_n // (ALL_SLOTS_PER_THREAD * 32)))


#: ``decode_lora_folded`` kernels: "decode" (one program per token x slice x column tile; decode steps), "gemm"
#: (token tiles through tl.dot; any token count) and "gemv" (base GEMM, shrink and expand in one launch; up to
#: ``GEMV_MAX_TOKENS``). Which one serves which token count is data (bdlora.vllm_plugin.fast_path.tuning).
FOLDED_KERNELS = ("decode", "gemm", "gemv")
MAX_FOLDED_SLICES = 4


def _check_folded(folded: FoldedWeight, lora_b: torch.Tensor, slice_offsets: Sequence[int], kernel: str) -> None:
    """Raises unless [W; A], B, the slice offsets and the kernel fit together (``decode_lora_folded``'s contract)."""
    d_out = folded.d_out
    n_l, b_out, r = lora_b.shape
    n_s = len(slice_offsets) - 1
    if b_out != d_out or slice_offsets[-1] != d_out or folded.w_ext.shape[0] != d_out + n_s * n_l * r:
        raise ValueError(f"decode_lora_folded: w_ext has {folded.w_ext.shape[0]} rows, lora_b {tuple(lora_b.shape)} "
                         f"and slice offsets end at {slice_offsets[-1]}; expected d_out={d_out} rows of W plus "
                         f"S*L*R = {n_s}*{n_l}*{r} of A (fold_weight(W, S, L, R))")
    if kernel not in FOLDED_KERNELS:
        raise ValueError(f"decode_lora_folded: kernel must be one of {FOLDED_KERNELS}, got {kernel!r}")
    if not 1 <= n_s <= MAX_FOLDED_SLICES:
        raise ValueError(f"decode_lora_folded: {n_s} slices; 1 to {MAX_FOLDED_SLICES} supported")


def _folded_why_not(w_ext: torch.Tensor, lora_b: torch.Tensor, *like: torch.Tensor) -> str | None:
    """Why the folded kernels cannot run Triton on [W; A], B and the tensors ``like`` (x), or None: they can."""
    why = dispatch.triton_why_not(*like, w_ext, lora_b)
    if why is None and not lora_b.is_contiguous():
        why = "lora_b not contiguous"
    return why


class FoldedLaunch:
    """``decode_lora_folded`` with kernel "decode" or "gemm" for one layer, its constant arguments bound and checked
    once: ``plan(x)`` is the y of ``decode_lora_folded(x, folded, lora_b, token_lora_indices[:T], ranks, scales,
    slice_offsets, kernel=..., tiles=..., pdl=..., options=...)`` for x (T, d_in) of [W; A]'s dtype and device, T at
    most the length of ``token_lora_indices``.

    Why: a prefill runs the BD layers eagerly, so their host time is paid per call (BENCHMARKS.md, "Prepared
    launches per layer": 3-4x less per call than a one-off call). A call here does the GEMM, allocates y and
    relaunches the kept expand kernel (``launch.KeptLaunch``): no argument checks, no conversions, no specialization
    key. The plugin's ``fold_linear`` keeps one plan per layer and tiles;
    ``decode_lora_folded`` builds one per call. The tensors are bound, not copied: every call reads the current
    contents of ``token_lora_indices``, ``ranks`` and ``scales`` when they are passed ready (int32, int32, float32 on
    the device; otherwise the plan binds converted copies, as a one-off call may). ``like`` (decode_lora_folded's x)
    joins the Triton-or-torch decision when given. ``segments`` (kernel "gemm", several slots): the tiles run on the
    tokens grouped by slot (``_fold_expand_sorted_kernel``), as ``segments`` holds them: it must group the current
    contents of ``token_lora_indices`` (``SlotSegments.update`` after each change of the map).
    """

    def __init__(self, folded: FoldedWeight, lora_b: torch.Tensor, token_lora_indices: torch.Tensor,
                 ranks: torch.Tensor, scales: torch.Tensor, slice_offsets: Sequence[int], *, kernel: str = "gemm",
                 tiles: ExpandTiles | None = None, pdl: bool = False, options: KernelOptions = DEFAULT_OPTIONS,
                 like: torch.Tensor | None = None, segments: SlotSegments | None = None):
        _check_folded(folded, lora_b, slice_offsets, kernel)
        if kernel == "gemv":
            raise ValueError("FoldedLaunch: kernel='gemv' (tiles that depend on T) goes through decode_lora_folded")
        if segments is not None and (kernel != "gemm" or segments.n_loras != lora_b.shape[0]
                                     or segments.order.shape[0] != token_lora_indices.shape[0]):
            raise ValueError(f"FoldedLaunch: segments (for {segments.n_loras} slots, {segments.order.shape[0]} "
                             f"tokens) need kernel='gemm' and must group this slot map ({lora_b.shape[0]} slots, "
                             f"{token_lora_indices.shape[0]} tokens)")
        w = folded.w_ext
        self.folded, self.lora_b, self.d_out = folded, lora_b, folded.d_out
        self.offsets = tuple(int(o) for o in slice_offsets)
        self.max_tokens = token_lora_indices.shape[0]
        why = _folded_why_not(w, lora_b, *((like,) if like is not None else ()))
        self.use, note = dispatch.resolve("decode_lora_folded", options, w.device.type, triton=why)
        self.dispatch = Dispatch("decode_lora_folded", options.backend, self.use, note)
        n_l, _, r = lora_b.shape
        n_s = len(self.offsets) - 1
        seg = () if segments is None else (segments.order, segments.starts)
        gdc = _pdl_launch(pdl, w.device, (token_lora_indices, ranks) + seg, (scales,))
        self.idx = token_lora_indices.to(device=w.device, dtype=torch.int32)
        self._extra_tiles = 0  # token tiles past ceil(T / block_m): the sorted kernel's per-slot remainders
        self.ranks = ranks.to(device=w.device, dtype=torch.int32)
        self.scales = scales.to(device=w.device, dtype=torch.float32)
        offs = list(self.offsets[1:]) + [self.d_out] * (MAX_FOLDED_SLICES - n_s)
        widest = max(self.offsets[i + 1] - self.offsets[i] for i in range(n_s))
        block_r = max(16, next_pow2(r))
        stride_h = w.shape[0]  # h = x @ [W; A]^T is contiguous; y's row stride is d_out
        self._args = (lora_b, self.idx, self.ranks, self.scales)  # after y and h
        if kernel == "decode":  # one program per token: T is the grid, not an argument
            dt = decode_tiles(w.device)
            self._block_m, self._grid_rest = 0, (n_s, -(-widest // dt.block_n))
            self._args += (self.d_out, stride_h, self.d_out, n_l, r, *offs)
            self._launch = KeptLaunch(_decode_folded_expand_kernel, fresh=(0, 1), BLOCK_L=next_pow2(n_l),
                                      BLOCK_R=block_r, BLOCK_N=dt.block_n, ONE_SLOT=n_l == 1, USE_GDC=gdc,
                                      num_warps=dt.warps, launch_pdl=gdc)
        else:  # token tiles; T (argument 6) is do_not_specialize: one kept kernel for every T
            t = tiles or ExpandTiles()
            self._block_m, self._grid_rest = t.block_m, (n_s, -(-widest // t.block_n))
            self._rest = (self.d_out, stride_h, self.d_out, n_l, r, *offs)
            if segments is not None and n_l > 1:  # one slot per tile: no all-slot B tile, the tiles' own warps
                self._args = (lora_b, segments.order, segments.starts, self.ranks, self.scales)
                self._launch = KeptLaunch(_fold_expand_sorted_kernel, fresh=(0, 1), varying=(7,),
                                          BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_R=block_r,
                                          BLOCK_G=next_pow2(n_l + 1), PREC=dispatch.dot_precision(w.dtype),
                                          USE_GDC=gdc, num_warps=t.warps, launch_pdl=gdc)
                self._extra_tiles = n_l
                return
            warps = _expand_warps(n_l, r, t.block_n, t.warps)
            self._launch = KeptLaunch(_fold_expand_gemm_kernel, fresh=(0, 1), varying=(6,), BLOCK_M=t.block_m,
                                      BLOCK_N=t.block_n, BLOCK_R=block_r, ONE_SLOT=n_l == 1,
                                      PREC=dispatch.dot_precision(w.dtype), USE_GDC=gdc,
                                      BLOCK_J=all_slots_block(n_l, r, t.block_n, warps), num_warps=warps,
                                      launch_pdl=gdc)

    @property
    def sorted(self) -> bool:
        """Whether the tiled kernel runs on the tokens grouped by slot (segments given, several slots)."""
        return self._extra_tiles > 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if t > self.max_tokens:
            raise ValueError(f"decode_lora_folded: {t} tokens but {self.max_tokens} slot ids (token_lora_indices)")
        h = F.linear(x, self.folded.w_ext)
        if self.use == "torch":
            return decode_lora_folded_torch(h, self.d_out, self.lora_b, self.idx[:t], self.ranks, self.scales,
                                            self.offsets)
        y = h.new_empty(t, self.d_out)
        if t == 0:
            return y
        if self._block_m == 0:
            self._launch((t,) + self._grid_rest, y, h, *self._args)
        else:
            tiles = -(-t // self._block_m)
            if self._extra_tiles:  # grouped: a tile per group remainder, at most one per token (none is empty)
                tiles = min(tiles + self._extra_tiles, t)
            self._launch((tiles,) + self._grid_rest, y, h, *self._args, t, *self._rest)
        return y


def decode_lora_folded(x: torch.Tensor, folded: FoldedWeight, lora_b: torch.Tensor, token_lora_indices: torch.Tensor,
                       ranks: torch.Tensor, scales: torch.Tensor, slice_offsets: Sequence[int], *,
                       options: KernelOptions = DEFAULT_OPTIONS, soff: torch.Tensor | None = None,
                       kernel: str = "decode", tiles: ExpandTiles | None = None,
                       gemv_tiles: GemvTiles | None = None, workspace: GemvWorkspace | None = None,
                       pdl: bool = False, sort_tokens: bool = False) -> LoraResult:
    """Base layer plus multi-slice BGMV/SGMV with the shrink inside the base GEMM (Punica/vLLM semantics, -1 = no
    LoRA); returns ``LoraResult(y, Dispatch)`` with a new y (T, d_out):

        h = x @ [W; A]^T                                   (one GEMM: base output and every slot's shrink)
        y[t] = x[t] @ W^T, and for a = token_lora_indices[t] >= 0, for each slice s (columns soff[s]:soff[s+1]):
        y[t, soff[s]:soff[s+1]] += scales[a] * (x[t] @ A[s, a, :ranks[a]]^T) @ B[a, soff[s]:soff[s+1], :ranks[a]]^T

    ``folded``: W and A (S, L, R, d_in) in one tensor (``fold_weight``); lora_b (L, d_out, R), finite past each
    slot's rank (the kernels may read those columns, for contiguous loads, and multiply them by zero; vLLM's buffers
    hold zeros there); ranks (L,) int; scales (L,) float. Each slot's factors are plain low rank (BD-LoRA's
    per-device adapter, rank r/N: no padding to another device's blocks). Every slot's shrink is computed for
    every token (S * L * R extra output columns of the GEMM: cheap when they are few next to d_out). Triton: the
    GEMM (cuBLAS via torch) and one launch after it,
    ``kernel`` "decode" (``_decode_folded_expand_kernel``, one program per token: decode steps) or "gemm"
    (``_fold_expand_gemm_kernel``, token tiles of ``tiles`` through tl.dot: any token count, tokens in any slot
    order); or ``kernel`` "gemv": ONE launch for everything (``_fold_gemv_kernel``, or ``_fold_gemv_local_kernel``
    with ``gemv_tiles.local_shrink``; tiles ``gemv_tiles``; at most
    ``GEMV_MAX_TOKENS`` tokens; scratch in ``workspace``, a ``GemvWorkspace`` reserved for the call, a temporary
    one when None). No host sync (CUDA-graph safe with int32 ``token_lora_indices`` and ``ranks``, float32
    ``scales``, on the device; the slice offsets are kernel arguments, ``soff`` is accepted and unused). At most
    ``MAX_FOLDED_SLICES`` slices. The shrink is rounded to x's dtype by the GEMM, as in PEFT's ``lora_B(lora_A(x))``.
    ``sort_tokens`` (kernel "gemm", several slots): the tiles run on the tokens grouped by slot
    (``slot_segments``, computed here; a layer served keeps one ``SlotSegments`` per slot map instead), each tile
    reading one slot's B.
    ``pdl``: launch the Triton kernel with programmatic dependent launch where the GPU has it (``dispatch.pdl_ok``:
    Hopper or later) and the slot ids, ranks and scales are passed ready (``_pdl_launch``), so that it starts, and
    reads what the kernel before it does not write (B, the slot ids), while that kernel drains; what it writes waits
    (``gdc_wait``). Elsewhere ignored. Only x may be written by the kernel just before the call.
    Torch fallback: ``decode_lora_folded_torch`` (any kernel); reference ``decode_lora_folded_ref``.
    """
    _check_folded(folded, lora_b, slice_offsets, kernel)
    if kernel != "gemv":
        segments = None
        if sort_tokens and kernel == "gemm":
            segments = slot_segments(token_lora_indices.to(x.device), lora_b.shape[0])
        plan = FoldedLaunch(folded, lora_b, token_lora_indices, ranks, scales, slice_offsets, kernel=kernel,
                            tiles=tiles, pdl=pdl, options=options, like=x, segments=segments)
        return LoraResult(plan(x), plan.dispatch)
    d_out = folded.d_out
    n_l, _, r = lora_b.shape
    n_s = len(slice_offsets) - 1
    t = x.shape[0]
    if t > GEMV_MAX_TOKENS:
        raise ValueError(f"decode_lora_folded: kernel='gemv' takes at most {GEMV_MAX_TOKENS} tokens, got {t}")
    why = _folded_why_not(folded.w_ext, lora_b, x)
    if why is None and not (x.stride(1) == 1 and folded.w_ext.is_contiguous()):
        why = "x without unit column stride or [W; A] not contiguous (kernel='gemv' reads them)"
    use, note = dispatch.resolve("decode_lora_folded", options, x.device.type, triton=why)
    if use == "torch":
        y = decode_lora_folded_torch(F.linear(x, folded.w_ext), d_out, lora_b, token_lora_indices, ranks, scales,
                                     slice_offsets)
        return LoraResult(y, Dispatch("decode_lora_folded", options.backend, use, note))

    offs = [int(o) for o in slice_offsets[1:]] + [d_out] * (MAX_FOLDED_SLICES - n_s)
    gdc = _pdl_launch(pdl, x.device, (token_lora_indices, ranks), (scales,))
    idx = token_lora_indices.to(device=x.device, dtype=torch.int32)
    ranks = ranks.to(device=x.device, dtype=torch.int32)
    scales = scales.to(device=x.device, dtype=torch.float32)
    block_r = max(16, next_pow2(r))
    y = x.new_empty(t, d_out)
    done = LoraResult(y, Dispatch("decode_lora_folded", options.backend, use, note))
    if t == 0:
        return done
    gt = gemv_tiles or GemvTiles()
    if not gt.fits_slices(slice_offsets):
        raise ValueError(f"decode_lora_folded: {gt} computes the shrink per tile, so every slice offset must be a "
                         f"multiple of block_n={gt.block_n}; got offsets {list(slice_offsets)}: use a block_n that "
                         f"divides them, or local_shrink=False")
    if workspace is None:
        workspace = GemvWorkspace(x.device, x.dtype).reserve(folded, t, gt)
    elif not (workspace.fits(folded, t, gt) and workspace.shrink.device == x.device and workspace.dtype == x.dtype):
        raise ValueError(f"decode_lora_folded: the gemv workspace ({workspace.dtype} on {workspace.device}) does "
                         f"not fit this call ({t} tokens, {x.dtype} on {x.device}, {gt}): reserve it for the "
                         f"largest call first")
    a_rows = folded.w_ext.shape[0] - d_out
    n_a, n_w = -(-a_rows // gt.block_n), -(-d_out // gt.block_n)
    d_in = x.shape[1]
    k_chunk = -(-d_in // (gt.split_k * gt.block_k)) * gt.block_k
    if gt.local_shrink:
        launch(_fold_gemv_local_kernel, (n_w * gt.split_k,),
            y, x, folded.w_ext, lora_b, idx, ranks, scales, workspace.partials, workspace.counters[2:], t,
            x.stride(0), y.stride(0), d_in, d_out, n_l, r, *offs[:3], k_chunk, SPLIT_K=gt.split_k,
            BLOCK_M=gt.block_m(t), BLOCK_N=gt.block_n,
            BLOCK_K=gt.block_k, BLOCK_J=gt.shrink_rows(t, n_l, r), BLOCK_R=gt.shrink_stride(t, n_l, r),
            PREC=dispatch.dot_precision(x.dtype), STAGES=gt.stages,
            USE_GDC=gdc, num_warps=gt.warps, num_stages=gt.stages, launch_pdl=gdc,
        )
        return done
    launch(_fold_gemv_kernel, ((n_a + n_w) * gt.split_k,),
        y, x, folded.w_ext, lora_b, idx, ranks, scales, workspace.shrink, workspace.partials,
        workspace.counters[2:], workspace.counters, t, x.stride(0), y.stride(0), d_in, d_out, a_rows, n_l, r,
        *offs, n_a, n_w, k_chunk, N_SLICES=n_s, SPLIT_K=gt.split_k, BLOCK_M=gt.block_m(t), BLOCK_N=gt.block_n,
        BLOCK_K=gt.block_k, BLOCK_R=block_r, ONE_SLOT=n_l == 1,
        PREC=dispatch.dot_precision(x.dtype), USE_GDC=gdc, BLOCK_J=all_slots_block(n_l, r, gt.block_n, gt.warps),
        num_warps=gt.warps, num_stages=gt.stages, launch_pdl=gdc,
    )
    return done
