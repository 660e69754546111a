"""LoRA dropout: one counter-based mask that every backend draws, and the cuBLAS path's kernels that apply it
inside the LoRA products instead of materializing it.

The mask. Dropout p on a (rows, cols) input under the keys (k0, k1) = ``dropout_keys(seed, index)``: each row is
cut into W = ceil(cols / 2) column pairs; pair j of row t has the counter m = t * W + j and 32 random bits

    h(m) = lowbias32(((m * 0x9E3779B1 + k1) mod 2^32) xor k0)      (a xorshift-multiply hash, two rounds)

whose low 16 bits are the draw of column 2j and high 16 bits that of column 2j + 1. Element (t, c) is kept iff its
draw u >= thr = ceil(fp32(p) * 2^16), i.e. iff u / 2^16 >= p in fp32: P(keep) = 1 - thr / 2^16 (p to within
2^-16). A pure function of (seed, index, t, c): Triton kernels recompute it wherever they need it
(``_keep`` per element, ``_keep_tile`` one hash per pair), torch computes the same bits
(``keep_mask_torch``; tests check bit equality), and no mask is stored for backward. Hashing is the cost of these
kernels (the element itself is one 2-byte read): one 16-bit draw per element and ~5 integer ops each keep it near
the memory time; Philox (``tl.rand``: 10 rounds for 4 words, one used per element) and torch's ``bernoulli_``
(55 us + a 33 us copy + a 21 us ``logical_not`` for an 8192 x 4096 mask on an H200,
measured) cost several times that. Pair counters must stay below 2^31.

Who draws which mask: the cuBLAS path and the torch references use ``segment_keep_mask(seed, i, ...)`` for adapter
i over its own segment's rows (local row t); the grouped Triton kernels use index 0 over the rows of the whole call
(``dropout_keep_mask``).

The kernels (cuBLAS path, CUDA; on CPU only under TRITON_INTERPRET=1 when tests switch them on). With keep the mask
above of the segment (rows x d_in), alpha = scale / (1 - p), a (r, d_in) the dense LoRA-A factor in the compute
dtype, s/ds (rows, r):

    drop_shrink      s  = alpha * (keep * x) @ a^T                     replaces mask draw + masked_fill + GEMM
    drop_expand_t    dx = alpha * keep * (ds @ a)        (written)     replaces GEMM + masked_fill_ of the LoRA dX
    drop_wgrad_a     da = alpha * ds^T @ (keep * x)      (fp32, (r, d_in))   replaces the GEMM on a saved x * keep
"""
from __future__ import annotations

import math
import struct
from types import MappingProxyType

import torch

from . import dispatch
from ._jit import dot, jit, tl
from .dispatch import cdiv, dot_precision, next_pow2
from .launch import launch

M64 = 0xFFFFFFFFFFFFFFFF
GOLDEN32 = 0x9E3779B1
LOWBIAS_MULS = (0x7FEB352D, 0x846CA68B)
MAX_RANK = 128  # the fused kernels keep an (rows, r) tile in registers; wider ranks materialize the mask


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def keep_threshold(p: float) -> int:
    """The 16-bit draw from which an element is kept: ceil(fp32(p) * 2^16) (exact: a power-of-two scaling)."""
    return math.ceil(struct.unpack("f", struct.pack("f", p))[0] * 65536)


def dropout_keys(seed: int, index: int) -> tuple[int, int]:
    """The two 31-bit hash keys of adapter ``index``'s mask under ``seed`` (host ints; 31 bits so they pass to
    Triton as int32)."""
    z = _splitmix64((int(seed) & M64) ^ _splitmix64(int(index)))
    return z & 0x7FFFFFFF, (z >> 32) & 0x7FFFFFFF


