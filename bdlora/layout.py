"""Layouts and the one adapter model: which factor of a module is block-diagonal, and one module's packed factors.

:class:`LoraFactors` is one module's LoRA as every part of bdlora passes it (the PEFT folder format, the conversions,
the kernels, the engine): its layout and block count, its packed factors in PEFT orientation, its scale and dropout.
:func:`layout_by_name` is the one rule for a module's layout; :func:`pack_block_diagonal` /
:func:`unpack_block_diagonal` the one packing of block-diagonal factors.

Orientation
-----------
Activations are row-major: ``x`` is (T, d_in), ``y`` is (T, d_out).  The math is

    y += scale * dropout(x) @ A @ B,      A: (d_in, r),  B: (r, d_out)   ("math" orientation)

but the factors are stored, passed and *read by the kernels* exactly as PEFT stores them (nn.Linear convention,
out x in), so trainer parameters are passed without transposes or copies and their gradients come back in place:

    lora_A = A^T (packed)     lora_B = B^T (packed)

Block-diagonal factors are packed, never with zeros (PEFT ``BlockDiagonalLinear.weight``, (out, in/N)):

* layout "column" (column-parallel q/k/v/gate/up; B block-diagonal):
  lora_A (r, d_in) dense; lora_B (d_out, r/N), rows j*d_out/N.. form block j and read rank block j:
      y[:, out_j] += scale * (x @ lora_A[rank_j].T) @ lora_B[out_j].T
* layout "row" (row-parallel o/down; A block-diagonal):
  lora_A (r, d_in/N), rows j*r/N.. form block j and read input block j; lora_B (d_out, r) dense:
      y += scale * sum_j (x[:, in_j] @ lora_A[rank_j].T) @ lora_B[:, rank_j].T
* N = 1 is plain LoRA in either layout; layout None is a dense (standard) LoRA module (N = 1).

Both layouts are one primitive applied twice: a block-diagonal matmul ``out[:, m_j] = in[:, k_j] @
W[m_j].T`` with W stored (M, K/N) -- the shrink uses (W=lora_A, N_a), the expand (W=lora_B, N_b), where
column layout has (N_a, N_b) = (1, N) and row layout (N, 1) (:attr:`LoraFactors.blocks_a`, ``blocks_b``).
"""

from __future__ import annotations

from dataclasses import dataclass
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


class LoraFactorsError(ValueError):
    """LoRA factors whose layout, block count, shapes or dropout do not fit together."""


