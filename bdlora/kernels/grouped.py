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

from typing import Sequence

import torch
import torch.nn.functional as F

from . import dispatch
from .dispatch import cdiv, dot_precision, next_pow2
from .dropout import check_counters, dropout_keys
from .cublas import cublas_lora_linear
from .layout import LoraAdapter
from .reference import fused_lora_linear_ref, grouped_lora_ref, torch_keep_masks


# Tests set this to fill every kernel output buffer with NaN first, so elements a kernel forgets fail.
POISON_OUTPUTS = False


def _new(x: torch.Tensor, *shape: int) -> torch.Tensor:
    out = x.new_empty(shape)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def _config(x: torch.Tensor, fuse_base: bool) -> dict:
    """Tile sizes: big tiles on GPU (bigger still when the tile also runs the base GEMM); small ones under
    the (slow, per-program) interpreter."""
    if not x.is_cuda:
        return dict(BT=16, BM=32, BK=32, BN=32, warps=4, stages=1)
    if fuse_base:
        return dict(BT=128, BM=128, BK=64, BN=64, warps=8, stages=3)
    return dict(BT=64, BM=128, BK=64, BN=64, warps=4, stages=3)


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

    def __init__(self, x: torch.Tensor, seg: list[int], adapters: Sequence[LoraAdapter], seed: int | None,
                 fuse_base: bool):
        self.cfg = cfg = _config(x, fuse_base)
        self.seg, self.n, self.seed, self.fuse_base = seg, len(adapters), seed, fuse_base
        self.d_in, self.d_out = adapters[0].d_in, adapters[0].d_out
        self.t = x.shape[0]
        ranks = [ad.rank for ad in adapters]
        self.r_max = max(ranks)
        self.a_shapes = [ad.lora_a.shape for ad in adapters]
        self.b_shapes = [ad.lora_b.shape for ad in adapters]
        a_off, b_off, ao, bo = [], [], 0, 0
        for ad in adapters:
            a_off.append(ao)
            b_off.append(bo)
            ao += ad.lora_a.numel()
            bo += ad.lora_b.numel()
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
        # two fp32 (rows x BLOCK_R) accumulators of BLOCK_R = 128 spilled registers on the H200 (2026-11-22 profile:
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
        t[: self.seg[0]].zero_()
        t[self.seg[-1]:].zero_()

    # ---- launches -------------------------------------------------------------------------------
    def sgmm(self, stage, out, inp, w, fstage, *, accumulate, trans=False, mask=None, drop_in=False,
             drop_out=False, base_in=None, base_w=None, base_trans=False, bias=None):
        from ._triton import _sgmm_kernel

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
        from ._triton import _dsdb_kernel

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
        from ._triton import _wgrad_kernel

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


class _LoraLinearFn(torch.autograd.Function):
    """y = [x W^T + b | out | 0] + grouped LoRA(x); see the module docstring for the five stages."""

    @staticmethod
    def forward(ctx, plan: _Plan, x, out, weight, bias, *factors):
        a_flat = torch.cat([f.reshape(-1) for f in factors[0::2]])
        b_flat = torch.cat([f.reshape(-1) for f in factors[1::2]])
        s = _new(x, plan.t, plan.r_max)  # rows outside segments are never read
        # int8 keep-mask written by the shrink, read by the dA and dX stages (cheaper than redrawing it)
        mask = torch.empty(x.shape, dtype=torch.int8, device=x.device) if plan.has_dropout else None
        plan.sgmm(plan.SHRINK, s, x, a_flat, 0, accumulate=False, mask=mask, drop_in=plan.has_dropout)
        if weight is not None and plan.fuse_base:  # base GEMM and LoRA expand in one tile
            y = _new(x, plan.t, plan.d_out)
            plan.sgmm(plan.EXPAND, y, s, b_flat, 1, accumulate=False, base_in=x, base_w=weight, bias=bias)
        else:
            if weight is not None:
                y = F.linear(x, weight, bias)
            elif out is not None:
                y = out
                ctx.mark_dirty(out)
            else:
                y = _new(x, plan.t, plan.d_out)
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
                dx = _new(x, *x.shape)
                plan.sgmm(plan.DX, dx, ds, a_flat, 0, accumulate=False, base_in=dy, base_w=weight,
                          base_trans=True, **lora_dx)
            elif weight is not None:
                dx = dy @ weight
                plan.sgmm(plan.DX, dx, ds, a_flat, 0, accumulate=True, **lora_dx)
            else:
                dx = _new(x, *x.shape)
                plan.zero_gaps(dx)
                plan.sgmm(plan.DX, dx, ds, a_flat, 0, accumulate=False, **lora_dx)
        dw = dy.t() @ x if weight is not None and ctx.needs_input_grad[3] else None
        dbias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[4] else None
        dout = dy if ctx.has_out else None
        das = plan.split(da32, plan.a_shapes, x.dtype)
        dbs = plan.split(db32, plan.b_shapes, x.dtype)
        grads = [g for pair in zip(das, dbs) for g in pair]
        return (None, dx, dout, dw, dbias, *grads)


def _check(x: torch.Tensor, adapters: Sequence[LoraAdapter]) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be (T, d_in), got {tuple(x.shape)}")
    if not adapters:
        raise ValueError("need at least one adapter")
    for ad in adapters:
        if ad.d_in != x.shape[1] or ad.d_out != adapters[0].d_out:
            raise ValueError(f"adapter shapes d_in={ad.d_in}, d_out={ad.d_out} do not match x {tuple(x.shape)}")


