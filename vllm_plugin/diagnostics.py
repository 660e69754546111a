"""Diagnostics of a running BD-mode engine, run inside vLLM workers through ``LLM.collective_rpc`` (each takes the
worker as its first argument; with worker processes set ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` so callables can be
sent). They answer an operator's questions on a live deployment -- does any LoRA collective run, which LoRA path ran,
what does one adapter cost per rank, do the fused kernels agree with vLLM's -- and the test suite and
``bench/serve/gpu_parity.py`` use them for the same questions (docs/serving.md, "Diagnostics").

* :func:`install_collective_counters` wraps the module-level collectives the LoRA layers call
  (``tensor_model_parallel_all_gather`` in ``column_parallel_linear``, ``tensor_model_parallel_all_reduce`` in
  ``row_parallel_linear``, and both in vLLM's MoE LoRA op, which runs them for ``--fully-sharded-loras``) and
  counts calls by caller: ``forward`` is the base model's own collective, anything else
  (``_mcp_apply``, ``apply``) is a LoRA collective. Run the engine with ``enforce_eager=True`` so calls are not
  traced away by torch.compile.
* :func:`lora_memory` reports the bytes one adapter occupies on a rank.
* :func:`read_path_counts` / :func:`reset_path_counts`: calls of the fast path's custom ops by the path that ran
  (:mod:`bdlora.vllm_plugin.fast_path.ladder`); :func:`fused_decode_self_check` compares, on every BD layer of a
  worker, the fast path's ops with vLLM's punica path for one token -> adapter mapping.
* :func:`read_logits_lora`: whether the logits ran the lm_head LoRA term (only while an adapter has lm_head factors).
"""

from __future__ import annotations

import sys
from collections import Counter

#: Collective calls by (base | lora, op): the wrapped collectives are module-level functions of vLLM, so what they
#: count is per process (one engine's worker per process).
COUNTS: Counter = Counter()

_TARGETS = (  # vllm_api touch points
    ("column_parallel_linear.tensor_model_parallel_all_gather", "all_gather"),
    ("row_parallel_linear.tensor_model_parallel_all_reduce", "all_reduce"),
    ("fused_moe_lora_op.tensor_model_parallel_all_gather", "all_gather"),  # called by _fused_moe_lora: a LoRA one
    ("fused_moe_lora_op.tensor_model_parallel_all_reduce", "all_reduce"),
)
#: Marker of the counting wrappers (not the plugin's own patches).
COUNTER_MARKER = "__bdlora_counter__"


def _counting(fn, op):
    def wrapper(*args, **kwargs):
        import torch

        if torch.compiler.is_compiling():  # graph mode: Dynamo cannot trace sys._getframe; count only eager calls
            return fn(*args, **kwargs)
        caller = sys._getframe(1).f_code.co_name
        COUNTS[("base" if caller == "forward" else "lora", op)] += 1
        return fn(*args, **kwargs)

    return wrapper


def install_collective_counters(worker=None) -> bool:
    from . import vllm_api as api

    for key, op in _TARGETS:
        try:
            api.wrap(key, lambda fn, op=op: _counting(fn, op), marker=COUNTER_MARKER)
        except api.TouchPointMissing:
            if not api.touch_point(key).optional:
                raise
    COUNTS.clear()
    return True


def reset_collective_counters(worker=None) -> bool:
    COUNTS.clear()
    return True


def read_collective_counters(worker=None) -> dict:
    return {f"{kind}:{op}": n for (kind, op), n in COUNTS.items()}


def lora_collectives(counts_per_rank) -> int:
    """The LoRA collectives in :func:`read_collective_counters`' replies of every rank (0 in BD mode)."""
    return sum(n for counts in counts_per_rank for key, n in counts.items() if key.startswith("lora:"))


def _builds(worker) -> list:
    """The fast-path builds (:class:`bdlora.vllm_plugin.fast_path.state.LayerBuild`) of a worker's BD layers."""
    builds = []
    for layer in _adapter_manager(worker).modules.values():
        build = getattr(layer, "_bd_build", None)
        if build is not None and all(b is not build for b in builds):
            builds.append(build)
    return builds


def reset_path_counts(worker) -> bool:
    for build in _builds(worker):
        build.path_counts.clear()
    return True


def read_path_counts(worker) -> dict:
    """Calls of the fast path's custom ops on this worker since the last reset, by path: ``fused:<backend>``
    (two-launch kernel), ``folded:`` / ``fold_gemm:`` / ``fold_gemm_sorted:`` / ``fold_gemv:`` /
    ``fold_gemv_one_token:`` (the folded kernels), ``side:`` / ``side_deferred:`` (the side stream) and ``stock``
    (vLLM's punica path above the cut-offs); see :mod:`bdlora.vllm_plugin.fast_path.ladder`."""
    counts: Counter = Counter()
    for build in _builds(worker):
        counts.update(build.path_counts)
    return dict(counts)


