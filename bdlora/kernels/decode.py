"""Serving decode path: fused shrink+expand over several slices of a layer (e.g. q, k, v) in one launch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from . import dispatch
from .layout import LAYOUTS
from .reference import decode_lora_torch


def _next_pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


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


def decode_column_chunks(tokens: int, slice_blocks: int, max_block: int, min_cols: int, programs: int) -> int:
    """Output-column chunks per (token, slice, block) for ``decode_lora``'s grid: enough programs to reach
    ``programs`` (a few per SM), chunks at least ``min_cols`` wide. Sized on the widest slice block: a narrower
    one's surplus chunks exit at once (sizing on the narrowest gave 2-3 programs per layer at batch 1 at TP=4, where
    k/v have 256 columns: far slower than vLLM's punica path in serving, bench/results/serve/grid_8b_tp4_fused).
    Each chunk recomputes its shrink (one rank block of x @ A), the price of a single launch."""
    return max(1, min(-(-max_block // min_cols), -(-programs // (tokens * slice_blocks))))


@dataclass(frozen=True)
class DecodeTiles:
    """Tile sizes and grid targets of ``decode_lora``'s Triton kernel on one kind of device."""

    block_k: int  # input columns per step of the shrink loop
    block_n: int  # output columns per step of the expand loop
    warps: int
    k_split_len: int  # input columns per program: the shrink of d_in is split over ceil(d_in / k_split_len) programs
    min_cols: int  # narrowest column chunk
    programs: int  # programs wanted per launch (a few per SM)


def decode_tiles(device: torch.device) -> DecodeTiles:
    """The tiles for ``device``: H200-tuned on CUDA (bench/results/kernels/h200-decode-splitk-2026-11-22.log)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return DecodeTiles(block_k=128, block_n=64, warps=4, k_split_len=512, min_cols=128, programs=4 * sms)
    # small tiles under the interpreter, still several chunks and splits so both paths are tested on CPU
    return DecodeTiles(block_k=32, block_n=32, warps=1, k_split_len=32, min_cols=32, programs=16)


@dataclass(frozen=True)
class DecodeGrid:
    """One ``decode_lora`` launch: grid (tokens, groups, k_splits), groups = slices x blocks x column chunks."""

    tokens: int
    n_chunks: int
    n_groups: int
    k_splits: int
    block_r: int

    @property
    def partials(self) -> int:  # fp32 entries of the split-K workspace
        return self.tokens * self.n_groups * self.k_splits * self.block_r if self.k_splits > 1 else 0

    @property
    def counters(self) -> int:
        return self.tokens * self.n_groups if self.k_splits > 1 else 0


def decode_grid(tokens: int, n_slices: int, nb: int, max_block: int, d_in: int, r_max: int,
                tiles: DecodeTiles) -> DecodeGrid:
    """The launch ``decode_lora`` makes for these shapes: the input dimension split in k_split_len ranges (one
    program each), then column chunks (``decode_column_chunks``) until the wanted program count is reached."""
    k_splits = -(-d_in // tiles.k_split_len)
    n_chunks = decode_column_chunks(tokens, n_slices * nb * k_splits, max_block, tiles.min_cols, tiles.programs)
    return DecodeGrid(tokens, n_chunks, n_slices * nb * n_chunks, k_splits, max(16, _next_pow2(r_max // nb)))


class DecodeWorkspace:
    """Scratch of ``decode_lora``'s split-K path: fp32 partial shrinks and per-group arrival counters.

    The counters are zero between launches (the last program of a group puts its counter back), so one workspace
    can serve every layer of a model whose launches run one after another on one stream. Size it before CUDA-graph
    capture (``reserve``): a captured launch keeps the addresses it saw.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.partials = torch.empty(0, dtype=torch.float32, device=self.device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=self.device)

    def reserve(self, grid: DecodeGrid) -> "DecodeWorkspace":
        """Grow (never shrink) to fit ``grid``."""
        if grid.partials > self.partials.numel():
            self.partials = torch.empty(grid.partials, dtype=torch.float32, device=self.device)
        if grid.counters > self.counters.numel():
            self.counters = torch.zeros(grid.counters, dtype=torch.int32, device=self.device)
        return self

    def fits(self, grid: DecodeGrid) -> bool:
        return grid.partials <= self.partials.numel() and grid.counters <= self.counters.numel()