def check_counters(rows: int, cols: int) -> None:
    """Refuse masks whose pair counters would overflow the kernels' int32 arithmetic."""
    if rows * ((cols + 1) // 2) >= 2**31:
        raise ValueError(f"dropout mask of {rows} x {cols} elements: its pair counters must stay below 2^31; "
                         "split the call into fewer rows")


def _i32(c: int) -> int:
    """The int32 with the bits of uint32 c (torch multiplies int32 tensors modulo 2^32: the same low bits)."""
    return c - (1 << 32) if c >= 1 << 31 else c


# ---- the mask's hash in Triton (the twin of keep_mask_torch below, bit for bit) ----------------------------

# Dropout keys and threshold change with every seed: never specialize a compiled kernel on their values (Triton
# otherwise compiles a variant per "divisible by 16" / "equals 1" pattern of each int argument, i.e. a new compile
# whenever a fresh seed's key happens to be a multiple of 16).
_RANDOM_INTS = ("key0", "key1", "thr")  # argument names of the dropout-fused kernels below


@jit
def _tl_lowbias32(h):
    """A 32-bit integer hash (xorshift-multiply, two rounds; constants of C. Wellons' lowbias32) on uint32."""
    h ^= h >> 16
    h *= 0x7FEB352D
    h ^= h >> 15
    h *= 0x846CA68B
    h ^= h >> 16
    return h


@jit
def _pair_hash(key0, key1, pc):
    """The 32 random bits of pair counter pc (int32): two 16-bit draws, columns 2j (low half) and 2j + 1."""
    return _tl_lowbias32((pc.to(tl.uint32) * 0x9E3779B1 + key1.to(tl.uint32)) ^ key0.to(tl.uint32))


@jit
def _keep(key0, key1, rows, cols, half_w, thr):
    """Dropout keep-mask of elements (rows, cols) (broadcast int32 tensors) of a mask whose rows hold half_w
    column pairs, kept iff their 16-bit draw >= thr (``dropout.py``; one hash per element, any alignment)."""
    h = _pair_hash(key0, key1, rows * half_w + cols // 2)
    return ((h >> ((cols & 1) * 16).to(tl.uint32)) & 0xFFFF) >= thr.to(tl.uint32)


@jit
def _keep_tile(key0, key1, ts, k0, half_w, thr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """The same mask on rows ts (BLOCK_T) x columns k0 .. k0 + BLOCK_K (k0 even): one hash per column pair, its
    two halves interleaved back into columns (half the hashing of ``_keep``)."""
    h = _pair_hash(key0, key1, ts[:, None] * half_w + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :])
    u = tl.reshape(tl.join(h & 0xFFFF, h >> 16), (BLOCK_T, BLOCK_K))
    return u >= thr.to(tl.uint32)


@jit(do_not_specialize=_RANDOM_INTS)
def _dropout_mask_kernel(out_ptr, key0, key1, n_cols, stride_out, thr, BLOCK: tl.constexpr):
    """out[row, c] = keep(row, c) as int8: materialize a mask (``dropout.keep_mask_triton``)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = _keep(key0, key1, row, cols, (n_cols + 1) // 2, thr)
    tl.store(out_ptr + row * stride_out + cols, keep.to(tl.int8), mask=cols < n_cols)


def _shr(h: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int32 bits (torch's >> on int32 is arithmetic: mask off the copied sign bits)."""
    return (h >> s) & ((1 << (32 - s)) - 1)


def _lowbias32(h: torch.Tensor) -> torch.Tensor:
    h ^= _shr(h, 16)
    h *= _i32(LOWBIAS_MULS[0])
    h ^= _shr(h, 15)
    h *= _i32(LOWBIAS_MULS[1])
    h ^= _shr(h, 16)
    return h


def keep_mask_torch(keys: tuple[int, int], rows: int, cols: int, p: float, device="cpu") -> torch.Tensor:
    """The (rows, cols) bool keep-mask of the module docstring, in torch: the twin of ``_keep`` /
    ``_keep_tile``, bit for bit (tests compare them). int32 arithmetic in place, products wrapping modulo 2^32 as
    uint32 ones do (a third of the memory traffic of an int64 emulation; on a CPU about the time of torch's
    bernoulli_, BENCHMARKS.md)."""
    check_counters(rows, cols)
    half_w = (cols + 1) // 2
    h = torch.arange(rows * half_w, dtype=torch.int32, device=device)
    h *= _i32(GOLDEN32)
    h += keys[1]
    h ^= keys[0]
    h = _lowbias32(h)
    draws = torch.stack([h & 0xFFFF, _shr(h, 16)], dim=-1).view(rows, 2 * half_w)[:, :cols]
    return draws >= keep_threshold(p)


def keep_mask_triton(keys: tuple[int, int], rows: int, cols: int, p: float, device) -> torch.Tensor:
    """The same mask from the Triton hash (one kernel; the materializer of the GPU fallbacks)."""

    check_counters(rows, cols)
    out = torch.empty((rows, cols), dtype=torch.int8, device=device)
    block = 1024 if out.is_cuda else 128
    if rows and cols:
        launch(_dropout_mask_kernel, (rows, cdiv(cols, block)), out, *keys, cols, out.stride(0), keep_threshold(p),
               BLOCK=block)
    return out.bool()


def segment_keep_mask(seed: int, index: int, rows: int, d_in: int, p: float, device) -> torch.Tensor:
    """Adapter ``index``'s (rows, d_in) bool keep-mask over its segment (module docstring); drawn by the Triton
    hash on CUDA, by its torch twin elsewhere (the same bits)."""
    keys = dropout_keys(seed, index)
    dev = torch.device(device)
    if dev.type == "cuda" and dispatch.HAS_TRITON:
        return keep_mask_triton(keys, rows, d_in, p, dev)
    return keep_mask_torch(keys, rows, d_in, p, dev)


def dropout_keep_mask(seed: int, shape: tuple[int, int], p: float, device="cpu") -> torch.Tensor:
    """The (T, d_in) keep-mask the grouped Triton kernels draw for dropout p from ``seed`` over a whole call's
    rows: ``segment_keep_mask`` with index 0."""
    return segment_keep_mask(seed, 0, shape[0], shape[1], p, device)


# ---- the cuBLAS path's fused dropout kernels ---------------------------------------------------------------------

@jit(do_not_specialize=_RANDOM_INTS)
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
        acc += dot(xt, at, PREC)
    tl.store(s_ptr + ts[:, None] * r + js[None, :], (acc * alpha).to(s_ptr.dtype.element_ty),
             mask=tmask[:, None] & jmask[None, :])


@jit(do_not_specialize=_RANDOM_INTS)
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
    acc = dot(dst, at, PREC) * alpha
    keep = _keep_tile(key0, key1, ts, tl.program_id(1) * BLOCK_K, (d_in + 1) // 2, thr, BLOCK_T, BLOCK_K)
    acc = tl.where(keep, acc, 0.0)
    tl.store(dx_ptr + ts[:, None] * stride_dx + ks[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=tmask[:, None] & kmask[None, :])


@jit(do_not_specialize=_RANDOM_INTS)
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
        acc += dot(dst.to(xt.dtype), xt, PREC)
    tl.store(part_ptr + sp * r * d_in + js[:, None] * d_in + ks[None, :], acc, mask=jmask[:, None] & kmask[None, :])


def fused_ok(x: torch.Tensor, a: torch.Tensor, enabled: bool | None) -> bool:
    """Whether the kernels below can run: Triton usable on x's device, a dense (r, d_in) with r <= MAX_RANK.
    ``enabled`` None takes them on CUDA only; True also under the CPU interpreter; False never."""
    return a.shape[0] <= MAX_RANK and a.shape[1] == x.shape[1] and dispatch.gpu_kernel_on(enabled, x, a)


# Tiles per kernel on GPUs: the best of a sweep at 8192 rows x 4096 / 14336 columns, r 16 / 64, bf16, on an H200
# (``target`` = programs wanted for drop_wgrad_a's row splits). At 8192 x 4096, r 16: shrink 34 us, LoRA dX 27 us, dA 40 us
# (one GEMM on a saved x * keep: 30 us; the bernoulli draw alone: 58 us).
GPU_TILES = MappingProxyType({  # read-only data
    "shrink": MappingProxyType(dict(BT=32, BK=128, num_warps=4, num_stages=4)),
    "expand_t": MappingProxyType(dict(BT=64, BK=128, num_warps=4, num_stages=1)),
    "wgrad_a": MappingProxyType(dict(BT=64, BK=64, num_warps=4, num_stages=3, target=528))})


def _tiles(x: torch.Tensor, rank: int, kernel: str) -> dict:
    """Tile sizes of ``kernel``: GPU_TILES on GPUs; small ones under the interpreter. R = rank padded for tl.dot."""
    rp = max(16, next_pow2(rank))
    if not x.is_cuda:
        return dict(R=rp, BT=16, BK=32, num_warps=4, num_stages=1, target=2)
    return dict(R=rp, **GPU_TILES[kernel])


def drop_shrink(s: torch.Tensor, x: torch.Tensor, a: torch.Tensor, keys, p: float, alpha: float) -> None:
    """s (rows, r) = alpha * (keep * x) @ a^T, keep = the (rows, d_in) mask under ``keys``; x (rows, d_in) with unit
    column stride, a (r, d_in) contiguous, s contiguous (written in its dtype)."""

    rows, d_in = x.shape
    check_counters(rows, d_in)
    if rows == 0:
        return
    cfg = _tiles(x, a.shape[0], "shrink")
    launch(_drop_shrink_kernel, (cdiv(rows, cfg["BT"]),),
           x, a, s, rows, d_in, a.shape[0], x.stride(0), keys[0], keys[1], keep_threshold(p), float(alpha),
        R=cfg["R"], BLOCK_T=cfg["BT"], BLOCK_K=cfg["BK"], PREC=dot_precision(x.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def drop_expand_t(dx: torch.Tensor, ds: torch.Tensor, a: torch.Tensor, keys, p: float, alpha: float) -> None:
    """dx (rows, d_in) = alpha * keep * (ds @ a), written (not accumulated); ds (rows, r) and a (r, d_in) contiguous,
    dx with unit column stride; ds may be fp32 (rounded to a's dtype in the kernel)."""

    rows, d_in = dx.shape
    check_counters(rows, d_in)
    if rows == 0:
        return
    cfg = _tiles(dx, a.shape[0], "expand_t")
    bk = cfg["BK"]
    launch(_drop_expand_t_kernel, (cdiv(rows, cfg["BT"]), cdiv(d_in, bk)),
           ds, a, dx, rows, d_in, a.shape[0], dx.stride(0), keys[0], keys[1], keep_threshold(p), float(alpha),
        R=cfg["R"], BLOCK_T=cfg["BT"], BLOCK_K=bk, PREC=dot_precision(dx.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def drop_wgrad_a(x: torch.Tensor, ds: torch.Tensor, keys, p: float, alpha: float) -> torch.Tensor:
    """alpha * ds^T @ (keep * x) as an fp32 (r, d_in) tensor; x (rows, d_in) with unit column stride, ds (rows, r)
    contiguous (fp32 or x's dtype; rounded to x's in the kernel). Rows are split across programs (fp32 partials,
    summed here) so the grid fills the GPU."""

    rows, d_in = x.shape
    r = ds.shape[1]
    check_counters(rows, d_in)
    if rows == 0:
        return torch.zeros((r, d_in), dtype=torch.float32, device=x.device)
    cfg = _tiles(x, r, "wgrad_a")
    bk = cfg["BK"]
    n_k = cdiv(d_in, bk)
    splits = max(1, min(cdiv(rows, 4 * cfg["BT"]), cfg["target"] // n_k))
    per_split = cdiv(cdiv(rows, splits), cfg["BT"]) * cfg["BT"]
    splits = cdiv(rows, per_split)
    part = torch.empty((splits, r, d_in), dtype=torch.float32, device=x.device)  # every element written
    launch(_drop_wgrad_a_kernel, (n_k, splits),
           x, ds, part, rows, d_in, r, x.stride(0), keys[0], keys[1], keep_threshold(p), per_split,
        R=cfg["R"], BLOCK_T=cfg["BT"], BLOCK_K=bk, PREC=dot_precision(x.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return part.sum(0).mul_(alpha) if splits > 1 else part[0].mul_(alpha)


def drop_shrink_ref(x, a, keep, alpha):
    """Torch reference of ``drop_shrink`` (float64 in tests)."""
    return alpha * (x * keep) @ a.t()


def drop_expand_t_ref(ds, a, keep, alpha):
    """Torch reference of ``drop_expand_t``."""
    return alpha * keep * (ds @ a)


def drop_wgrad_a_ref(x, ds, keep, alpha):
    """Torch reference of ``drop_wgrad_a``."""
    return alpha * ds.t() @ (x * keep)