def fused_decode_self_check(worker, lora_ids=None, pad: int = 3, seed: int = 0) -> dict:
    """Sets the token -> adapter mapping ``lora_ids`` (LoRA int ids, 0 = base; default: base and every adapter in a
    slot, twice) through the LoRA manager, then for every BD layer on the fast path feeds random inputs to vLLM's
    punica ``add_lora_linear`` (len(lora_ids) tokens) and to ``torch.ops.bdlora.lora_linear`` (the same tokens plus
    ``pad`` padding rows, as a CUDA graph of a larger size would) and returns the largest differences, whether the
    padding rows stayed untouched and whether the int32 slot map matches the mapping (-1 after it). Fold layers
    also run ``torch.ops.bdlora.fold_linear`` on the same rows, checked against the base GEMM plus punica's
    result (``fold_max_abs_diff``; its padding rows must be the base output alone) and count the prepared launches
    the layers keep (``kept_plans``: plans made for earlier batches, bound to the slot map, read this mapping;
    ``sorted_plans``: those of the tiled kernel on the tokens grouped by slot, ``gemm_sorted``), and
    how many take the one-launch kernel (``gemv_layers``; ``gemv_local_shrink_layers``: with the shrink per output
    tile; ``gemv_one_token_layers``: with one-token tiles, whose fold_linear on the first row alone is checked too;
    ``fold_one_token_only_layers``: layers folded for those tiles only, whose larger forwards run as unfolded;
    ``fold_wide_layers``: folds whose LoRA rows exceed ``fold_max_extra``, those included;
    ``side_deferred_layers``: layers whose output is fold_linear_split's two parts, added by the caller)."""
    import torch
    from vllm.lora.layers import LoRAMapping

    from . import vllm_api as api

    set_forward_context = api.resolve("forward_context.set_forward_context")
    mgr = _adapter_manager(worker)
    slots = list(mgr.lora_index_to_id)
    if lora_ids is None:
        active = [i for i in slots if i]
        lora_ids = ([0] + active) * 2
    want = [slots.index(i) if i else -1 for i in lora_ids]
    mgr.set_adapter_mapping(LoRAMapping(tuple(lora_ids), tuple(lora_ids), is_prefill=False))
    n = len(lora_ids)
    out = {"layers": 0, "max_abs_diff": 0.0, "max_abs_lora": 0.0, "padding_untouched": True, "slots_ok": True,
           "slot_map": want, "fold_layers": 0, "fold_max_abs_diff": 0.0, "fold_max_abs_out": 0.0,
           "fold_shares_weight": True, "kept_plans": 0, "gemv_layers": 0, "gemv_local_shrink_layers": 0,
           "gemv_one_token_layers": 0, "fold_one_token_only_layers": 0, "fold_wide_layers": 0,
           "side_deferred_layers": 0, "sorted_plans": 0}

    def calls(kind):
        return sum(v for k, v in read_path_counts(worker).items() if k.startswith(kind + ":"))

    before = {kind: calls(kind) for kind in ("fused", "folded")}
    with set_forward_context(None, worker.vllm_config):  # the custom ops find their layers in the forward context
        _self_check_layers(mgr, lora_ids, want, n, pad, torch.Generator().manual_seed(seed), out)
    out["fused_calls"] = calls("fused") - before["fused"]
    out["folded_calls"] = calls("folded") - before["folded"]
    return out


def _self_check_layers(mgr, lora_ids, want, n, pad, gen, out) -> None:
    import torch

    for layer in mgr.modules.values():
        st = getattr(layer, "_bd_fused", None)
        if st is None or getattr(layer, "bd_op_key", None) is None:
            continue
        a0 = layer.lora_a_stacked[0]
        d_in, d_out = a0.shape[-1], sum(layer.output_slices)
        buf = st.slots.buf
        out["slots_ok"] &= buf[:n].tolist() == want and bool((buf[n:] == -1).all())
        extra = max(0, min(pad, st.two_launch_max - n))
        x = torch.randn(n + extra, d_in, generator=gen).to(a0.dtype).to(a0.device)
        y_stock = torch.zeros(n, d_out, dtype=a0.dtype, device=a0.device)
        layer.punica_wrapper.add_lora_linear(y_stock, x[:n], layer.lora_a_stacked, layer.lora_b_stacked, 1.0,
                                             layer.output_slices)
        y_fused = torch.zeros(n + extra, d_out, dtype=a0.dtype, device=a0.device)
        torch.ops.bdlora.lora_linear(y_fused, x, layer.bd_op_key)
        out["layers"] += 1
        out["max_abs_diff"] = max(out["max_abs_diff"], float((y_fused[:n] - y_stock).abs().max()))
        out["max_abs_lora"] = max(out["max_abs_lora"], float(y_stock.abs().max()))
        out["padding_untouched"] &= bool((y_fused[n:] == 0).all())
        if st.fold is not None:
            base = torch.nn.functional.linear(x, st.fold.weight.base)
            y_fold = layer._apply_sync(x)  # fold_linear, or fold_linear_split + its add (side_defer)
            out["fold_layers"] += 1
            out["side_deferred_layers"] += st.side.defer
            out["fold_max_abs_diff"] = max(out["fold_max_abs_diff"],
                                           float((y_fold[:n] - (base[:n] + y_stock)).abs().max()))
            out["fold_max_abs_out"] = max(out["fold_max_abs_out"], float(y_fold.abs().max()))
            out["fold_shares_weight"] &= layer.base_layer.weight.data_ptr() == st.fold.weight.w_ext.data_ptr()
            out["padding_untouched"] &= bool(torch.allclose(y_fold[n:], base[n:], rtol=1e-5, atol=1e-5))
            out["kept_plans"] += len(st.plans)  # fold_linear's prepared launches this layer keeps (FoldedLaunch)
            out["sorted_plans"] += sum(plan.sorted for plan in st.plans.values())  # on tokens grouped by slot
            if st.fold.gemv_tiles is not None and st.fold.gemv_max > 0:  # layers on the one-launch kernel, and its kind
                out["gemv_layers"] += 1
                out["gemv_local_shrink_layers"] += bool(st.fold.gemv_tiles.local_shrink)
            if st.fold.max_tokens == 0:  # folded for one-token forwards only
                out["fold_one_token_only_layers"] += 1
            out["fold_wide_layers"] += st.fold.min_tokens > 1
            if st.fold.gemv_one_token_tiles is not None:  # one row alone: the one-token tiles
                y_one = layer._apply_sync(x[:1])
                out["gemv_one_token_layers"] += 1
                out["fold_max_abs_diff"] = max(out["fold_max_abs_diff"],
                                               float((y_one - (base[:1] + y_stock[:1])).abs().max()))