def decode_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                token_lora_indices: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                slice_offsets: Sequence[int], *, layout: str = "column", nblocks: int = 1,
                backend: str = "auto", soff: torch.Tensor | None = None,
                workspace: DecodeWorkspace | None = None) -> torch.Tensor:
    """Multi-slice BGMV, in place, one launch for all slices (Punica/vLLM semantics, -1 = no LoRA):

        for t with a = token_lora_indices[t] >= 0, for each slice s (columns soff[s]:soff[s+1] of y):
            y[t, soff[s]:soff[s+1]] += scales[a] * x[t] @ A[s, a] @ B[s, a]

    y (T, sum d_out_s); x (T, d_in); lora_a (S, L, R, d_in/N_a) and lora_b (L, sum d_out_s, R/N_b): packed PEFT
    orientation per slot (see ``stack_decode_weights``); ranks (L,) int: slot a uses the first ranks[a] ranks
    (block j of a block-diagonal factor = rank block j of ranks[a]/N); scales (L,) float. Meant for 1-64 tokens.
    Returns y.

    The Triton kernel splits the input dimension over programs (``decode_grid``) and combines their partial
    shrinks inside the launch through ``workspace`` (``DecodeWorkspace``; a temporary one is made when None).

    CUDA-graph use (serving): pass ``token_lora_indices`` as int32 and ``ranks``/``scales`` as int32/float32 on
    y's device, ``soff``, the slice offsets as an int32 tensor on that device (else one is built from
    ``slice_offsets`` per call: a host-to-device copy), and a ``workspace`` reserved for the largest batch
    beforehand. Then a call issues exactly one kernel launch, no allocation and no host sync. Every token index
    outside [0, L) must be -1 for the Triton path (it reads ``ranks[idx]``). The torch fallback
    (``decode_lora_torch``) is sync-free too and ignores out-of-range indices.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}")
    n_s = lora_a.shape[0]
    if len(slice_offsets) != n_s + 1 or slice_offsets[-1] != y.shape[1] or lora_b.shape[1] != y.shape[1]:
        raise ValueError("slice_offsets must have S+1 entries ending at y.shape[1] == lora_b.shape[1]")
    na, nb = (nblocks, 1) if layout == "row" else (1, nblocks)
    ok = (dispatch.triton_ok(y, x, lora_a, lora_b) and y.stride(1) == 1 and x.stride(1) == 1
          and lora_a.is_contiguous() and lora_b.is_contiguous())
    if dispatch.choose("decode_lora", backend, ok) == "torch":
        return decode_lora_torch(y, x, lora_a, lora_b, token_lora_indices, ranks, scales, slice_offsets, layout,
                                 nblocks)
    from ._triton import _decode_kernel

    t, d_in = x.shape
    if t == 0:
        return y
    n_l, r_max = lora_a.shape[1], lora_a.shape[2]
    max_block = max(slice_offsets[i + 1] - slice_offsets[i] for i in range(n_s)) // nb
    tiles = decode_tiles(x.device)
    grid = decode_grid(t, n_s, nb, max_block, d_in, r_max, tiles)
    if workspace is None:
        workspace = DecodeWorkspace(x.device).reserve(grid)
    elif not workspace.fits(grid) or workspace.counters.device != x.device:
        raise ValueError(f"decode_lora: the workspace on {workspace.counters.device} holds "
                         f"{workspace.partials.numel()} partials / {workspace.counters.numel()} counters, this call "
                         f"needs {grid.partials} / "
                         f"{grid.counters} on {x.device}: reserve it for the largest batch first")
    idx = token_lora_indices.to(device=x.device, dtype=torch.int32)
    if soff is None:
        soff = torch.tensor(list(slice_offsets), dtype=torch.int32, device=x.device)
    _decode_kernel[(t, grid.n_groups, grid.k_splits)](
        y, x, lora_a, lora_b, idx, ranks.to(device=x.device, dtype=torch.int32),
        scales.to(device=x.device, dtype=torch.float32), soff, workspace.partials, workspace.counters,
        y.stride(0), x.stride(0), d_in, y.shape[1], n_l, r_max, lora_a.shape[3], lora_b.shape[2], grid.n_chunks,
        grid.n_groups, tiles.k_split_len,
        NA=na, NB=nb, K_SPLITS=grid.k_splits, BLOCK_R=grid.block_r, BLOCK_K=tiles.block_k,
        BLOCK_N=tiles.block_n, num_warps=tiles.warps,
    )
    return y
