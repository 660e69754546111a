"""The per-forward choice of a fast-path layer: which kernel computes its output (or LoRA term) for T tokens.

Each function takes the layer (a BD layer built with a :class:`.state.LayerState`, ``layer._bd_fused``) and runs
inside one of the custom ops of :mod:`.ops`, so the choice is made when the op runs: per captured CUDA-graph size.
Every call counts the path it took in the build's ``path_counts``: ``fused:<backend>`` (the two-launch kernel),
``folded:<backend>`` ([W; A] GEMM and the per-token kernel), ``fold_gemm:<backend>`` (its tiled kernel;
``fold_gemm_sorted:<backend>`` on the tokens grouped by slot), ``fold_gemv:<backend>`` /
``fold_gemv_one_token:<backend>`` (the one-launch kernel), ``side:<backend>`` / ``side_deferred:<backend>`` (the
two-launch term on a second stream beside the base GEMM; deferred: the add left to the compiled graph) and ``stock``
(vLLM's punica path). Counted on the host, so under CUDA graphs only eager runs and captures count."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from bdlora.kernels import decode_lora, decode_lora_folded

#: path_counts prefix per folded kernel ("gemv_one_token": the one-launch kernel with a layer's one-token tiles)
FOLD_COUNTER = {"gemv": "fold_gemv:", "gemv_one_token": "fold_gemv_one_token:", "decode": "folded:",
                "gemm": "fold_gemm:", "gemm_sorted": "fold_gemm_sorted:"}


def _count(st, kind: str, backend: str, x: torch.Tensor) -> None:
    st.build.path_counts[kind + backend] += 1
    if backend == "torch" and x.is_cuda and st.backend == "auto":
        st.build.log_once(logging.WARNING, "torch-on-gpu", "bdlora kernels run the torch fallback on GPU (x %s, LoRA buffers %s, "
                          "or no Triton): correct but slow", x.dtype, st.lora_a.dtype)


def two_launch_term(st, y: torch.Tensor, x: torch.Tensor):
    """y += the layer's LoRA term for x by ``decode_lora`` (two launches), in place; the kernels' ``LoraResult``."""
    return decode_lora(y, x, st.lora_a, st.lora_b, st.slots.buf[:x.shape[0]], st.ranks, st.scales, st.offsets,
                       layout="column", nblocks=1, options=st.options, soff=st.soff, workspace=st.workspace,
                       pdl=st.pdl)


def stock_lora(layer, y: torch.Tensor, x: torch.Tensor) -> None:
    """vLLM's punica path above the cut-offs: y += the layer's LoRA term, in place."""
    layer.punica_wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0,
                                         layer.output_slices)
    layer._bd_fused.build.path_counts["stock"] += 1


def add_lora_term(layer, y: torch.Tensor, x: torch.Tensor) -> None:
    """y += the LoRA term of a layer that does not fold (or a fold layer above its cut-offs) for x, in place: the
    two-launch kernel up to ``two_launch_max`` tokens, vLLM's punica path above."""
    st = layer._bd_fused
    n = x.shape[0]
    if n <= st.two_launch_max and st.slots is not None:
        if n:
            _count(st, "fused:", two_launch_term(st, y, x).backend, x)
        return
    stock_lora(layer, y, x)


def two_streams(st, dev, side_work, main_work) -> tuple:
    """(side_work(), main_work()): side_work issued on the build's second stream once the current stream's work so
    far is done (x ready; memory the allocator just gave out free there), main_work on the current stream meanwhile,
    which then waits for the second (an event, no host sync; CUDA graphs capture both branches). Buffers allocated
    on the current stream before the fork are freed after that wait, so no other work reuses them early. Off CUDA
    both run on the one stream, side_work first."""
    main = torch.cuda.current_stream(dev) if st.side.stream is not None else None
    if main is None:
        return side_work(), main_work()
    st.side.stream.wait_stream(main)
    with torch.cuda.stream(st.side.stream):
        side = side_work()
    out = main_work()
    main.wait_stream(st.side.stream)
    return side, out