def logits_lora_layers(worker) -> list:
    """This worker's :class:`bdlora.vllm_plugin.layers.BDLogitsProcessorWithLoRA` layers (none outside BD mode)."""
    from .layers import BDLogitsProcessorWithLoRA

    return [m for m in _adapter_manager(worker).modules.values() if isinstance(m, BDLogitsProcessorWithLoRA)]


def read_logits_lora(worker) -> dict:
    """The logits processor's LoRA wrapper on this worker: ``class``, ``lm_head_slots`` (slots whose lm_head factors
    are not zero) and ``ran`` / ``skipped``: logits computations with and without the lm_head LoRA term so far (a BD
    engine skips it while no slot has lm_head factors: :class:`bdlora.vllm_plugin.layers.BDLogitsProcessorWithLoRA`).
    Empty without that layer."""
    for layer in logits_lora_layers(worker)[:1]:
        return {"class": type(layer).__qualname__, "lm_head_slots": sorted(layer.lm_head_slots),
                "ran": layer.lora_terms["ran"], "skipped": layer.lora_terms["skipped"]}
    return {}


def _adapter_manager(worker):
    runner = getattr(worker, "model_runner", worker)
    return runner.lora_manager._adapter_manager


def _nbytes(t) -> int:
    if t is None:
        return 0
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def _stacked_pairs(layer) -> list:
    """(A, B) slot buffers of a LoRA layer, [lora slot, ...]: the linear layers' ``lora_{a,b}_stacked`` tuples, the MoE
    layers' ``w13_*`` / ``w2_*`` ones (their ``lora_a_stacked`` is a per-expert view list of the same memory)."""
    if isinstance(getattr(layer, "w13_lora_a_stacked", None), tuple):
        return list(zip(layer.w13_lora_a_stacked + layer.w2_lora_a_stacked,
                        layer.w13_lora_b_stacked + layer.w2_lora_b_stacked))
    stacked_a = getattr(layer, "lora_a_stacked", None)
    return list(zip(stacked_a, layer.lora_b_stacked)) if isinstance(stacked_a, tuple) else []


def lora_memory(worker, lora_int_id: int) -> dict:
    """Bytes of one adapter on this rank: ``loaded`` (the LoRAModel tensors kept on the host), ``slot`` (its slot
    in the stacked buffers of every LoRA layer), plus ``buffer_rank`` and layer-class names."""
    mgr = _adapter_manager(worker)
    model = mgr._registered_adapters[lora_int_id]
    loaded = sum(_nbytes(w.lora_a) + _nbytes(w.lora_b) for w in model.loras.values())
    slot = mgr.lora_index_to_id.index(lora_int_id) if lora_int_id in mgr.lora_index_to_id else None
    slot_bytes = 0
    ranks, classes = set(), set()
    for layer in mgr.modules.values():
        pairs = _stacked_pairs(layer)
        if pairs:
            classes.add(type(layer).__qualname__)
        for a, b in pairs:
            ranks.add(int(a.shape[2]))
            if slot is not None:
                slot_bytes += _nbytes(a[slot]) + _nbytes(b[slot])
    loaded_shapes = {
        name: ([tuple(x.shape) for x in w.lora_a] if isinstance(w.lora_a, list) else tuple(w.lora_a.shape),
               [tuple(x.shape) for x in w.lora_b] if isinstance(w.lora_b, list) else tuple(w.lora_b.shape))
        for name, w in model.loras.items()
    }
    return {"loaded": loaded, "slot": slot_bytes, "buffer_ranks": sorted(ranks), "classes": sorted(classes),
            "shapes": loaded_shapes}


def lora_layer_classes(worker) -> dict:
    mgr = _adapter_manager(worker)
    return {name: type(layer).__qualname__ for name, layer in mgr.modules.items()}
