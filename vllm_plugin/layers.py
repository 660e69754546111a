"""BD-LoRA layers: vLLM's own LoRA linear layers with one small hook per concern.

* ``can_replace_layer``: the parent's rule (same layer types, same packing) — these classes only sit in front of
  ``_all_lora_classes`` while a BD-mode LoRA manager builds its layers.
* ``create_lora_weights``: the stacked buffers have the per-device BD rank (``max_lora_rank / min(min_nblocks, tp)``,
  see :func:`bdlora.vllm_plugin.validate.device_rank`) instead of ``max_lora_rank``, so the kernels never multiply
  the zeros of the other devices' blocks.
* ``slice_lora_a`` / ``slice_lora_b``: identity — each TP rank already read only its own blocks from disk
  (:mod:`bdlora.vllm_plugin.loader`), with the adapter's own r and nblocks.
* ``set_lora``: copies the per-rank factors of every slice (q/k/v, gate/up) into the slot, checking shapes.
* ``apply``/``forward``: inherited from the non-sharded vLLM layers: column layers run
  ``y_i = x W_i + (x A_i) B_i`` and row layers add ``(x_i A_i) B_i`` to the partial sum that the base model's one
  all-reduce already sums; there is no LoRA collective (unlike ``--fully-sharded-loras``).
"""

from __future__ import annotations

from typing import Optional

import torch

from vllm.lora.layers import (
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
)
from vllm.model_executor.layers.linear import ColumnParallelLinear

try:  # vLLM >= 0.2x: out-of-tree op replacement
    from vllm.model_executor.custom_op import maybe_get_oot_by_class
except ImportError:  # pragma: no cover
    def maybe_get_oot_by_class(cls):
        return cls

from bdlora.spec import COLUMN, ROW, BDLoraError

from .validate import device_rank

#: Set by the BD-mode LoRA manager while it builds its layers: the per-device buffer rank.
_BUILD_RANK: Optional[int] = None


def _buffer_rank(lora_config, tp_size: int) -> int:
    return _BUILD_RANK if _BUILD_RANK is not None else device_rank(lora_config.max_lora_rank, tp_size)


class _BDLoRAMixin:
    """Shared BD behaviour; ``bd_layout`` says how the adapter's factors are block-diagonal on this layer."""

    bd_layout: str
    bdlora = True

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None, **kwargs) -> bool:
        # The vLLM parent's rule (next in the MRO), bound to this class.
        return super().can_replace_layer(source_layer=source_layer, lora_config=lora_config,
                                         packed_modules_list=packed_modules_list, model_config=model_config)

    def create_lora_weights(self, max_loras, lora_config, model_config=None) -> None:
        self.lora_config = lora_config
        rank = _buffer_rank(lora_config, self.tp_size)
        self.bd_rank = rank
        if isinstance(self, MergedColumnParallelLinearWithLoRA):
            outs = tuple(self.output_slices)
        else:
            outs = (self.output_size,) * self.n_slices
        dtype, dev = lora_config.lora_dtype, self.device
        self.lora_a_stacked = tuple(
            torch.zeros(max_loras, 1, rank, self.input_size, dtype=dtype, device=dev) for _ in range(self.n_slices))
        self.lora_b_stacked = tuple(torch.zeros(max_loras, 1, out, rank, dtype=dtype, device=dev) for out in outs)
        if not isinstance(self, MergedColumnParallelLinearWithLoRA):
            self.output_slices = (self.lora_b_stacked[0].shape[2],)

    # The loader hands over this rank's factors already: nothing to slice.
    def slice_lora_a(self, lora_a):
        return lora_a

    def slice_lora_b(self, lora_b):
        return lora_b

    def set_lora(self, index: int, lora_a, lora_b):
        self.reset_lora(index)
        if isinstance(lora_a, torch.Tensor) or lora_a is None:
            lora_a, lora_b = [lora_a], [lora_b]
        if len(lora_a) != self.n_slices or len(lora_b) != self.n_slices:
            raise BDLoraError(f"{type(self).__name__}: got {len(lora_a)} LoRA slices for a layer with "
                              f"{self.n_slices}; BD-LoRA adapters must target the per-projection modules "
                              "(q_proj/k_proj/v_proj, gate_proj/up_proj), not fused ones")
        for i, (a, b) in enumerate(zip(lora_a, lora_b)):
            if a is None or b is None:
                continue
            buf_a, buf_b = self.lora_a_stacked[i], self.lora_b_stacked[i]
            cap, d_in, d_out = buf_a.shape[2], buf_a.shape[3], buf_b.shape[2]
            r = a.shape[0]
            if a.shape[1] != d_in or b.shape[0] != d_out or b.shape[1] != r:
                raise BDLoraError(
                    f"{type(self).__name__} (tp rank {self.tp_rank}/{self.tp_size}), slice {i}: factors A{tuple(a.shape)} "
                    f"B{tuple(b.shape)} are not this rank's shard (expected A(r, {d_in}) B({d_out}, r)); BD mode loads "
                    "adapters through bdlora's per-rank loader only")
            if r > cap:
                if a.any() or b.any():
                    raise BDLoraError(
                        f"{type(self).__name__}: this rank's LoRA rank {r} exceeds the BD buffer rank {cap}; raise "
                        "--max-lora-rank or additional_config bdlora.min_nblocks")
                a, b, r = a[:cap], b[:, :cap], cap  # an all-zero warm-up (dummy) LoRA
            buf_a[index, 0, :r, :].copy_(a, non_blocking=True)
            buf_b[index, 0, :, :r].copy_(b, non_blocking=True)


class BDColumnParallelLinearWithLoRA(_BDLoRAMixin, ColumnParallelLinearWithLoRA):
    """A plain column-parallel layer (one projection): A rank-split, B block-diagonal."""

    bd_layout = COLUMN

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None, **kwargs) -> bool:
        # Only the plain layer: a MergedColumnParallelLinear with one fused LoRA interleaves per-device blocks of
        # several projections, which a PEFT block-diagonal factor over the fused rows cannot follow.
        return type(source_layer) is maybe_get_oot_by_class(ColumnParallelLinear)


class BDMergedColumnParallelLinearWithLoRA(_BDLoRAMixin, MergedColumnParallelLinearWithLoRA):
    """gate_up_proj: two column-parallel projections, each with its own BD factors."""

    bd_layout = COLUMN


class BDMergedQKVParallelLinearWithLoRA(_BDLoRAMixin, MergedQKVParallelLinearWithLoRA):
    """qkv_proj with GQA: q, k and v have different widths; each projection has its own BD factors."""

    bd_layout = COLUMN


class BDRowParallelLinearWithLoRA(_BDLoRAMixin, RowParallelLinearWithLoRA):
    """o_proj / down_proj: A block-diagonal over the input shards, B rank-split; partial sums ride the base
    all-reduce."""

    bd_layout = ROW


#: Checked in this order, before vLLM's own classes, in BD mode only.
BD_LORA_CLASSES = (
    BDMergedQKVParallelLinearWithLoRA,
    BDMergedColumnParallelLinearWithLoRA,
    BDColumnParallelLinearWithLoRA,
    BDRowParallelLinearWithLoRA,
)


def layout_of_layer(layer) -> Optional[str]:
    """COLUMN/ROW for a BD layer, None for any other (stock) LoRA layer."""
    return getattr(layer, "bd_layout", None) if getattr(layer, "bdlora", False) else None
