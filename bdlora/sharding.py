"""Which part of a packed BD-LoRA factor pair each tensor-parallel rank holds.

Factors are in PEFT orientation and packed the way PEFT's ``BlockDiagonalLinear`` stores them (README.md, "Adapter format";
``bdlora.layout`` has the layouts, ``LoraFactors`` and the one pack/unpack):

* column layout (B block-diagonal): ``lora_A`` (r, d_in); ``lora_B`` packed (d_out, r/N), output-row block i
  reads rank block i.
* row layout (A block-diagonal): ``lora_A`` packed (r, d_in/N), rank block i reads input block i;
  ``lora_B`` (d_out, r).

At TP degree M with M | N each rank holds N/M whole blocks; with N | M a block is shared by M/N ranks (column:
A_i replicated, B_i sliced by output rows; row: A_i sliced by input columns, B_i replicated, partial sums ride the
base model's all-reduce). Either way no LoRA communication is needed.

The functions only use ``x[a:b, c:d]`` slicing and a shape, so they accept torch tensors and safetensors
``get_slice`` handles alike: a serving rank reads only its own bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from .layout import COLUMN, ROW, Layout
from .spec import BDLoraError


def shape_of(t: Any) -> tuple[int, ...]:
    return tuple(t.get_shape()) if hasattr(t, "get_shape") else tuple(t.shape)


def _as_tensor(t: Any) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else torch.as_tensor(t)


def check_tp_compatible(nblocks: int, tp_size: int) -> None:
    if tp_size % nblocks and nblocks % tp_size:
        divisors = [m for m in range(1, nblocks + 1) if nblocks % m == 0]
        raise BDLoraError(
            f"adapter has nblocks={nblocks} but tensor-parallel size is {tp_size}: BD-LoRA serves without extra "
            f"communication only when one divides the other; use --tensor-parallel-size in {divisors} or a multiple "
            f"of {nblocks}, or make a {tp_size}-block adapter through a dense one (reblock cannot: neither block "
            f"count divides the other): `bdlora convert to-dense ADAPTER ADAPTER-dense` then `bdlora convert to-bd "
            f"ADAPTER-dense ADAPTER-tp{tp_size} --nblocks {tp_size}`"
        )


def shard_factors(lora_a: Any, lora_b: Any, layout: Layout, nblocks: int, tp_size: int, tp_rank: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A, lora_B) of TP rank ``tp_rank`` of ``tp_size`` in PEFT orientation.

    Column layout: A_local (r_local, d_in), B_local (d_out/M, r_local). Row layout: A_local (r_local, d_in/M),
    B_local (d_out, r_local). ``r_local = r/N * max(1, N/M)``. When M < N the N/M blocks a rank holds are
    assembled block-diagonally (the zeros exist only on that rank, never on disk).
    """
    check_tp_compatible(nblocks, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise BDLoraError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    r = shape_of(lora_a)[0]
    rb = r // nblocks
    per_rank = max(1, nblocks // tp_size)  # whole blocks held by one rank
    group = max(1, tp_size // nblocks)  # ranks sharing one block
    first = tp_rank * nblocks // tp_size  # first block this rank holds
    ranks = slice(first * rb, (first + per_rank) * rb)
    if layout == COLUMN:
        d_out = shape_of(lora_b)[0]
        rows = d_out // tp_size
        a_local = _as_tensor(lora_a[ranks, :])
        b_rows = _as_tensor(lora_b[tp_rank * rows:(tp_rank + 1) * rows, :])
        b_local = torch.block_diag(*b_rows.chunk(per_rank, dim=0)) if per_rank > 1 else b_rows
        return a_local, b_local
    if layout == ROW:
        cols_per_block = shape_of(lora_a)[1]
        b_local = _as_tensor(lora_b[:, ranks])
        if per_rank > 1:
            a_local = torch.block_diag(*_as_tensor(lora_a[ranks, :]).chunk(per_rank, dim=0))
        else:
            cols = cols_per_block // group
            j = tp_rank % group
            a_local = _as_tensor(lora_a[ranks, j * cols:(j + 1) * cols])
        return a_local, b_local
    raise BDLoraError(f"unknown layout {layout!r}; expected {COLUMN!r} or {ROW!r}")


def reblock_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, layout: Layout, nblocks: int, tp_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed factors of the same adapter as a ``tp_size``-block BD-LoRA (rank ``r * max(1, M/N)``).

    Built from the per-rank shards, so re-blocked files and on-the-fly serving at TP degree M agree by construction.
    """
    shards = [shard_factors(lora_a, lora_b, layout, nblocks, tp_size, t) for t in range(tp_size)]
    a = torch.cat([s[0] for s in shards], dim=0)
    b = torch.cat([s[1] for s in shards], dim=0 if layout == COLUMN else 1)
    return a, b
