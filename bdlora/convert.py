"""Conversions between adapter forms; every one keeps the served function ``x -> s * x A^T B^T`` (or reports the
error it makes).

* :func:`bd_to_dense` - packed BD-LoRA -> standard LoRA of the same rank (for engines without BD support).
* :func:`dense_to_bd` - standard LoRA of rank r -> BD-LoRA with N blocks: exact at rank N*r, or truncated to a
  target rank by per-block SVD with the relative Frobenius error of the weight delta reported.
* :func:`reblock` - an N-block adapter -> M blocks, for serving at TP degree M where M | N or N | M.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from .adapter import Adapter, AdapterConfig, layer_dims
from .layout import COLUMN, ROW, Layout, LoraFactors, unpack_factors
from .sharding import reblock_factors
from .spec import PRESETS, BDLoraError


class ConversionError(BDLoraError):
    """A conversion that cannot be done as asked (bad argument, a block count the layers or the adapter do not
    allow); the message says what would work."""


def _check_count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConversionError(f"{what} must be a positive integer, got {value!r}")
    return value


def reblock_route(nblocks: int, tp_size: int, src: str = "IN", dst: str = "OUT") -> str:
    """Why ``reblock`` cannot go from ``nblocks`` to ``tp_size`` blocks, and the two commands that can."""
    dense = f"{dst.rstrip('/')}-dense"
    return (f"cannot re-block an adapter with nblocks={nblocks} to {tp_size} blocks: reblock only merges or splits "
            f"whole blocks, so one of {nblocks} and {tp_size} must divide the other. Go through a dense adapter "
            f"instead (exact, rank {tp_size} x r; add --rank R to to-bd for a smaller, truncated one):\n"
            f"  bdlora convert to-dense {src} {dense}\n"
            f"  bdlora convert to-bd {dense} {dst} --nblocks {tp_size}")


def check_block_split(adapter: Adapter, layout_of, nblocks: int) -> None:
    """Refuses ``nblocks`` unless it divides the dimension every module of ``adapter`` splits into blocks: d_out of
    column-parallel layers (B block-diagonal), d_in of row-parallel ones (A block-diagonal); ``layout_of(path)`` gives
    the layout in the result. Checked before anything is written, so no adapter with empty or uneven blocks is made."""
    for p, f in adapter.modules.items():
        d_in, d_out = layer_dims(adapter.config, p, tuple(f.lora_A.shape), tuple(f.lora_B.shape))
        layout = layout_of(p)
        dim, name = (d_out, "d_out (outputs)") if layout == COLUMN else (d_in, "d_in (inputs)")
        if dim % nblocks:
            ok = [m for m in range(1, min(dim, 64) + 1) if dim % m == 0]
            raise ConversionError(
                f"{p}: {layout}-parallel layer with {name}={dim} cannot be split into {nblocks} blocks; the block "
                f"count must divide it (this layer allows {ok}{' ...' if dim > 64 else ''}). Pick a tensor-parallel "
                "size the model supports")


def _with_scale(cfg: AdapterConfig, r: int, scale: float, **changes) -> AdapterConfig:
    """A copy of ``cfg`` at rank ``r`` whose rsLoRA alpha reproduces ``scale`` exactly."""
    new = copy.deepcopy(cfg)
    new.r, new.use_rslora, new.peft_lora_alpha = r, True, scale * math.sqrt(r)
    for k, v in changes.items():
        setattr(new, k, v)
    return new


def require_bd(adapter: Adapter, what: str) -> None:
    if not adapter.config.is_bd:
        raise BDLoraError(f"{what} needs a BD-LoRA adapter (use_bdlora in adapter_config.json), got a dense LoRA; "
                          "convert it first with `bdlora convert to-bd`")


def bd_to_dense(adapter: Adapter) -> Adapter:
    """Standard PEFT LoRA with the block-diagonal factors expanded; same rank, same scale, same outputs.

    With expert factors the scale is written as plain LoRA's (``use_rslora: false``, ``lora_alpha`` = scale x r):
    the same scale in PEFT, and the one form every vLLM path reads alike (vLLM's per-expert packing computes
    ``lora_alpha / r`` itself)."""
    require_bd(adapter, "to-dense")
    cfg = adapter.config
    new = _with_scale(cfg, cfg.r, cfg.scale, nblocks=None, column_modules=[], row_modules=[])
    if adapter.experts:
        new.use_rslora, new.peft_lora_alpha = False, cfg.scale * cfg.r
    modules = {p: LoraFactors(*unpack_factors(f.lora_A, f.lora_B, f.layout, f.nblocks), None, 1, new.scale)
               for p, f in adapter.modules.items()}
    return Adapter(new, modules, {p: f.dense() for p, f in adapter.experts.items()})


def refuse_experts(adapter: Adapter, what: str) -> None:
    if adapter.experts:
        raise ConversionError(f"{what} is not available for LoRA on MoE expert tensors ({len(adapter.experts)} in "
                              "this adapter) yet; `bdlora convert to-dense` converts them")


def reblock(adapter: Adapter, tp_size: int, src: str = "IN", dst: str = "OUT") -> Adapter:
    """The same adapter with ``tp_size`` blocks (rank grows by M/N when M > N); outputs are unchanged.

    Needs M | N or N | M, and M dividing every dimension the blocks split (:func:`check_block_split`); ``src`` and
    ``dst`` only fill in the commands the error message suggests otherwise (:func:`reblock_route`).
    """
    require_bd(adapter, "reblock")
    refuse_experts(adapter, "reblock")
    cfg = adapter.config
    _check_count(tp_size, "the target tensor-parallel size (--tp)")
    check_block_split(adapter, cfg.layout_of, tp_size)  # first: if the layers cannot split, no route can help
    if tp_size % cfg.nblocks and cfg.nblocks % tp_size:
        raise ConversionError(reblock_route(cfg.nblocks, tp_size, src, dst))
    new = _with_scale(cfg, cfg.r * max(1, tp_size // cfg.nblocks), cfg.scale, nblocks=tp_size)
    modules = {p: LoraFactors(*reblock_factors(f.lora_A, f.lora_B, f.layout, f.nblocks, tp_size), f.layout, tp_size,
                              new.scale)
               for p, f in adapter.modules.items()}
    return Adapter(new, modules)


@dataclass
class TruncationReport:
    """Relative Frobenius error ||dW' - dW|| / ||dW|| of the weight deltas, per module and over all modules."""

    per_module: dict[str, float]
    total: float


