"""Triton kernels for (Block-Diagonal) LoRA: grouped multi-adapter training, LoRAFusion-style fused linear,
and the multi-slice serving decode path. Each op has a pure-torch reference beside it and a dispatcher that
runs Triton on CUDA (or on CPU under TRITON_INTERPRET=1) and falls back to the reference otherwise.

Orientation and block layouts: see ``bdlora.kernels.layout``.
"""
from .decode import decode_lora, stack_decode_weights
from .dispatch import LAST_BACKEND
from .grouped import dropout_keep_mask, fused_lora_linear, grouped_lora
from .layout import LoraAdapter, from_math, pack_block_diagonal, to_math, unpack_block_diagonal
from .reference import bd_matmul, decode_lora_ref, fused_lora_linear_ref, grouped_lora_ref, lora_delta_ref

__all__ = [
    "LAST_BACKEND",
    "LoraAdapter",
    "bd_matmul",
    "decode_lora",
    "decode_lora_ref",
    "dropout_keep_mask",
    "from_math",
    "fused_lora_linear",
    "fused_lora_linear_ref",
    "grouped_lora",
    "grouped_lora_ref",
    "lora_delta_ref",
    "pack_block_diagonal",
    "stack_decode_weights",
    "to_math",
    "unpack_block_diagonal",
]
