"""Building one BD layer's fast path: its stacked buffers (laid out for bdlora's kernels and for vLLM's punica path
alike), its fold, its cut-offs from the device's tuning, and its entry in the engine's registry."""

from __future__ import annotations

import logging
import math

import torch

from bdlora.spec import COLUMN

from .state import FoldPaths, LayerBuild, LayerState, SidePath

logger = logging.getLogger("bdlora.vllm_plugin")


def uses_bdlora_kernels(build: LayerBuild, dev) -> bool:
    """Whether the device's tuning sends any size to bdlora's kernels (not on CPU, where vLLM's path serves)."""
    t = build.tuning(dev)
    return ((t.fold and (max(t.fold_gemm_max, t.fold_gemv_max) > 0 or bool(t.gemv_one_token_shapes)))
            or t.two_launch_max > 0)


def fold_rows(n_slices: int, max_loras: int, rank: int) -> int:
    """The LoRA rows a layer's fold holds under its base weight: every slice's A rows of every slot."""
    return n_slices * max_loras * rank


def build_layer_state(layer, max_loras: int, rank: int, outs: tuple, dtype, dev, build: LayerBuild) -> None:
    """Gives ``layer`` its stacked buffers (``lora_a_stacked`` / ``lora_b_stacked``, views of the fast path's), its
    :class:`LayerState` (``layer._bd_fused``) and its op key (``layer.bd_op_key``, the custom ops' argument, a
    non-persistent buffer; None where the platform cannot update outputs in place, which keeps vLLM's path)."""
    n_s = layer.n_slices
    offsets = [0]
    for out in outs:
        offsets.append(offsets[-1] + out)
    d_in, d_out = layer.input_size, offsets[-1]
    tuning = build.tuning(dev)
    two_max, fd_max, fg_max, fold_min = tuning.two_launch_max, tuning.fold_decode_max, tuning.fold_gemm_max, 1
    lora_rows = fold_rows(n_s, max_loras, rank)
    # a wide fold (LoRA rows above fold_max_extra x d_out) still folds for its one-token tiles (one token reads only
    # its own slot's A rows) and for the tiled fold above two_launch_max (where the alternative is vLLM's punica
    # path); its other forwards run as an unfolded layer's
    one_tiles = tuning.gemv_one_token_tiles_for(d_in, d_out, tuple(offsets), max_loras, rank)
    wide = lora_rows > tuning.fold_max_extra * d_out and (one_tiles is not None or fg_max > two_max)
    side_max, side_defer = tuning.side_for(d_in, d_out)
    # a row layer's partial output is all-reduced before the next kernel reads it: it adds its term first
    side_defer = side_defer and (layer.bd_layout == COLUMN or layer.tp_size == 1)
    folded = (fold_base_weight(layer, build, max_loras, rank, d_out, dtype,
                               math.inf if wide else tuning.fold_max_extra) if tuning.fold else None)
    if folded is None:  # the paths below, the side stream included, are fold_linear's
        one_tiles, side_max, side_defer = None, 0, False
    elif wide:
        fd_max, fg_max = 0, (fg_max if fg_max > two_max else 0)
        fold_min = two_max + 1
        build.log_once(logging.INFO, ("fold-wide", type(layer).__name__),
                       "bdlora kernels: %s folds its %d LoRA rows (slices x --max-loras x per-GPU rank) next to its "
                       "%d output rows (above fold_max_extra %g) for one-token forwards%s; other forwards run the "
                       "base GEMM and the two-launch kernel or vLLM's path", type(layer).__name__, lora_rows, d_out,
                       tuning.fold_max_extra, f" and {fold_min}-{fg_max} tokens" if fg_max else "")
    if folded is not None:  # A under the base weight: (S, L, R, d_in) -> (S, L, 1, R, d_in)
        a_all = folded.lora_a(n_s, max_loras, rank).unsqueeze(2)
    else:
        a_all = torch.zeros(n_s, max_loras, 1, rank, d_in, dtype=dtype, device=dev)
    layer.lora_a_stacked = tuple(a_all[i] for i in range(n_s))  # each (L, 1, R, d_in), contiguous
    b_all = torch.zeros(max_loras, d_out, rank, dtype=dtype, device=dev)
    if n_s == 1:
        layer.lora_b_stacked = (b_all.unsqueeze(1),)
    else:  # vLLM's kernels need each slice's B contiguous: the fast path keeps its own (L, sum d_out, R) copy
        layer.lora_b_stacked = tuple(torch.zeros(max_loras, 1, out, rank, dtype=dtype, device=dev) for out in outs)
    key = build.register(layer, dev)
    # the per-tile-shrink rows skip layers whose slots x rank A rows would not pay or fit (gemv_local_max_rows)
    gemv_tiles = (tuning.gemv_tiles_for(d_in, d_out, tuple(offsets), max_loras, rank)
                  if folded is not None and not wide else None)
    gemv_ws = None
    for tokens, tiles in ((tuning.fold_gemv_max, gemv_tiles), (1, one_tiles)):
        if tiles is not None:
            gemv_ws = build.gemv_workspace(dev, dtype, folded, tokens, tiles)
    fold = None
    if folded is not None:
        fold = FoldPaths(weight=folded, decode_max=fd_max, gemm_max=fg_max, min_tokens=fold_min,
                         gemv_max=tuning.fold_gemv_max if gemv_tiles is not None else 0,
                         gemm_rows=tuning.gemm_rows(d_in, d_out, max_loras, rank), gemm_sorted=tuning.gemm_sorted,
                         gemv_tiles=gemv_tiles, gemv_one_token_tiles=one_tiles, gemv_workspace=gemv_ws)
    layer._bd_fused = LayerState(
        name=getattr(layer.base_layer, "prefix", "") or type(layer).__name__, two_launch_max=two_max,
        backend=build.options.backend, lora_a=a_all.squeeze(2), lora_b=b_all, b_shared=n_s == 1,
        offsets=tuple(offsets),
        soff=torch.tensor(offsets, dtype=torch.int32, device=dev),
        ranks=torch.zeros(max_loras, dtype=torch.int32, device=dev),
        scales=torch.ones(max_loras, dtype=torch.float32, device=dev), build=build,
        workspace=build.decode_workspace(dev, max(two_max, side_max), n_s, max(outs), d_in, rank),
        fold=fold, side=SidePath(side_max, side_defer, build.side_stream(dev) if side_max else None), pdl=tuning.pdl)
    if _can_update_inplace():
        layer.register_buffer("bd_op_key", key, persistent=False)
    else:  # pragma: no cover - CUDA and CPU update in place
        logger.warning("bdlora kernels: this platform does not update outputs in place; vLLM's LoRA path is kept")
    if getattr(layer, "_enable_aux_cuda_stream", False):  # pragma: no cover - GPU only
        logger.warning("bdlora kernels: VLLM_LORA_ENABLE_DUAL_STREAM=1 runs LoRA through vLLM's dual-stream path, "
                       "which bypasses bdlora's kernels")