@dataclass
class LoraFactors:
    """One module's (possibly block-diagonal) LoRA: factors in PEFT orientation and PEFT's names, packed.

    ``layout`` None is a dense (standard) LoRA module, with ``nblocks`` 1. Validated when built (cheaply: the engine
    builds these per layer call for the kernels, see ``JobAdapter.kernel_adapter``).
    """

    lora_A: torch.Tensor  # (r, d_in) for "column" and dense, (r, d_in/N) for "row"
    lora_B: torch.Tensor  # (d_out, r/N) for "column", (d_out, r) for "row" and dense
    layout: Optional[Layout] = None
    nblocks: int = 1
    scale: float = 1.0
    dropout: float = 0.0

    def __post_init__(self):
        layout, n = self.layout, self.nblocks
        if layout is None:
            if n != 1:
                raise LoraFactorsError(f"a dense LoRA module (layout None) has nblocks 1, got {n}; give its layout "
                                       f"{LAYOUTS} to make it block-diagonal")
        elif layout not in LAYOUTS:
            raise LoraFactorsError(f"layout must be one of {LAYOUTS} or None (dense), got {layout!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraFactorsError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.lora_A.dim() != 2 or self.lora_B.dim() != 2:
            raise LoraFactorsError(f"lora_A and lora_B must be 2-D, got shapes {tuple(self.lora_A.shape)} and "
                                   f"{tuple(self.lora_B.shape)}")
        r = self.rank
        if n < 1 or r % n:
            raise LoraFactorsError(f"rank {r} is not divisible by nblocks {n}")
        a_cols = self.d_in // n if layout == ROW else self.d_in
        b_cols = r // n if layout == COLUMN else r
        if self.lora_A.shape[1] != a_cols or self.lora_B.shape[1] != b_cols or self.d_out % n:
            raise LoraFactorsError(
                f"{layout or 'dense'} layout with N={n}: lora_A {tuple(self.lora_A.shape)} / lora_B "
                f"{tuple(self.lora_B.shape)} do not match (r={r}, d_in={self.d_in}, d_out={self.d_out})"
            )

    @property
    def rank(self) -> int:
        return self.lora_A.shape[0]

    @property
    def d_in(self) -> int:
        cols = self.lora_A.shape[1]
        return cols * self.nblocks if self.layout == ROW else cols

    @property
    def d_out(self) -> int:
        return self.lora_B.shape[0]

    @property
    def blocks_a(self) -> int:
        """Blocks of the shrink (x @ A): N for row layout, else 1."""
        return self.nblocks if self.layout == ROW else 1

    @property
    def blocks_b(self) -> int:
        """Blocks of the expand (S @ B): N for column layout, else 1."""
        return self.nblocks if self.layout == COLUMN else 1


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
    # the diagonal blocks as one strided view: each dispatched op is host time in a training step of small batches
    diag_blocks(full, nblocks).copy_(w.view(nblocks, m // nblocks, kb))
    return full


def diag_blocks(full: torch.Tensor, nblocks: int) -> torch.Tensor:
    """The N diagonal blocks of ``full`` (M, K) as one (N, M/N, K/N) view of its storage (any strides)."""
    m, k = full.shape
    if m % nblocks or k % nblocks:
        raise ValueError(f"a ({m}, {k}) matrix has no {nblocks} equal diagonal blocks")
    s0, s1 = full.stride()
    return full.as_strided((nblocks, m // nblocks, k // nblocks), ((m // nblocks) * s0 + (k // nblocks) * s1, s0, s1))


def pack_block_diagonal(full: torch.Tensor, nblocks: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense block-diagonal (M, K) -> its N diagonal blocks packed (M, K/N), in ``dtype`` (default full's); the
    off-diagonal blocks are dropped. One small copy (none for N = 1 in full's dtype: then ``full`` itself);
    differentiable."""
    if nblocks == 1:
        return full.to(dtype or full.dtype)
    m, k = full.shape
    out = full.new_empty(nblocks, m // nblocks, k // nblocks, dtype=dtype)
    out.copy_(diag_blocks(full, nblocks))
    return out.view(m, k // nblocks)


def unpack_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, layout: Layout, nblocks: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense (r, d_in), (d_out, r) factors with the block-diagonal one expanded with zeros."""
    if layout == COLUMN:
        return lora_a, unpack_block_diagonal(lora_b, nblocks)
    return unpack_block_diagonal(lora_a, nblocks), lora_b


def to_math(factors: LoraFactors) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense math-orientation factors A (d_in, r), B (r, d_out), zeros materialized (for references)."""
    a = unpack_block_diagonal(factors.lora_A, factors.blocks_a)
    b = unpack_block_diagonal(factors.lora_B, factors.blocks_b)
    return a.t(), b.t()


def from_math(A: torch.Tensor, B: torch.Tensor, layout: Optional[Layout] = None, nblocks: int = 1,
              scale: float = 1.0, dropout: float = 0.0) -> LoraFactors:
    """Factors from math-orientation A (d_in, r), B (r, d_out); the block-diagonal one is packed."""
    na, nb = (nblocks, 1) if layout == ROW else (1, nblocks)
    return LoraFactors(pack_block_diagonal(A.t(), na).contiguous(), pack_block_diagonal(B.t(), nb).contiguous(),
                       layout, nblocks, scale, dropout)


__all__ = [
    "COLUMN", "LAYOUTS", "Layout", "LoraFactors", "LoraFactorsError", "ROW", "diag_blocks", "from_math",
    "layout_by_name", "pack_block_diagonal", "packed_shapes", "to_math", "unpack_block_diagonal", "unpack_factors",
]
