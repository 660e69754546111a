"""Attention while training, shared by `bdlora train` and `bdlora sweep`: which kernels torch's sdpa may pick, and
packed rows attended sequence by sequence.

Packed rows (several examples per row, each one's positions restarting at 0) go through transformers' sdpa as a
block-causal mask over the whole row: transformers finds the examples from the position ids with a host-side check
(a stream sync in every forward), sdpa takes its memory-efficient kernel (flash attention takes no mask) and that
kernel works through the whole row (L^2 per row) where the examples need only the sum of their squared lengths.
:func:`packed_attention` swaps that for torch's variable-length flash attention over the examples
(``torch.nn.attention.varlen``), reading the example boundaries from the batch (:func:`packed_sequence_kwargs`, the
keyword arguments transformers' own flash-attention path reads), so no mask is built and nothing syncs."""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from typing import Optional

import torch

#: the transformers attention implementation name :func:`packed_attention` registers
PACKED_ATTENTION = "bdlora_packed_sdpa"


def sdpa_backends(cudnn_attention: bool):
    """A context in which sdpa picks among flash, memory-efficient and math attention, leaving cuDNN's out unless
    ``cudnn_attention``: cuDNN builds an execution plan per new input shape, and batches of varying length keep
    bringing new shapes, whose host time costs more than cuDNN's kernels save (TrainConfig.cudnn_attention)."""
    if cudnn_attention:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def packed_sequence_kwargs(position_ids: torch.Tensor) -> dict:
    """The keyword arguments of a packed batch's forward that tell attention where its examples are, from the batch's
    position ids on the host (every row starts an example at position 0, each example's positions restart at 0,
    a row's padding tail is an example of its own): cumulative example lengths over the flattened (rows x L) tokens
    and the longest example, under the names transformers' flash-attention path reads (``FlashAttentionKwargs``)."""
    if position_ids.device.type != "cpu":
        raise ValueError("packed_sequence_kwargs reads position ids on the host (a device tensor would sync)")
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed rows must start an example at position 0")
    cu = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


@functools.lru_cache(maxsize=None)
def _varlen_api() -> Optional[tuple]:
    """torch's ``varlen_attn`` and which of its keywords this torch has (its signature changed between releases:
    causality as ``is_causal`` or as ``window_size``; ``scale`` and ``enable_gqa`` arrived later), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params and "is_causal" not in params:
        return None
    return varlen_attn, frozenset(params)


def packed_attention_supported(device) -> bool:
    """Whether :func:`packed_attention` runs torch's variable-length flash attention on ``device``: a CUDA device, a
    torch that has it, and a first call there (forward and backward on two ragged examples with grouped heads) that
    agrees with sdpa. The interface is a prototype whose signature has changed between torch releases: where it does
    not work as expected, training keeps transformers' sdpa."""
    device = torch.device(device)
    if device.type != "cuda" or _varlen_api() is None:
        return False
    return _varlen_works(device.index if device.index is not None else torch.cuda.current_device())


def packed_attention_fits(model) -> bool:
    """Whether every attention layer of ``model`` (transformers, or PEFT around it) is one the flash route runs:
    activations in bf16 / fp16, causal, head size <= 256, no sliding window (or other per-layer kind) or logit
    soft-capping.
    Elsewhere the packed attention function takes its reference route, a dense mask over the whole (one-row)
    batch: right, but slower and larger than transformers' own mask over capped rows."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // text.num_attention_heads)
    windowed = (getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True)
                or any(t != "full_attention" for t in (getattr(text, "layer_types", None) or [])))
    return (base.dtype in (torch.float16, torch.bfloat16) and head_dim <= 256 and not windowed
            and getattr(text, "attn_logit_softcapping", None) is None
            and not getattr(text, "is_encoder_decoder", False))


@functools.lru_cache(maxsize=None)
def _varlen_works(device_index: int) -> bool:
    dev = torch.device("cuda", device_index)
    try:
        with torch.enable_grad():  # the check's backward, whatever context asks for it
            return _check_varlen(dev)
    except Exception:  # noqa: BLE001 - any failure of the prototype API means: not this route
        return False


def _check_varlen(dev: torch.device) -> bool:
    """Forward and backward of two ragged examples with grouped heads; the forward against sdpa."""
    g = torch.Generator(device=dev).manual_seed(0)
    cu = torch.tensor([0, 5, 24], dtype=torch.int32, device=dev)
    q, k, v = (torch.randn(24, h, 64, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_(True)
               for h in (4, 2, 2))
    out = varlen_causal(_varlen_api(), q, k, v, cu, 19, None)
    out.float().sum().backward()
    want = torch.cat([_causal_sdpa_one_example(q[a:b], k[a:b], v[a:b]) for a, b in ((0, 5), (5, 24))])
    return bool(torch.allclose(out.float(), want, rtol=3e-2, atol=3e-2)) and q.grad is not None


def _causal_sdpa_one_example(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 causal sdpa of one example, (T, heads, D) in and out, key / value heads repeated to the query's."""
    rep = q.shape[1] // k.shape[1]
    qs, ks, vs = (t.detach().float().transpose(0, 1) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qs, ks.repeat_interleave(rep, 0),
                                                           vs.repeat_interleave(rep, 0), is_causal=True)
    return out.transpose(0, 1)