def side_parts(layer, x: torch.Tensor, bias: Optional[torch.Tensor], counter: str) -> tuple:
    """(base output, LoRA term) of a fold layer for x, apart: the base GEMM (on W's view) on the current stream while
    the side stream zeroes a buffer and adds the two-launch kernel's term to it (``two_streams``)."""
    st = layer._bd_fused
    term = torch.empty(x.shape[0], st.offsets[-1], dtype=x.dtype, device=x.device)

    def lora_term():
        term.zero_()
        return two_launch_term(st, term, x)

    ran, y = two_streams(st, x.device, lora_term, lambda: layer._get_quant_method().apply(layer.base_layer, x, bias))
    _count(st, counter, ran.backend, x)
    return y, term


def folded_output(layer, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """A fold layer's output for x (``fold_linear``): 2 <= T <= side_max the term on a second stream beside the base
    GEMM, then one add (``side_parts``), else ``fold_paths``."""
    st = layer._bd_fused
    if 2 <= x.shape[0] <= st.side.max_tokens and st.slots is not None:
        y, term = side_parts(layer, x, bias, "side:")
        y += term
        return y
    return fold_paths(layer, x, bias)


def split_output(layer, x: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple:
    """(y, term), term one row wide (1, d_out), with y + term (broadcast) the fold layer's output (``side_defer``,
    ``fold_linear_split``), for the caller to add in traced code, where torch.compile fuses the add into the next
    kernel. One token (side_max >= 1): base output and the term from the second stream (``side_parts``); more:
    ``folded_output`` and a zero row, zeroed on the second stream meanwhile."""
    st = layer._bd_fused
    if x.shape[0] == 1 and st.side.max_tokens >= 1 and st.slots is not None:
        return side_parts(layer, x, bias, "side_deferred:")
    zero = torch.empty(1, st.offsets[-1], dtype=x.dtype, device=x.device)
    zero, y = two_streams(st, x.device, zero.zero_, lambda: folded_output(layer, x, bias))
    return y, zero


def fold_paths(layer, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """A fold layer's output for x outside the side-stream path, by the token count T: T == 1 with one-token tiles
    or T <= gemv_max the one-launch kernel, T <= decode_max the per-token kernel, T <= gemm_max the tiled one (both
    after one GEMM with [W; A]), above the base GEMM on W's view and ``add_lora_term`` (:class:`.state.FoldPaths`)."""
    st = layer._bd_fused
    fold = st.fold
    n = x.shape[0]
    one_token = n == 1 and fold.gemv_one_token_tiles is not None
    if (one_token or (fold.max_tokens > 0 and fold.min_tokens <= n <= fold.max_tokens)) and st.slots is not None:
        if one_token or n <= fold.gemv_max:
            kernel = "gemv_one_token" if one_token else "gemv"
            y, ran = decode_lora_folded(x, fold.weight, st.lora_b, st.slots.buf[:n], st.ranks, st.scales, st.offsets,
                                        options=st.options, kernel="gemv",
                                        gemv_tiles=fold.gemv_one_token_tiles if one_token else fold.gemv_tiles,
                                        workspace=fold.gemv_workspace, pdl=st.pdl)
        else:
            kernel = "decode" if n <= fold.decode_max else "gemm"
            if kernel == "gemm":
                st.warm_gemm_rows(x)
            plan = st.plan(kernel, fold.gemm_rows.tiles_for(n) if kernel == "gemm" and fold.gemm_rows is not None
                           else None)
            y, ran = plan(x), plan.dispatch
            if plan.sorted:
                kernel = "gemm_sorted"
        if bias is not None:
            y += bias
        _count(st, FOLD_COUNTER[kernel], ran.backend, x)
        return y
    y = layer._get_quant_method().apply(layer.base_layer, x, bias)
    add_lora_term(layer, y, x)
    return y
