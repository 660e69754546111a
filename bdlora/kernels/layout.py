"""Adapter description shared by every kernel, and conversions between weight orientations.

Orientation used everywhere in ``bdlora.kernels``
-------------------------------------------------
Activations are row-major: ``x`` is (T, d_in), ``y`` is (T, d_out).  The math is

    y += scale * dropout(x) @ A @ B,      A: (d_in, r),  B: (r, d_out)   ("math" orientation)

but the kernels *read* the factors exactly as PEFT stores them (nn.Linear convention, out x in), so
trainer parameters are passed without transposes or copies and their gradients come back in place:

    lora_a = A^T (packed)     lora_b = B^T (packed)

Block-diagonal factors are packed, never with zeros (PEFT ``BlockDiagonalLinear.weight``, (out, in/N)):

* layout "column" (column-parallel q/k/v/gate/up; B block-diagonal):
  lora_a (r, d_in) dense; lora_b (d_out, r/N), rows j*d_out/N.. form block j and read rank block j:
      y[:, out_j] += scale * (x @ lora_a[rank_j].T) @ lora_b[out_j].T
* layout "row" (row-parallel o/down; A block-diagonal):
  lora_a (r, d_in/N), rows j*r/N.. form block j and read input block j; lora_b (d_out, r) dense:
      y += scale * sum_j (x[:, in_j] @ lora_a[rank_j].T) @ lora_b[:, rank_j].T
* N = 1 is plain LoRA in either layout.

Both layouts are one primitive applied twice: a block-diagonal matmul ``out[:, m_j] = in[:, k_j] @
W[m_j].T`` with W stored (M, K/N) -- the shrink uses (W=lora_a, N_a), the expand (W=lora_b, N_b), where
column layout has (N_a, N_b) = (1, N) and row layout (N, 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bdlora.layout import pack_block_diagonal, unpack_block_diagonal  # the one pack/unpack (core)

LAYOUTS = ("column", "row")


@dataclass
class LoraAdapter:
    """One (possibly block-diagonal) LoRA adapter of one layer, factors in PEFT orientation (packed)."""

    lora_a: torch.Tensor  # (r, d_in) for "column", (r, d_in/N) for "row"
    lora_b: torch.Tensor  # (d_out, r/N) for "column", (d_out, r) for "row"
    scale: float = 1.0
    layout: str = "column"
    nblocks: int = 1
    dropout: float = 0.0

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        n, r = self.nblocks, self.rank
        if n < 1 or r % n:
            raise ValueError(f"rank {r} is not divisible by nblocks {n}")
        a_cols = self.d_in // n if self.layout == "row" else self.d_in
        b_cols = r // n if self.layout == "column" else r
        if self.lora_a.dim() != 2 or self.lora_b.dim() != 2:
            raise ValueError("lora_a and lora_b must be 2-D")
        if self.lora_a.shape[1] != a_cols or self.lora_b.shape[1] != b_cols or self.d_out % n:
            raise ValueError(
                f"{self.layout} layout with N={n}: lora_a {tuple(self.lora_a.shape)} / lora_b "
                f"{tuple(self.lora_b.shape)} do not match (r={r}, d_in={self.d_in}, d_out={self.d_out})"
            )

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    @property
    def d_in(self) -> int:
        cols = self.lora_a.shape[1]
        return cols * self.nblocks if self.layout == "row" else cols

    @property
    def d_out(self) -> int:
        return self.lora_b.shape[0]

    @property
    def blocks_a(self) -> int:
        """Blocks of the shrink (x @ A): N for row layout, else 1."""
        return self.nblocks if self.layout == "row" else 1

    @property
    def blocks_b(self) -> int:
        """Blocks of the expand (S @ B): N for column layout, else 1."""
        return self.nblocks if self.layout == "column" else 1


def to_math(adapter: LoraAdapter) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense math-orientation factors A (d_in, r), B (r, d_out), zeros materialized (for references)."""
    a = unpack_block_diagonal(adapter.lora_a, adapter.blocks_a)
    b = unpack_block_diagonal(adapter.lora_b, adapter.blocks_b)
    return a.t(), b.t()


def from_math(A: torch.Tensor, B: torch.Tensor, layout: str = "column", nblocks: int = 1,
              scale: float = 1.0, dropout: float = 0.0) -> LoraAdapter:
    """Build an adapter from math-orientation A (d_in, r), B (r, d_out); the block-diagonal one is packed."""
    na, nb = (nblocks, 1) if layout == "row" else (1, nblocks)
    return LoraAdapter(pack_block_diagonal(A.t(), na).contiguous(), pack_block_diagonal(B.t(), nb).contiguous(),
                       scale=scale, layout=layout, nblocks=nblocks, dropout=dropout)