def _segment_ids(cu: Optional[torch.Tensor], position_ids: Optional[torch.Tensor], rows: int, length: int,
                 device) -> Optional[torch.Tensor]:
    """(rows, L) example index of every token, from the cumulative lengths or else the position ids, on the device
    without a sync."""
    if cu is not None:
        tokens = torch.arange(rows * length, device=device)
        return torch.searchsorted(cu.to(device, torch.long)[1:], tokens, right=True).view(rows, length)
    if position_ids is not None:
        return torch.cumsum((position_ids.expand(rows, length) == 0).reshape(-1), 0).view(rows, length)
    return None


def _is_causal(module, kwargs) -> bool:
    causal = kwargs.get("is_causal")
    return getattr(module, "is_causal", True) if causal is None else bool(causal)


def _block_causal_sdpa(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """The reference route (and the one for what flash attention cannot run: a CPU, fp32, head sizes over 256,
    attention dropout, sliding windows): transformers' sdpa under the block-causal mask of the examples."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, length = query.shape[0], query.shape[2]
    seg = _segment_ids(kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"), rows, length, query.device)
    if seg is not None and attention_mask is None:
        attention_mask = seg[:, :, None] == seg[:, None, :]
        if _is_causal(module, kwargs):
            attention_mask = attention_mask.logical_and(
                torch.ones(length, length, dtype=torch.bool, device=query.device).tril())
        attention_mask = attention_mask[:, None]
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def packed_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                        scaling: Optional[float] = None, **kwargs):
    """A transformers attention function (``AttentionInterface``) for packed causal batches: query (rows, heads, L,
    head_dim) and key / value (rows, kv_heads, L, head_dim) flattened to the examples the batch's
    ``cu_seq_lens_q`` delimits and run through torch's variable-length flash attention; returns (rows, L, heads,
    head_dim) as transformers' sdpa does. Without a GPU route it is sdpa under the examples' block-causal mask."""
    api = _varlen_api()
    cu = kwargs.get("cu_seq_lens_q")
    rows, heads, length, dim = query.shape
    flash_ok = (api is not None and cu is not None and query.is_cuda
                and query.dtype in (torch.float16, torch.bfloat16) and _is_causal(module, kwargs) and not dropout
                and dim <= 256 and key.shape[-1] == dim and value.shape[-1] == dim
                and kwargs.get("sliding_window") is None and getattr(module, "sliding_window", None) is None
                and kwargs.get("softcap") is None and kwargs.get("s_aux") is None)
    if not flash_ok:
        return _block_causal_sdpa(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    q = query.transpose(1, 2).reshape(rows * length, heads, dim)
    k = key.transpose(1, 2).reshape(rows * length, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(rows * length, value.shape[1], dim)
    cu = cu.to(query.device, torch.int32, non_blocking=True)
    out = varlen_causal(api, q, k, v, cu, int(kwargs.get("max_length_q") or length), scaling)
    return out.view(rows, length, heads, dim), None


def varlen_causal(api: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
                  scaling: Optional[float]) -> torch.Tensor:
    """Causal attention of the examples ``cu`` delimits through ``api`` = (varlen_attn, its keyword names), q (T,
    heads, D), k / v (T, kv_heads, D), whichever keywords this torch's varlen_attn has: grouped key / value heads
    natively or repeated, the scale as a keyword or folded into q, causality as a window or a flag."""
    varlen_attn, params = api
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    opts = {}
    if kv_heads != heads:
        if "enable_gqa" in params:
            opts["enable_gqa"] = True
        else:  # each key / value head repeated for its group of query heads
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
    if scaling is not None and scaling != dim ** -0.5:
        if "scale" in params:
            opts["scale"] = scaling
        else:
            q = q * (scaling * dim ** 0.5)
    if "window_size" in params:
        opts["window_size"] = (-1, 0)
    else:
        opts["is_causal"] = True
    return varlen_attn(q, k, v, cu, cu, longest, longest, **opts)


@contextlib.contextmanager
def packed_attention(model, enabled: bool = True):
    """A context in which ``model`` (transformers, or PEFT around it) attends with :func:`packed_sdpa_forward`; its
    attention implementation is restored after. Every forward inside must be a causal batch whose examples are
    packed or right-padded: the implementation builds no padding mask, and takes the example boundaries from
    :func:`packed_sequence_kwargs` (or, without them, from the position ids)."""
    if not enabled:
        yield
        return
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_forward)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    before = base.config._attn_implementation
    try:
        base.set_attn_implementation(PACKED_ATTENTION)
    except (AttributeError, ValueError) as e:  # a transformers without the switch, or a model refusing it
        warnings.warn(f"packed attention not used ({type(e).__name__}: {e}); the model keeps {before}",
                      stacklevel=3)
        yield
        return
    try:
        yield
    finally:
        base.set_attn_implementation(before)


__all__ = ["PACKED_ATTENTION", "packed_attention", "packed_attention_fits", "packed_attention_supported",
           "packed_sdpa_forward", "packed_sequence_kwargs", "sdpa_backends", "varlen_causal"]
