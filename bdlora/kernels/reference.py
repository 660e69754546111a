"""Pure-torch references (autograd-native): the shared primitives (``bd_matmul``, ``lora_delta_ref``) and the
references of the training ops, which are also their "torch" backend (``grouped_lora``, ``fused_lora_linear``).
The decode ops' references sit here too (``decode_lora_ref``, ``decode_lora_torch``, ...), beside the ones above.

They compute block-diagonal factors block by block (einsum over packed blocks), like PEFT's BlockDiagonalLinear, so
the torch backend does no FLOPs on zeros either. The LoRA products run in the factors' dtype (x is cast where it
differs: fp32 factors beside a bf16 base), the result comes back in x's dtype.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from bdlora.layout import LoraFactors

from .dropout import segment_keep_mask


def bd_matmul(x: torch.Tensor, w: torch.Tensor, nblocks: int) -> torch.Tensor:
    """x (T, K) @ blockdiag(w)^T with w packed (M, K/nb): out[:, m_j] = x[:, k_j] @ w[m_j].T."""
    if nblocks == 1:
        return x @ w.t()
    t, k = x.shape
    m = w.shape[0]
    out = torch.einsum("tnk,nmk->tnm", x.reshape(t, nblocks, k // nblocks), w.reshape(nblocks, m // nblocks, -1))
    return out.reshape(t, m)


def torch_keep_masks(x: torch.Tensor, seg: Sequence[int], adapters: Sequence[LoraFactors],
                     seed: int | None) -> list[torch.Tensor | None] | None:
    """Per adapter the (T, d_in) keep-mask of the torch backends (``segment_keep_mask`` on its rows, False outside
    them), None for dropout 0; None when dropout is off (seed None)."""
    if seed is None:
        return None
    masks = []
    for i, ad in enumerate(adapters):
        if ad is None or ad.dropout <= 0:
            masks.append(None)
            continue
        keep = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        keep[seg[i]:seg[i + 1]] = segment_keep_mask(seed, i, seg[i + 1] - seg[i], x.shape[1], ad.dropout, x.device)
        masks.append(keep)
    return masks


def lora_delta_ref(x: torch.Tensor, adapter: LoraFactors, keep: torch.Tensor | None = None) -> torch.Tensor:
    """scale * dropout(x) @ A @ B for one adapter, with dropout(x) = keep * x / (1 - p) where ``keep`` is the (T, d_in)
    keep-mask (None: no dropout); in x's dtype (the factors' must match)."""
    if keep is not None and adapter.dropout > 0:
        x = x * keep.to(x.dtype) / (1.0 - adapter.dropout)
    s = bd_matmul(x, adapter.lora_A, adapter.blocks_a) * adapter.scale
    return bd_matmul(s, adapter.lora_B, adapter.blocks_b)


def grouped_lora_ref(x: torch.Tensor, seg: Sequence[int], adapters: Sequence[LoraFactors | None],
                     keep_masks: Sequence[torch.Tensor | None] | None = None, *,
                     bernoulli: bool = False) -> torch.Tensor:
    """y[seg[i]:seg[i+1]] = scale[i] * dropout_i(x[seg[i]:seg[i+1]]) @ A[i] @ B[i]; rows outside all segments, and the
    rows of a segment whose adapter is None, get 0. The torch backend of ``grouped_lora``.

    Dropout: keep_masks[i] is a (T, d_in) keep-mask for adapter i (only its segment's rows are used), or None; with
    ``bernoulli`` instead ``F.dropout(x_i, p_i)`` from torch's RNG on each dropping adapter's rows in segment order
    (PEFT's own draw; ``KernelOptions.torch_dropout="bernoulli"``). The products run in the factors' dtype (x cast),
    the result is in x's dtype.
    """
    t = x.shape[0]
    live = [ad for ad in adapters if ad is not None]
    d_out = live[0].d_out if live else 0
    pieces = [x.new_zeros(seg[0], d_out)]
    for i, ad in enumerate(adapters):
        s, e = seg[i], seg[i + 1]
        if ad is None:
            pieces.append(x.new_zeros(e - s, d_out))
            continue
        xi = x[s:e].to(ad.lora_A.dtype)
        keep = None
        if bernoulli:
            if ad.dropout > 0:
                xi = F.dropout(xi, ad.dropout, training=True)
        elif keep_masks is not None and keep_masks[i] is not None:
            keep = keep_masks[i][s:e]
        pieces.append(lora_delta_ref(xi, ad, keep).to(x.dtype))
    pieces.append(x.new_zeros(t - seg[-1], d_out))
    return torch.cat(pieces, dim=0)


def fused_lora_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seg: Sequence[int],
                          adapters: Sequence[LoraFactors | None],
                          keep_masks: Sequence[torch.Tensor | None] | None = None, *,
                          bernoulli: bool = False) -> torch.Tensor:
    """y = x @ weight^T + bias + grouped_lora_ref(x, seg, adapters, keep_masks, bernoulli=bernoulli): the torch
    backend of ``fused_lora_linear``."""
    return F.linear(x, weight, bias) + grouped_lora_ref(x, seg, adapters, keep_masks, bernoulli=bernoulli)


def decode_lora_ref(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    token_lora_indices: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                    slice_offsets: Sequence[int], layout: str = "column", nblocks: int = 1) -> torch.Tensor:
    """In place, per token t with a = idx[t] >= 0 and per slice s (columns soff[s]:soff[s+1] of y):

    y[t, soff[s]:soff[s+1]] += scales[a] * x[t] @ A[s, a] @ B[s, a]

    (slots of rank 0 add nothing) with A[s, a] = lora_a[s, a, :r_a] (packed (r, d_in/N_a)) and B[s, a] = lora_b[a, soff[s]:soff[s+1], :r_a/N_b].
    """
    idx = token_lora_indices.tolist()
    rk = [int(v) for v in ranks.tolist()]
    for t, a in enumerate(idx):
        r = rk[a] if a >= 0 else 0
        if r == 0:
            continue
        for sl in range(len(slice_offsets) - 1):
            lo, hi = slice_offsets[sl], slice_offsets[sl + 1]
            rb = r // nblocks if layout == "column" else r
            ad = LoraFactors(lora_a[sl, a, :r], lora_b[a, lo:hi, :rb], layout, nblocks, float(scales[a]))
            y[t, lo:hi] += lora_delta_ref(x[t:t + 1], ad)[0].to(y.dtype)
    return y


def _slot_weights(token_lora_indices: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor, n_l: int, r_max: int,
                  dev: torch.device):
    """Sync-free slot selection of the decode ops: onehot (T, L) float, each token's slot (an all-zero row for -1 or
    an out-of-range index); rk (L,) long ranks; row_w (L, R) float, the rank rows in use times the slot's scale
    (an empty slot, rank 0: all zero)."""
    idx = token_lora_indices.to(device=dev, dtype=torch.long)
    onehot = (idx[:, None] == torch.arange(n_l, device=dev)[None, :]).float()
    rk = ranks.to(device=dev, dtype=torch.long)
    rr = torch.arange(r_max, device=dev)
    row_w = (rr[None, :] < rk[:, None]).float() * scales.to(device=dev, dtype=torch.float32)[:, None]
    return onehot, rk, row_w


def decode_lora_torch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      token_lora_indices: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                      slice_offsets: Sequence[int], layout: str = "column", nblocks: int = 1) -> torch.Tensor:
    """``decode_lora_ref``'s semantics with tensor ops only: no host sync (no ``.tolist()``/``.item()``), no
    data-dependent shapes, so it can run inside CUDA-graph capture; ``decode_lora``'s torch fallback.

    Every slot is computed for every token (shrink (T, S, L, R), expand (T, L, d_s) per slice) and each token keeps
    its own slot's row through a one-hot mask: L times the FLOPs of a per-token gather, but no per-token copy of the
    (large) factors. Indices outside [0, L) (-1, or stale padding) add nothing. Returns y (updated in place).
    """
    t = x.shape[0]
    if t == 0:
        return y
    n_s, n_l, r_max, ka = lora_a.shape
    rb_max = lora_b.shape[2]
    na, nb = (nblocks, 1) if layout == "row" else (1, nblocks)
    dev = x.device
    onehot, rk, row_w = _slot_weights(token_lora_indices, ranks, scales, n_l, r_max, dev)
    rr = torch.arange(r_max, device=dev)
    xf, af = x.float(), lora_a.float()
    if na == 1:
        s_all = torch.einsum("tk,slrk->tslr", xf, af)
    else:  # row layout: rank row i of slot l reads input block i // (r_l / N)
        blk = (rr[None, :] // (rk // na).clamp(min=1)[:, None]).clamp(max=na - 1)  # (L, R)
        part = torch.einsum("tnk,slrk->tslrn", xf.reshape(t, na, ka), af)  # (T, S, L, R, N)
        s_all = part.gather(4, blk[None, None, :, :, None].expand(t, n_s, n_l, r_max, 1)).squeeze(4)
    s = torch.einsum("tl,tslr->tsr", onehot, s_all * row_w)  # (T, S, R): each token's own slot
    bf = lora_b.float()
    r_tok = (onehot @ rk.float()).long()  # (T,) rank of each token's slot (0 without LoRA)
    for sl in range(n_s):
        lo, hi = int(slice_offsets[sl]), int(slice_offsets[sl + 1])
        d_s = hi - lo
        if nb == 1:
            upd_all = torch.einsum("tr,ldr->tld", s[:, sl, :rb_max], bf[:, lo:hi])
        else:  # column layout: output block j of the slice reads rank block j (ranks j*r/N .. (j+1)*r/N)
            rb_tok = r_tok // nb
            kk = torch.arange(rb_max, device=dev)
            kmask = kk[None, None, :] < rb_tok[:, None, None]  # (T, 1, RB)
            ridx = torch.arange(nb, device=dev)[None, :, None] * rb_tok[:, None, None] + kk[None, None, :]
            ridx = torch.where(kmask, ridx, torch.zeros_like(ridx)).clamp(max=r_max - 1)  # (T, N, RB)
            sg = s[:, sl].gather(1, ridx.reshape(t, -1)).reshape(t, nb, rb_max) * kmask
            upd_all = torch.einsum("tnr,lnmr->tlnm", sg, bf[:, lo:hi].reshape(n_l, nb, d_s // nb, rb_max))
            upd_all = upd_all.reshape(t, n_l, d_s)
        y[:, lo:hi] += torch.einsum("tl,tld->td", onehot, upd_all).to(y.dtype)
    return y


def decode_lora_folded_ref(x: torch.Tensor, w_ext: torch.Tensor, d_out: int, lora_b: torch.Tensor,
                           token_lora_indices: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                           slice_offsets: Sequence[int]) -> torch.Tensor:
    """``decode_lora_folded`` unfolded: y = x @ W^T, then ``decode_lora_ref`` with W = w_ext[:d_out] and the LoRA A
    factors A[s, a] = w_ext[d_out:] viewed (S, L, R, d_in)."""
    n_l, _, r = lora_b.shape
    lora_a = w_ext[d_out:].reshape(len(slice_offsets) - 1, n_l, r, w_ext.shape[1])
    y = F.linear(x, w_ext[:d_out])
    return decode_lora_ref(y, x, lora_a, lora_b, token_lora_indices, ranks, scales, slice_offsets)


def decode_lora_folded_torch(h: torch.Tensor, d_out: int, lora_b: torch.Tensor, token_lora_indices: torch.Tensor,
                             ranks: torch.Tensor, scales: torch.Tensor, slice_offsets: Sequence[int]) -> torch.Tensor:
    """``decode_lora_folded``'s step after the base GEMM with tensor ops only (sync-free; its torch fallback): from
    h = x @ [W; A]^T (T, d_out + S * L * R) returns a new y (T, d_out) = h[:, :d_out] plus, per token with slot
    a >= 0 and per slice s, scales[a] * h[:, d_out:][s, a, :ranks[a]] @ B[a, slice columns, :ranks[a]]^T."""
    t = h.shape[0]
    n_l, _, r = lora_b.shape
    n_s = len(slice_offsets) - 1
    onehot, _, row_w = _slot_weights(token_lora_indices, ranks, scales, n_l, r, h.device)
    s = torch.einsum("tl,tslr->tsr", onehot, h[:, d_out:].float().reshape(t, n_s, n_l, r) * row_w)
    y = h[:, :d_out].to(torch.float32, copy=True)
    bf = lora_b.float()
    for sl in range(n_s):
        lo, hi = int(slice_offsets[sl]), int(slice_offsets[sl + 1])
        upd_all = torch.einsum("tr,ldr->tld", s[:, sl], bf[:, lo:hi])
        y[:, lo:hi] += torch.einsum("tl,tld->td", onehot, upd_all)
    return y.to(h.dtype)