def _seed(adapters: Sequence[LoraAdapter], seed: int | None) -> int | None:
    """Dropout is on when an adapter has dropout > 0 and autograd records (training); None = off."""
    if not torch.is_grad_enabled() or not any(ad.dropout > 0 for ad in adapters):
        return None
    return int(torch.randint(0, 2**31 - 1, (1,)).item()) if seed is None else int(seed)


def _tensors(x, adapters, *extra):
    return [x, *[t for ad in adapters for t in (ad.lora_a, ad.lora_b)], *[t for t in extra if t is not None]]


def grouped_lora(x: torch.Tensor, seg, adapters: Sequence[LoraAdapter], *, out: torch.Tensor | None = None,
                 dropout_seed: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Segmented multi-adapter (BD-)LoRA, Punica SGMV semantics with mixed ranks and block-diagonal factors:

        y[seg[i]:seg[i+1]] = scale[i] * dropout_i(x[seg[i]:seg[i+1]]) @ A[i] @ B[i]

    x (T, d_in); seg: n_adapters+1 non-decreasing row offsets (host list/tensor; segments may be empty);
    adapters: LoraAdapter per segment (PEFT-orientation packed factors, see ``layout``). Rows outside all
    segments get 0. With ``out`` (T, d_out) the result is added into it in place (``out += ...``) and
    ``out`` is returned. Dropout applies while autograd is recording and an adapter has dropout > 0; the
    mask comes from ``dropout_seed`` (drawn from torch's RNG if None). Differentiable in x, out and factors.
    """
    _check(x, adapters)
    seg = _seg_list(seg, len(adapters), x.shape[0])
    seed = _seed(adapters, dropout_seed)
    ok = dispatch.triton_ok(*_tensors(x, adapters, out)) and x.stride(1) == 1 and (out is None or out.stride(1) == 1)
    if dispatch.choose("grouped_lora", backend, ok) == "torch":
        delta = grouped_lora_ref(x, seg, adapters, torch_keep_masks(x, seg, adapters, seed))
        return delta if out is None else out.add_(delta)
    plan = _Plan(x, seg, adapters, seed, fuse_base=False)
    factors = [t.contiguous() for ad in adapters for t in (ad.lora_a, ad.lora_b)]
    return _LoraLinearFn.apply(plan, x, out, None, None, *factors)


def fused_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seg,
                      adapters: Sequence[LoraAdapter], *, dropout_seed: int | None = None, fuse_base: bool = False,
                      backend: str = "auto", bd_gemm: str = "auto") -> torch.Tensor:
    """LoRAFusion FusedLoRA / FusedMultiLoRA linear layer (weight frozen or not, PEFT orientation (d_out, d_in)):

        y = x @ weight^T + bias;  y[seg[i]:seg[i+1]] += scale[i] * dropout_i(x[seg[i]:seg[i+1]]) @ A[i] @ B[i]

    Backends ("auto" picks as listed):
      cublas : ``cublas.CublasLoraLinearFn``, every product one cuBLAS GEMM whose alpha/beta epilogue does the
               scale and the accumulation into the base output / base dX (no Triton). "auto" takes it on CUDA with
               one non-empty segment or a large layer (``dispatch.cublas_preferred``) and fuse_base=False, dropout
               included.
               bd_gemm ("auto" | "dense" | "blocks") says how it runs block-diagonal factors. Explicitly
               requested it also runs on CPU (the same torch ops on the CPU BLAS).
      triton : the LoRA expand added in place into the cuBLAS base output (fuse_base=False) or computed inside
               the Triton base-GEMM tile (fuse_base=True; needs seg to cover all rows); backward adds the LoRA dX
               into the base dX the same way, dS and dB share one read of dY. "auto" on CUDA otherwise, and on
               CPU under TRITON_INTERPRET=1.
      torch  : ``fused_lora_linear_ref`` (autograd), "auto" on CPU without the interpreter.
    Dropout masks come from ``dropout_seed`` (drawn from torch's RNG if None) and differ by backend: Triton draws
    ``dropout_keep_mask`` (one mask over the call's rows), cublas and torch ``segment_keep_mask`` (one per segment;
    both in ``dropout.py``).
    """
    _check(x, adapters)
    seg = _seg_list(seg, len(adapters), x.shape[0])
    if fuse_base and (seg[0] != 0 or seg[-1] != x.shape[0]):
        raise ValueError("fuse_base=True needs the segments to cover every row of x")
    if fuse_base and backend == "cublas":
        raise ValueError("fuse_base=True runs the base GEMM in a Triton tile; the cublas backend does not have it")
    seed = _seed(adapters, dropout_seed)
    factors = [t for ad in adapters for t in (ad.lora_a, ad.lora_b)]
    compute = [x, weight] + ([bias] if bias is not None else [])
    ok = dispatch.triton_ok(*compute, *factors) and x.stride(1) == 1
    n_seg = sum(e > s for s, e in zip(seg, seg[1:]))
    cublas = not fuse_base and dispatch.cublas_ok(compute, factors)
    use = dispatch.choose("fused_lora_linear", backend, ok, cublas=cublas,
                          prefer_cublas=dispatch.cublas_preferred(x.device.type, n_seg, *weight.shape[::-1]))
    if use == "torch":
        return fused_lora_linear_ref(x, weight, bias, seg, adapters, torch_keep_masks(x, seg, adapters, seed))
    if use == "cublas":
        return cublas_lora_linear(x, weight, bias, seg, adapters, seed, bd_gemm)
    plan = _Plan(x, seg, adapters, seed, fuse_base=fuse_base)
    return _LoraLinearFn.apply(plan, x, None, weight, bias, *[t.contiguous() for t in factors])

