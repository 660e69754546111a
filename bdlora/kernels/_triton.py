"""Triton kernels. Import only through the dispatchers (this module needs triton).

All kernels share one addressing scheme for a packed block-diagonal weight of adapter i: the weight is a
slice of a flat buffer at offset ``woff`` and stored (M, K/nb) row-major (PEFT orientation); kernel-output
column c belongs to block c // (M/nb) and reads input columns of the same block only. Rows are routed by
a host-built tile map: each tile is (adapter, row_start, row_end) inside one segment, so tiles never mix
adapters and tokens are never padded (the last tile of a segment is masked).

Column tiles may straddle block boundaries when blocks are narrower than a tile; the weight loads are then
masked to the diagonal, so memory traffic stays exact and wasted FLOPs only appear for blocks smaller than
a tile (which are too small for tensor cores anyway).
"""
from __future__ import annotations

import triton
import triton.language as tl


# Dropout keys and threshold change with every seed: never specialize a compiled kernel on their values (Triton
# otherwise compiles a variant per "divisible by 16" / "equals 1" pattern of each int argument, i.e. a new compile
# whenever a fresh seed's key happens to be a multiple of 16).
_RANDOM_INTS = ["key0", "key1", "thr"]  # argument names of the dropout-fused kernels below


@triton.jit
def _lowbias32(h):
    """A 32-bit integer hash (xorshift-multiply, two rounds; constants of C. Wellons' lowbias32) on uint32."""
    h ^= h >> 16
    h *= 0x7FEB352D
    h ^= h >> 15
    h *= 0x846CA68B
    h ^= h >> 16
    return h


@triton.jit
def _pair_hash(key0, key1, pc):
    """The 32 random bits of pair counter pc (int32): two 16-bit draws, columns 2j (low half) and 2j + 1."""
    return _lowbias32((pc.to(tl.uint32) * 0x9E3779B1 + key1.to(tl.uint32)) ^ key0.to(tl.uint32))


@triton.jit
def _keep(key0, key1, rows, cols, half_w, thr):
    """Dropout keep-mask of elements (rows, cols) (broadcast int32 tensors) of a mask whose rows hold half_w
    column pairs, kept iff their 16-bit draw >= thr (``dropout.py``; one hash per element, any alignment)."""
    h = _pair_hash(key0, key1, rows * half_w + cols // 2)
    return ((h >> ((cols & 1) * 16).to(tl.uint32)) & 0xFFFF) >= thr.to(tl.uint32)


@triton.jit
def _keep_tile(key0, key1, ts, k0, half_w, thr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """The same mask on rows ts (BLOCK_T) x columns k0 .. k0 + BLOCK_K (k0 even): one hash per column pair, its
    two halves interleaved back into columns (half the hashing of ``_keep``)."""
    h = _pair_hash(key0, key1, ts[:, None] * half_w + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :])
    u = tl.reshape(tl.join(h & 0xFFFF, h >> 16), (BLOCK_T, BLOCK_K))
    return u >= thr.to(tl.uint32)


@triton.jit
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


@triton.jit(do_not_specialize=["key0", "key1"])  # its threshold comes from p in fmeta
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
                acc += tl.dot(a, w, input_precision=PREC)
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
            lacc += tl.dot(a, w, input_precision=PREC)
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


@triton.jit
def _dsdb_chunks(db_ptr, dy_ptr, b_ptr, s_tile, rows, rmask, rr, rrmask, stride_dy, o_lo, width, rb, boff,
                 first, step, rot, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                 PREC: tl.constexpr):
    """The shared body of the dS/dB kernels: over the BLOCK_N column chunks c = first, first + step, ... of output
    columns [o_lo, o_lo + width) (visited rotated by ``rot``, so concurrent programs add into different dB rows):

        returns sum_c dY[rows, c] @ B[c, rr]               (fp32 (BLOCK_T, BLOCK_R), the caller stores it)
        dB[c, rr] += dY[rows, c]^T @ s_tile                 (fp32 atomics; s_tile = S[rows, rr])

    with B stored (d_out, rb) row-major at b_ptr + boff (dB alike at db_ptr + boff)."""
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
        acc += tl.dot(dy, b, input_precision=PREC)
        db = tl.dot(tl.trans(dy), s_tile, input_precision=PREC)
        tl.atomic_add(db_ptr + bidx, db, mask=bmask, sem="relaxed")
    return acc


@triton.jit
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
                           boff, tl.program_id(1), col_split, tile, BLOCK_T, BLOCK_N, BLOCK_R, PREC)
        tl.atomic_add(ds_ptr + rows[:, None] * stride_ds + (j * rb + rr)[None, :], acc, mask=smask, sem="relaxed")


