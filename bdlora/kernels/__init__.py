"""Triton kernels for (Block-Diagonal) LoRA: grouped multi-adapter training, LoRAFusion-style fused linear,
and the multi-slice serving decode path. One entry point per operation (``grouped_lora``, ``fused_lora_linear``,
``decode_lora``, ``decode_lora_folded``), each taking ``options=KernelOptions(...)`` (frozen) and returning
``LoraResult(out, dispatch)`` whose ``dispatch.backend`` is the backend that ran (``dispatch`` module docstring).
Each Triton kernel sits beside its launcher (grouped.py, cublas.py, dropout.py, decode.py) with a torch reference
(there or in reference.py). The fused linear also has a cuBLAS-composed path (``cublas.CublasLoraLinearFn``), its
default on CUDA.

The kernels take one :class:`bdlora.layout.LoraFactors` per segment (the one adapter model); orientation, block
layouts and the pack/unpack of block-diagonal factors: see ``bdlora.layout``.
"""
from .cublas import CublasLoraLinearFn
from .decode import (DecodeWorkspace, FoldedWeight, GemvTiles, GemvWorkspace, SlotSegments, decode_lora,
                     decode_lora_folded, fold_weight, slot_segments, stack_decode_weights)
from .dispatch import Dispatch, KernelOptions, LoraResult
from .dropout import dropout_keep_mask, keep_mask_torch, segment_keep_mask
from .grouped import fused_lora_linear, grouped_lora
from .reference import (bd_matmul, decode_lora_folded_ref, decode_lora_folded_torch, decode_lora_ref, decode_lora_torch,
                        fused_lora_linear_ref, grouped_lora_ref, lora_delta_ref, torch_keep_masks)

__all__ = [
    "CublasLoraLinearFn",
    "DecodeWorkspace",
    "Dispatch",
    "FoldedWeight",
    "GemvTiles",
    "GemvWorkspace",
    "KernelOptions",
    "LoraResult",
    "SlotSegments",
    "bd_matmul",
    "decode_lora",
    "decode_lora_folded",
    "decode_lora_folded_ref",
    "decode_lora_folded_torch",
    "decode_lora_ref",
    "decode_lora_torch",
    "dropout_keep_mask",
    "fold_weight",
    "fused_lora_linear",
    "fused_lora_linear_ref",
    "grouped_lora",
    "grouped_lora_ref",
    "keep_mask_torch",
    "lora_delta_ref",
    "segment_keep_mask",
    "slot_segments",
    "stack_decode_weights",
    "torch_keep_masks",
]