def fold_base_weight(layer, build: LayerBuild, max_loras: int, rank: int, d_out: int, dtype, max_extra: float):
    """Moves the layer's base weight into [W; A] (``fold_weight``; ``base_layer.weight`` keeps its Parameter, now a
    view of the top rows) and returns it, or None, with the reason logged once, where the base layer cannot take it
    or the LoRA rows, slices x slots x rank, exceed ``max_extra`` x d_out: every forward's GEMM multiplies them, so
    many slots of a high rank make the fold slower than the two-launch path (``math.inf``: a wide fold)."""
    from bdlora.kernels import fold_weight

    w = getattr(layer.base_layer, "weight", None)
    method = type(getattr(layer.base_layer, "quant_method", None)).__name__
    extra_rows = fold_rows(layer.n_slices, max_loras, rank)
    if method != "UnquantizedLinearMethod":
        reason = f"its base layer is quantized ({method})"
    elif extra_rows > max_extra * d_out:
        reason = (f"its {extra_rows} LoRA rows (slices x --max-loras x per-GPU rank) exceed {max_extra:g} x its "
                  f"{d_out} output rows (fold_max_extra)")
    elif not isinstance(w, torch.Tensor) or tuple(w.shape) != (d_out, layer.input_size):
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else None
        reason = (f"its base weight {shape} is not the plain ({d_out}, {layer.input_size}) matrix (repacked by the "
                  "platform)")
    elif w.dtype != dtype:
        reason = f"its base weight is {w.dtype} and the LoRA buffers {dtype} (set --lora-dtype to the model's)"
    else:
        folded = fold_weight(w.data, layer.n_slices, max_loras, rank)
        w.data = folded.base
        return folded
    build.log_once(logging.WARNING, ("fold", reason), "bdlora kernels: %s keeps the shrink out of the base GEMM "
                   "(two-launch kernel, vLLM's path above it): %s", type(layer).__name__, reason)
    return None


def _can_update_inplace() -> bool:
    from vllm.platforms import current_platform

    return current_platform.can_update_inplace()
