"""Layouts: which factor of a module is block-diagonal (:func:`layout_by_name`, the one rule), the packed shapes, and
the one packing of block-diagonal factors (:func:`pack_block_diagonal` / :func:`unpack_block_diagonal`).

Factors are in PEFT orientation (nn.Linear, out x in) and block-diagonal ones are packed, never with zeros (PEFT
``BlockDiagonalLinear.weight``, (out, in/N)): layout "column" (column-parallel q/k/v/gate/up) has lora_B (d_out, r/N)
block-diagonal, layout "row" (row-parallel o/down) has lora_A (r, d_in/N) block-diagonal.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

COLUMN: Literal["column"] = "column"
ROW: Literal["row"] = "row"
Layout = Literal["column", "row"]
LAYOUTS: tuple[str, ...] = (COLUMN, ROW)


def layout_by_name(module_path: str, column_modules, row_modules) -> Optional[Layout]:
    """The one rule for which factor of a module is block-diagonal: COLUMN (B) when the last component of
    ``module_path`` is one of ``column_modules``, ROW (A) when one of ``row_modules``, None otherwise. Names match
    exactly (PEFT matches substrings, which silently matches too much)."""
    leaf = module_path.rsplit(".", 1)[-1]
    if leaf in column_modules:
        return COLUMN
    if leaf in row_modules:
        return ROW
    return None


def packed_shapes(layout: Layout, d_in: int, d_out: int, r: int, nblocks: int) -> tuple[tuple, tuple]:
    """Expected (lora_A, lora_B) shapes of a packed factor pair."""
    if layout == COLUMN:
        return (r, d_in), (d_out, r // nblocks)
    return (r, d_in // nblocks), (d_out, r)


def unpack_block_diagonal(w: torch.Tensor, nblocks: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Packed (M, K/N) -> dense (M, K) with the N row blocks on the diagonal and zeros elsewhere (PEFT's convention),
    in ``dtype`` (default w's): one zero fill and one strided copy (which also casts); differentiable. The one
    unpacking of block-diagonal factors: conversions, references, tests and the kernels' dense GEMMs use it."""
    m, kb = w.shape
    full = w.new_zeros(m, kb * nblocks, dtype=dtype)
    full.view(nblocks, m // nblocks, nblocks, kb).diagonal(dim1=0, dim2=2).copy_(
        w.view(nblocks, m // nblocks, kb).permute(1, 2, 0))
    return full


def pack_block_diagonal(full: torch.Tensor, nblocks: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense block-diagonal (M, K) -> its N diagonal blocks packed (M, K/N), in ``dtype`` (default full's); the
    off-diagonal blocks are dropped. One small copy (none for N = 1 in full's dtype: then ``full`` itself);
    differentiable."""
    if nblocks == 1:
        return full.to(dtype or full.dtype)
    m, k = full.shape
    out = full.new_empty(nblocks, m // nblocks, k // nblocks, dtype=dtype)
    out.copy_(full.view(nblocks, m // nblocks, nblocks, k // nblocks).diagonal(dim1=0, dim2=2).permute(2, 0, 1))
    return out.view(m, k // nblocks)


def unpack_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, layout: Layout, nblocks: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense (r, d_in), (d_out, r) factors with the block-diagonal one expanded with zeros."""
    if layout == COLUMN:
        return lora_a, unpack_block_diagonal(lora_b, nblocks)
    return unpack_block_diagonal(lora_a, nblocks), lora_b


__all__ = [
    "COLUMN", "LAYOUTS", "Layout", "ROW", "layout_by_name", "pack_block_diagonal", "packed_shapes",
    "unpack_block_diagonal", "unpack_factors",
]
