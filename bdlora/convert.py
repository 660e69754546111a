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

from .adapter import Adapter, AdapterConfig, LoraFactors
from .sharding import check_tp_compatible, reblock_factors, unpack_factors
from .spec import COLUMN, PRESETS, ROW, BDLoraError, Layout


def _with_scale(cfg: AdapterConfig, r: int, scale: float, **changes) -> AdapterConfig:
    """A copy of ``cfg`` at rank ``r`` whose rsLoRA alpha reproduces ``scale`` exactly."""
    new = copy.deepcopy(cfg)
    new.r, new.use_rslora, new.lora_alpha = r, True, scale * math.sqrt(r)
    for k, v in changes.items():
        setattr(new, k, v)
    return new


def require_bd(adapter: Adapter, what: str) -> None:
    if not adapter.config.is_bd:
        raise BDLoraError(f"{what} needs a BD-LoRA adapter (use_bdlora in adapter_config.json), got a dense LoRA; "
                          "convert it first with `bdlora convert to-bd`")


def bd_to_dense(adapter: Adapter) -> Adapter:
    """Standard PEFT LoRA with the block-diagonal factors expanded; same rank, same scale, same outputs."""
    require_bd(adapter, "to-dense")
    cfg = adapter.config
    modules = {p: LoraFactors(*unpack_factors(f.lora_A, f.lora_B, f.layout, cfg.nblocks), None)
               for p, f in adapter.modules.items()}
    new = _with_scale(cfg, cfg.r, cfg.scale, nblocks=None, column_modules=[], row_modules=[])
    return Adapter(new, modules)


def reblock(adapter: Adapter, tp_size: int) -> Adapter:
    """The same adapter with ``tp_size`` blocks (rank grows by M/N when M > N); outputs are unchanged."""
    require_bd(adapter, "reblock")
    cfg = adapter.config
    check_tp_compatible(cfg.nblocks, tp_size)
    modules = {p: LoraFactors(*reblock_factors(f.lora_A, f.lora_B, f.layout, cfg.nblocks, tp_size), f.layout)
               for p, f in adapter.modules.items()}
    new_r = cfg.r * max(1, tp_size // cfg.nblocks)
    return Adapter(_with_scale(cfg, new_r, cfg.scale, nblocks=tp_size), modules)


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
    cfg = adapter.config
    if cfg.is_bd:
        raise BDLoraError("to-bd expects a dense LoRA adapter, but this one already has use_bdlora; "
                          "use `bdlora convert reblock --tp M` to change its number of blocks")
    n = nblocks
    target = rank if rank is not None else n * cfg.r
    if target % n:
        raise BDLoraError(f"target rank {target} is not divisible by nblocks={n}")
    cols, rows = list(column_modules), list(row_modules)
    new_cfg = _with_scale(cfg, target, cfg.scale, nblocks=n, column_modules=cols, row_modules=rows)
    per_module, kept_all, total_all = {}, 0.0, 0.0
    modules = {}
    for p, f in adapter.modules.items():
        layout: Layout = new_cfg.layout_of(p)
        a, b = f.lora_A, f.lora_B
        split = b.shape[0] if layout == COLUMN else a.shape[1]
        if split % n:
            raise BDLoraError(f"{p}: {'d_out' if layout == COLUMN else 'd_in'}={split} is not divisible by "
                              f"nblocks={n}")
        if rank is None:
            if layout == COLUMN:
                new = LoraFactors(a.repeat(n, 1), b.clone(), layout)
            else:
                new = LoraFactors(torch.cat(a.chunk(n, dim=1), dim=0), b.repeat(1, n), layout)
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
            modules[p] = LoraFactors(torch.cat(a_blocks).to(dt), torch.cat(b_blocks).to(dt), layout)
        else:
            modules[p] = LoraFactors(torch.cat(a_blocks).to(dt), torch.cat(b_blocks, dim=1).to(dt), layout)
        per_module[p] = math.sqrt(max(total - kept, 0.0) / total) if total > 0 else 0.0
        kept_all, total_all = kept_all + kept, total_all + total
    overall = math.sqrt(max(total_all - kept_all, 0.0) / total_all) if total_all > 0 else 0.0
    return Adapter(new_cfg, modules), TruncationReport(per_module, overall)


def delta_weight(factors: LoraFactors, nblocks: Optional[int], scale: float) -> torch.Tensor:
    """``scale * B @ A`` with any block-diagonal factor expanded: the (d_out, d_in) weight delta."""
    a, b = factors.lora_A, factors.lora_B
    if factors.layout is not None:
        a, b = unpack_factors(a, b, factors.layout, nblocks)
    return scale * (b.double() @ a.double())


__all__ = ["TruncationReport", "bd_to_dense", "delta_weight", "dense_to_bd", "reblock", "require_bd"]