# rows and splits change with every micro-batch: a variant per divisibility pattern would compile mid-run
@triton.jit(do_not_specialize=["rows_total", "col_split"])
def _dsdb_dense_kernel(ds_ptr, db_ptr, dy_ptr, s_ptr, b_ptr, rows_total, d_out, r, stride_dy, col_split,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr):
    """One adapter, dense B (d_out, r), every row (the cuBLAS layer's segment): dY read once for both products,

    dS[t, :] += dY[t, :] @ B          dB += dY^T @ S            (fp32 atomics into zeroed ds (rows, r), db (d_out, r))

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
                       tl.program_id(1), col_split, tile, BLOCK_T, BLOCK_N, BLOCK_R, PREC)
    tl.atomic_add(ds_ptr + rows[:, None] * r + rr[None, :], acc, mask=smask, sem="relaxed")


@triton.jit
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
                acc += tl.dot(tl.trans(gj), xv, input_precision=PREC)
        tl.atomic_add(g_ptr + woff + ms[:, None] * bs_in + kls[None, :], acc * alpha,
                      mask=mmask[:, None] & kmask[None, :])


@triton.jit
def _decode_shrink_kernel(
    x_ptr, a_ptr, idx_ptr, ranks_ptr, part_ptr,
    stride_x, d_in, n_loras, R, KA, n_groups, k_splits,
    NA: tl.constexpr, NB: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """First half of ``decode_lora``: for token t, group g = slice * NB + j and input split k (one program each),

    a = idx[t] (nothing if a < 0 or ranks[a] == 0); ks = k * BLOCK_K + [0, BLOCK_K)
    part[t, g, k, :ranks[a] / NB] = x[t, ks] @ A[slice, a][j * ranks[a] / NB + :ranks[a] / NB, ks]^T   (fp32)

    Row layout (NA > 1): rank block rb of A only reads input block rb (the other products are masked to 0).
    One load of x and one of A per program, no loop: at batch 1 the latency is one memory round trip, and the
    d_in / BLOCK_K programs of a slice spread the read of A over the SMs.
    """
    t = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    a = tl.load(idx_ptr + t)
    r = tl.load(ranks_ptr + tl.maximum(a, 0))
    if (a >= 0) & (r > 0):  # -1 = no LoRA; an empty slot (rank 0) adds nothing either
        sl = g // NB
        j = g % NB
        r_cnt = r // NB
        rr = tl.arange(0, BLOCK_R)
        rs = j * r_cnt + rr
        rmask = rr < r_cnt
        bs_in = d_in // NA
        r_blk = rs // (r // NA)
        ks = split * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = ks < d_in
        k_blk = ks // bs_in
        xv = tl.load(x_ptr + t * stride_x + ks, mask=kmask, other=0.0).to(tl.float32)
        a_base = a_ptr + ((sl * n_loras + a) * R).to(tl.int64) * KA
        amask = rmask[:, None] & kmask[None, :] & (r_blk[:, None] == k_blk[None, :])
        av = tl.load(a_base + rs[:, None] * KA + (ks - k_blk * bs_in)[None, :], mask=amask, other=0.0)
        s = tl.sum(av.to(tl.float32) * xv[None, :], axis=1)
        tl.store(part_ptr + ((t * n_groups + g) * k_splits + split) * BLOCK_R + rr, s)


@triton.jit
def _decode_expand_kernel(
    y_ptr, b_ptr, idx_ptr, ranks_ptr, scales_ptr, soff_ptr, part_ptr,
    stride_y, d_total, RB, n_groups,
    NB: tl.constexpr, K_SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Second half of ``decode_lora``: for token t, group g = slice * NB + j and column tile c (one program each),

    a = idx[t] (nothing if a < 0 or ranks[a] == 0); w = (soff[slice + 1] - soff[slice]) / NB
    cols = soff[slice] + j * w + c * BLOCK_N + [0, BLOCK_N)  (within output block j)
    y[t, cols] += scales[a] * (sum over k of part[t, g, k]) @ B[a, cols, :ranks[a] / NB]^T

    The partial shrinks are summed in split order (deterministic; y is rounded once). Every tile sums them again
    (K_SPLITS x BLOCK_R floats from L2): cheaper than a third launch.
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
            rmask = rr < r // NB
            base = (t * n_groups + g) * K_SPLITS
            s = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for i0 in tl.static_range(0, K_SPLITS, BLOCK_S):
                ii = i0 + tl.arange(0, BLOCK_S)
                p = tl.load(part_ptr + (base + ii)[:, None] * BLOCK_R + rr[None, :], mask=(ii < K_SPLITS)[:, None],
                            other=0.0)
                s += tl.sum(p, axis=0)
            s = s * tl.load(scales_ptr + a)
            cs = c_lo + tl.arange(0, BLOCK_N)
            cmask = cs < c_end
            b_base = b_ptr + (a.to(tl.int64) * d_total) * RB
            bv = tl.load(b_base + (o_lo + cs)[:, None] * RB + rr[None, :], mask=cmask[:, None] & rmask[None, :],
                         other=0.0)
            upd = tl.sum(bv.to(tl.float32) * s[None, :], axis=1)
            yp = y_ptr + t * stride_y + o_lo + cs
            yv = tl.load(yp, mask=cmask, other=0.0).to(tl.float32)
            tl.store(yp, (yv + upd).to(y_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _decode_folded_expand_kernel(
    y_ptr, h_ptr, b_ptr, idx_ptr, ranks_ptr, scales_ptr, soff_ptr,
    stride_y, stride_h, d_out, n_loras, R,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``decode_lora_folded``'s one launch after the base GEMM: for token t, slice s and column tile c (one program
    each), with h = x @ [W; A]^T (the shrink of every slice and slot is in h's columns past d_out):

    cols = soff[s] + c * BLOCK_N + [0, BLOCK_N)  (within the slice); a = idx[t]
    y[t, cols] = h[t, cols] + scales[a] * h[t, d_out + (s * L + a) * R + :ranks[a]] @ B[a, cols, :ranks[a]]^T

    (the second term only for a >= 0 and ranks[a] > 0: every column of y is written, LoRA or not).
    """
    t = tl.program_id(0)
    sl = tl.program_id(1)
    tile = tl.program_id(2)
    o_lo = tl.load(soff_ptr + sl)
    o_hi = tl.load(soff_ptr + sl + 1)
    c_lo = o_lo + tile * BLOCK_N
    if c_lo < o_hi:  # a narrower slice's surplus tiles have no columns
        cs = c_lo + tl.arange(0, BLOCK_N)
        cmask = cs < o_hi
        acc = tl.load(h_ptr + t * stride_h + cs, mask=cmask, other=0.0).to(tl.float32)
        a = tl.load(idx_ptr + t)
        r = tl.load(ranks_ptr + tl.maximum(a, 0))
        if (a >= 0) & (r > 0):
            rr = tl.arange(0, BLOCK_R)
            rmask = rr < r
            s = tl.load(h_ptr + t * stride_h + d_out + (sl * n_loras + a) * R + rr, mask=rmask, other=0.0)
            s = s.to(tl.float32) * tl.load(scales_ptr + a)
            bv = tl.load(b_ptr + (a.to(tl.int64) * d_out + cs[:, None]) * R + rr[None, :],
                         mask=cmask[:, None] & rmask[None, :], other=0.0)
            acc += tl.sum(bv.to(tl.float32) * s[None, :], axis=1)
        tl.store(y_ptr + t * stride_y + cs, acc.to(y_ptr.dtype.element_ty), mask=cmask)