def _block_svd(b: torch.Tensor, a: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Best rank-``rank`` factors of ``b @ a`` via QR of the thin factors; returns (B', A', kept^2, total^2)."""
    qb, rb = torch.linalg.qr(b.double())
    qa, ra = torch.linalg.qr(a.double().T)
    u, s, vh = torch.linalg.svd(rb @ ra.T)
    k = min(rank, s.numel())
    root = s[:k].sqrt()
    b_new = torch.zeros(b.shape[0], rank, dtype=torch.float64)
    a_new = torch.zeros(rank, a.shape[1], dtype=torch.float64)
    b_new[:, :k] = (qb @ u[:, :k]) * root
    a_new[:k] = root[:, None] * (vh[:k] @ qa.T)
    return b_new, a_new, float((s[:k] ** 2).sum()), float((s ** 2).sum())


def dense_to_bd(adapter: Adapter, nblocks: int, rank: Optional[int] = None,
                column_modules: Iterable[str] = PRESETS["llama"][COLUMN],
                row_modules: Iterable[str] = PRESETS["llama"][ROW]) -> tuple[Adapter, TruncationReport]:
    """BD-LoRA with ``nblocks`` blocks from a dense LoRA.

    ``rank=None`` gives the exact adapter of rank ``nblocks * r``: column layers repeat A per block and keep B
    (block i reads its own copy), row layers split A by input blocks and repeat B. A smaller ``rank`` (divisible by
    ``nblocks``) keeps the best rank ``rank/nblocks`` approximation of each block's delta (truncated SVD).
    """
    refuse_experts(adapter, "to-bd")
    cfg = adapter.config
    if cfg.is_bd:
        raise BDLoraError("to-bd expects a dense LoRA adapter, but this one already has use_bdlora; "
                          "use `bdlora convert reblock --tp M` to change its number of blocks")
    n = _check_count(nblocks, "nblocks (--nblocks)")
    if rank is not None:
        _check_count(rank, "the target rank (--rank)")
    target = rank if rank is not None else n * cfg.r
    if target % n:
        raise ConversionError(f"target rank {target} is not divisible by nblocks={n}; every block needs rank "
                              f"rank/nblocks, use --rank {max(n, target - target % n)} or {target - target % n + n}")
    cols, rows = list(column_modules), list(row_modules)
    new_cfg = _with_scale(cfg, target, cfg.scale, nblocks=n, column_modules=cols, row_modules=rows)
    check_block_split(adapter, new_cfg.layout_of, n)  # also: every module must be column- or row-parallel
    per_module, kept_all, total_all = {}, 0.0, 0.0
    modules = {}
    for p, f in adapter.modules.items():
        layout: Layout = new_cfg.layout_of(p)
        a, b = f.lora_A, f.lora_B
        if rank is None:
            if layout == COLUMN:
                new = LoraFactors(a.repeat(n, 1), b.clone(), layout, n, new_cfg.scale)
            else:
                new = LoraFactors(torch.cat(a.chunk(n, dim=1), dim=0), b.repeat(1, n), layout, n, new_cfg.scale)
            per_module[p] = 0.0
            modules[p] = new
            continue
        rb = target // n
        a_blocks, b_blocks, kept, total = [], [], 0.0, 0.0
        for i in range(n):
            bi, ai = (b.chunk(n, dim=0)[i], a) if layout == COLUMN else (b, a.chunk(n, dim=1)[i])
            b_new, a_new, k2, t2 = _block_svd(bi, ai, rb)
            a_blocks.append(a_new)
            b_blocks.append(b_new)
            kept, total = kept + k2, total + t2
        dt = a.dtype
        if layout == COLUMN:
            modules[p] = LoraFactors(torch.cat(a_blocks).to(dt), torch.cat(b_blocks).to(dt), layout, n, new_cfg.scale)
        else:
            modules[p] = LoraFactors(torch.cat(a_blocks).to(dt), torch.cat(b_blocks, dim=1).to(dt), layout, n,
                                     new_cfg.scale)
        per_module[p] = math.sqrt(max(total - kept, 0.0) / total) if total > 0 else 0.0
        kept_all, total_all = kept_all + kept, total_all + total
    overall = math.sqrt(max(total_all - kept_all, 0.0) / total_all) if total_all > 0 else 0.0
    return Adapter(new_cfg, modules), TruncationReport(per_module, overall)


def delta_weight(factors: LoraFactors) -> torch.Tensor:
    """``factors.scale * B @ A`` in float64 with any block-diagonal factor expanded: the (d_out, d_in) weight delta."""
    a, b = factors.lora_A, factors.lora_B
    if factors.layout is not None:
        a, b = unpack_factors(a, b, factors.layout, factors.nblocks)
    return factors.scale * (b.double() @ a.double())


__all__ = ["ConversionError", "TruncationReport", "bd_to_dense", "check_block_split", "delta_weight", "dense_to_bd",
           "reblock", "reblock_route", "require_bd"]