@triton.jit(do_not_specialize=_RANDOM_INTS)
def _dropout_mask_kernel(out_ptr, key0, key1, n_cols, stride_out, thr, BLOCK: tl.constexpr):
    """out[row, c] = keep(row, c) as int8: materialize a mask (``dropout.keep_mask_triton``)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = _keep(key0, key1, row, cols, (n_cols + 1) // 2, thr)
    tl.store(out_ptr + row * stride_out + cols, keep.to(tl.int8), mask=cols < n_cols)


# ---- dropout fused into the cuBLAS path's LoRA-A products (dropout.py); BLOCK_K even, tiles start at even k ----

@triton.jit(do_not_specialize=_RANDOM_INTS)
def _drop_shrink_kernel(x_ptr, a_ptr, s_ptr, rows, d_in, r, stride_x, key0, key1, thr, alpha,
                        R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """s[t, j] = alpha * sum_k keep(t, k) * x[t, k] * a[j, k]   for t < rows, j < r; a (r, d_in), s (rows, r)
    contiguous. Grid: (cdiv(rows, BLOCK_T),)."""
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = ts < rows
    js = tl.arange(0, R)
    jmask = js < r
    acc = tl.zeros((BLOCK_T, R), dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < d_in
        xt = tl.load(x_ptr + ts[:, None] * stride_x + ks[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        keep = _keep_tile(key0, key1, ts, k0, (d_in + 1) // 2, thr, BLOCK_T, BLOCK_K)
        xt = tl.where(keep, xt, tl.zeros_like(xt))
        at = tl.load(a_ptr + js[None, :] * d_in + ks[:, None], mask=kmask[:, None] & jmask[None, :], other=0.0)
        acc += tl.dot(xt, at, input_precision=PREC)
    tl.store(s_ptr + ts[:, None] * r + js[None, :], (acc * alpha).to(s_ptr.dtype.element_ty),
             mask=tmask[:, None] & jmask[None, :])


@triton.jit(do_not_specialize=_RANDOM_INTS)
def _drop_expand_t_kernel(ds_ptr, a_ptr, dx_ptr, rows, d_in, r, stride_dx, key0, key1, thr, alpha,
                          R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """dx[t, k] = alpha * keep(t, k) * sum_j ds[t, j] * a[j, k]   (written); ds (rows, r), a (r, d_in) contiguous
    (ds rounded to a's dtype first).
    Grid: (cdiv(rows, BLOCK_T), cdiv(d_in, BLOCK_K))."""
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tmask = ts < rows
    kmask = ks < d_in
    js = tl.arange(0, R)
    jmask = js < r
    dst = tl.load(ds_ptr + ts[:, None] * r + js[None, :], mask=tmask[:, None] & jmask[None, :], other=0.0)
    dst = dst.to(a_ptr.dtype.element_ty)  # ds may come in fp32 (the fused dS/dB kernel's output)
    at = tl.load(a_ptr + js[:, None] * d_in + ks[None, :], mask=jmask[:, None] & kmask[None, :], other=0.0)
    acc = tl.dot(dst, at, input_precision=PREC) * alpha
    keep = _keep_tile(key0, key1, ts, tl.program_id(1) * BLOCK_K, (d_in + 1) // 2, thr, BLOCK_T, BLOCK_K)
    acc = tl.where(keep, acc, 0.0)
    tl.store(dx_ptr + ts[:, None] * stride_dx + ks[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=tmask[:, None] & kmask[None, :])


@triton.jit(do_not_specialize=_RANDOM_INTS)
def _drop_wgrad_a_kernel(x_ptr, ds_ptr, part_ptr, rows, d_in, r, stride_x, key0, key1, thr, rows_per_split,
                         R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """part[sp, j, k] = sum_{t in split sp} ds[t, j] * keep(t, k) * x[t, k]   (fp32; split sp = rows
    [sp * rows_per_split, (sp + 1) * rows_per_split)); ds (rows, r; rounded to x's dtype first), part
    (splits, r, d_in) contiguous.
    Grid: (cdiv(d_in, BLOCK_K), splits)."""
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = ks < d_in
    sp = tl.program_id(1)
    js = tl.arange(0, R)
    jmask = js < r
    t_lo = sp * rows_per_split
    t_hi = tl.minimum(rows, t_lo + rows_per_split)
    acc = tl.zeros((R, BLOCK_K), dtype=tl.float32)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        tmask = ts < t_hi
        xt = tl.load(x_ptr + ts[:, None] * stride_x + ks[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        keep = _keep_tile(key0, key1, ts, tl.program_id(0) * BLOCK_K, (d_in + 1) // 2, thr, BLOCK_T, BLOCK_K)
        xt = tl.where(keep, xt, tl.zeros_like(xt))
        dst = tl.load(ds_ptr + ts[None, :] * r + js[:, None], mask=jmask[:, None] & tmask[None, :], other=0.0)
        acc += tl.dot(dst.to(xt.dtype), xt, input_precision=PREC)
    tl.store(part_ptr + sp * r * d_in + js[:, None] * d_in + ks[None, :], acc, mask=jmask[:, None] & kmask[None, :])
