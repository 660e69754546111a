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

The fast path (``--enable-bdlora``: bdlora's kernels picked per token count, :mod:`bdlora.vllm_plugin.fast_path`)
adds three hooks: ``_apply_sync`` (a layer whose base weight folds: its whole output through
``torch.ops.bdlora.fold_linear``), ``_apply_lora_to_output`` (a layer that does not fold: its LoRA term through
``torch.ops.bdlora.lora_linear``) and ``set_mapping`` (the token -> slot map the kernels read).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Optional

import torch

from bdlora.spec import COLUMN, ROW, BDLoraError

from . import vllm_api as api
from .fast_path.state import LayerBuild, LayerState, TokenSlots
from .fast_path.build import build_layer_state, uses_bdlora_kernels
from .fast_path.ops import _LIB  # noqa: F401 - defines torch.ops.bdlora before any layer uses it
from .validate import device_rank

ColumnParallelLinearWithLoRA = api.resolve("ColumnParallelLinearWithLoRA")
MergedColumnParallelLinearWithLoRA = api.resolve("MergedColumnParallelLinearWithLoRA")
MergedQKVParallelLinearWithLoRA = api.resolve("MergedQKVParallelLinearWithLoRA")
RowParallelLinearWithLoRA = api.resolve("RowParallelLinearWithLoRA")
LogitsProcessorWithLoRA = api.resolve("LogitsProcessorWithLoRA")
FusedMoEWithLoRA = api.resolve("FusedMoEWithLoRA", None)
FusedMoE3DWithLoRA = api.resolve("FusedMoE3DWithLoRA", None)
ColumnParallelLinear = api.resolve("ColumnParallelLinear")
#: The platform's out-of-tree replacement of a layer class (identity where vLLM has none).
maybe_get_oot_by_class = api.resolve("maybe_get_oot_by_class", lambda cls: cls)

logger = logging.getLogger("bdlora.vllm_plugin")


class _BDLoRAMixin:
    """Shared BD behaviour; ``bd_layout`` says how the adapter's factors are block-diagonal on this layer."""

    bd_layout: str
    bdlora = True
    #: This build's state, set on the classes :func:`layer_classes` makes; None on the plain classes (rank from
    #: ``max_lora_rank`` and the TP size, vLLM's kernels).
    _bd_build: Optional[LayerBuild] = None

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None, **kwargs) -> bool:
        # The vLLM parent's rule (next in the MRO), bound to this class.
        return super().can_replace_layer(source_layer=source_layer, lora_config=lora_config,
                                         packed_modules_list=packed_modules_list, model_config=model_config)

    def create_lora_weights(self, max_loras, lora_config, model_config=None) -> None:
        self.lora_config = lora_config
        build = self._bd_build
        rank = build.rank if build is not None else device_rank(lora_config.max_lora_rank, self.tp_size)
        self.bd_rank = rank
        if isinstance(self, MergedColumnParallelLinearWithLoRA):
            outs = tuple(self.output_slices)
        else:
            outs = (self.output_size,) * self.n_slices
        dtype, dev = lora_config.lora_dtype, self.device
        if build is not None and build.options is not None and uses_bdlora_kernels(build, dev):
            build_layer_state(self, max_loras, rank, outs, dtype, dev, build)
        else:
            self.lora_a_stacked = tuple(
                torch.zeros(max_loras, 1, rank, self.input_size, dtype=dtype, device=dev)
                for _ in range(self.n_slices))
            self.lora_b_stacked = tuple(
                torch.zeros(max_loras, 1, out, rank, dtype=dtype, device=dev) for out in outs)
        if not isinstance(self, MergedColumnParallelLinearWithLoRA):
            self.output_slices = (self.lora_b_stacked[0].shape[2],)

    # ------------------------------------------------------------------------------------------- fast path

    _bd_fused: Optional[LayerState] = None  # fast_path.build.build_layer_state
    # bd_op_key: the custom ops' argument (fast_path.state.LayerBuild.register), a non-persistent buffer so that
    # torch.compile lifts it to a graph input; None: vLLM's path

    def _apply_sync(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        st, key = self._bd_fused, getattr(self, "bd_op_key", None)
        if key is None or st.fold is None or x.ndim != 2:
            return super()._apply_sync(x, bias)
        if st.side.defer:  # the add in traced code: torch.compile fuses it into the kernel that reads the output
            y, term = torch.ops.bdlora.fold_linear_split(x, bias, key, st.fold.weight.d_out)
            return y + term
        return torch.ops.bdlora.fold_linear(x, bias, key, st.fold.weight.d_out)

    def set_mapping(self, punica_wrapper):
        super().set_mapping(punica_wrapper)
        st = self._bd_fused
        if st is not None:
            st.rebind(TokenSlots.of(punica_wrapper))
            if st.slots is None:
                self.bd_op_key = None
                logger.warning("bdlora kernels: %s has no _token_lora_indices; %s keeps vLLM's LoRA path",
                               type(punica_wrapper).__name__, type(self).__name__)

    def reset_lora(self, index: int):
        super().reset_lora(index)
        st = self._bd_fused
        if st is not None:
            if not st.b_shared:
                st.lora_b[index] = 0
            st.ranks[index] = 0

    def _apply_lora_to_output(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        key = getattr(self, "bd_op_key", None)
        if key is None:
            return super()._apply_lora_to_output(x, output)
        original_shape = output.shape if output.ndim == 3 else None
        if x.ndim == 3 and output.ndim == 3:  # transformers backend: (1, T, d)
            output = output.flatten(0, 1)
            x = x.flatten(0, 1)
        torch.ops.bdlora.lora_linear(output, x, key)
        if original_shape is not None:
            output = output.reshape(original_shape)
        return output

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
        slot_rank = 0
        for i, (a, b) in enumerate(zip(lora_a, lora_b)):
            if a is None or b is None:
                continue
            buf_a, buf_b = self.lora_a_stacked[i], self.lora_b_stacked[i]
            cap, d_in, d_out = buf_a.shape[2], buf_a.shape[3], buf_b.shape[2]
            r = a.shape[0]
            if a.shape[1] != d_in or b.shape[0] != d_out or b.shape[1] != r:
                raise BDLoraError(
                    f"{type(self).__name__} slice {i}: this device's shard of the adapter is A{tuple(a.shape)} "
                    f"B{tuple(b.shape)}, but the served model's layer takes A(r, {d_in}) B({d_out}, r) on each of "
                    f"the {self.tp_size} devices (full layer: d_in x d_out = "
                    f"{d_in * (self.tp_size if getattr(self, 'bd_layout', None) == ROW else 1)} x "
                    f"{d_out * (self.tp_size if getattr(self, 'bd_layout', None) == COLUMN else 1)}): the adapter "
                    "was trained for another model; serve it with the base model it was trained on")
            if r > cap:
                if a.any() or b.any():
                    raise BDLoraError(
                        f"{type(self).__name__}: this rank's LoRA rank {r} exceeds the BD buffer rank {cap}; raise "
                        "--max-lora-rank or additional_config bdlora.min_nblocks")
                a, b, r = a[:cap], b[:, :cap], cap  # an all-zero warm-up (dummy) LoRA
            buf_a[index, 0, :r, :].copy_(a, non_blocking=True)
            buf_b[index, 0, :, :r].copy_(b, non_blocking=True)
            st = self._bd_fused
            if st is not None:
                if not st.b_shared:
                    st.lora_b[index, st.offsets[i]:st.offsets[i + 1], :r].copy_(b, non_blocking=True)
                slot_rank = max(slot_rank, r)
        if self._bd_fused is not None:
            self._bd_fused.ranks[index] = slot_rank


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


class _BDExpertsMixin:
    """BD-LoRA on a MoE layer's experts: gate_up's B and down's A block-diagonal over the expert shards, so each TP
    rank holds an independent rank r/N LoRA of its own shard of every expert. The stacked buffers have the per-device
    BD rank; the slicing hooks are identities (the loader hands each rank its blocks, :mod:`bdlora.moe`); the LoRA
    runs on vLLM's non-fully-sharded MoE LoRA path, whose down-projection partial sums ride the base all-reduce (no
    LoRA collective)."""

    bd_layout = "experts"
    bdlora = True
    _bd_build: Optional[LayerBuild] = None

    def create_lora_weights(self, max_loras, lora_config, model_config=None) -> None:
        import copy

        build = self._bd_build
        rank = build.rank if build is not None else device_rank(lora_config.max_lora_rank, self.tp_size)
        cfg = copy.copy(lora_config)  # vLLM sizes the buffers from these two; never --fully-sharded-loras in BD
        object.__setattr__(cfg, "max_lora_rank", rank)
        object.__setattr__(cfg, "fully_sharded_loras", False)
        super().create_lora_weights(max_loras, cfg, model_config)
        self.bd_rank = rank

    def _slice_w13_a(self, t):
        return t

    def _slice_w13_b(self, t):
        return t

    def _slice_w2_a(self, t):
        return t

    def _slice_w2_b(self, t):
        return t


_EXPERT_CLASSES = ()
if FusedMoE3DWithLoRA is not None:
    class BDFusedMoE3DWithLoRA(_BDExpertsMixin, FusedMoE3DWithLoRA):
        """Experts of a 3-D MoE model (vLLM's is_3d_moe_weight: Qwen3-VL-MoE): PEFT's flattened expert factors."""

        vllm_class_name = FusedMoE3DWithLoRA.__name__

    class BDFusedMoEWithLoRA(_BDExpertsMixin, FusedMoEWithLoRA):
        """Experts of a per-expert MoE model (Qwen3-MoE, Mixtral, OLMoE in vLLM): per-expert gate/up/down factors."""

        vllm_class_name = FusedMoEWithLoRA.__name__

    _EXPERT_CLASSES = (BDFusedMoE3DWithLoRA, BDFusedMoEWithLoRA)

#: Checked in this order, before vLLM's own classes, in BD mode only.
BD_LORA_CLASSES = (
    BDMergedQKVParallelLinearWithLoRA,
    BDMergedColumnParallelLinearWithLoRA,
    BDColumnParallelLinearWithLoRA,
    BDRowParallelLinearWithLoRA,
    *_EXPERT_CLASSES,
)


def layer_classes(build: LayerBuild) -> tuple:
    """The BD layer classes of one build: subclasses of :data:`BD_LORA_CLASSES` carrying ``build``, in the same
    order (vLLM's ``from_layer`` takes the first whose ``can_replace_layer`` is true), with the same qualified names.
    A class with ``vllm_class_name`` takes that ``__name__``: vLLM's warm-up (dummy) LoRA dispatches on the layer's
    class name (``module.__class__.__name__ == "FusedMoEWithLoRA"``), not on isinstance, and builds a wrongly packed
    dummy for any other name (CUDA-graph capture then fails in ``set_lora``); diagnostics read ``__qualname__``."""
    return tuple(type(getattr(c, "vllm_class_name", c.__name__), (c,),
                      {"_bd_build": build, "__module__": c.__module__, "__qualname__": c.__qualname__,
                       "__doc__": c.__doc__})
                 for c in BD_LORA_CLASSES)


class _NoLogitsLoRA:
    """Stands in for the punica wrapper during one ``_get_logits`` call whose lm_head LoRA term is zero: vLLM's
    ``add_lora_logits`` adds into ``y`` in place (or returns it, on platforms that cannot update in place)."""

    @staticmethod
    def add_lora_logits(y, *args, **kwargs):
        return y


class BDLogitsProcessorWithLoRA(LogitsProcessorWithLoRA):
    """vLLM's logits-processor LoRA wrapper without its lm_head term while no slot holds lm_head factors.

    vLLM wraps the logits processor whenever lm_head is a LoRA target (Llama's default) and adds the lm_head term,
    a shrink and an expand over the vocabulary, to every step's logits, eagerly (logits are outside the CUDA graph),
    even when every slot's factors are zeros. BD adapters never have lm_head factors (vLLM's warm-up adapters have
    zero ones), so a BD engine paid two launches and their host time per step for a term that adds exactly zero.
    The decision is host-side: ``set_lora`` records a slot whose lm_head A and B are both nonzero (checked once per
    activation), ``reset_lora`` clears it; a slot left flagged after its adapter is deactivated only keeps the term
    on (never wrong). The term always runs while a CUDA graph is captured (the graph would keep the decision) and
    on the first call (on GPUs, vLLM's dummy sampler run at start-up), so its Triton kernels still compile at
    start-up and a later adapter with lm_head factors does not wait for them (1.2 s on an H100). The BD-mode
    manager builds this class in place of vLLM's (:mod:`bdlora.vllm_plugin.loader`)."""

    def create_lora_weights(self, *args, **kwargs):
        super().create_lora_weights(*args, **kwargs)
        self.lm_head_slots: set = set()  # slots whose lm_head factors are not zero
        self.lora_terms: Counter = Counter()  # "ran" / "skipped": _get_logits calls of each kind (diagnostics)

    def set_lora(self, index: int, lora_a, lora_b):
        super().set_lora(index, lora_a, lora_b)
        if bool(lora_b.any()) and bool(lora_a.any()):
            self.lm_head_slots.add(index)
        else:
            self.lm_head_slots.discard(index)

    def reset_lora(self, index: int):
        super().reset_lora(index)
        self.lm_head_slots.discard(index)

    def _get_logits(self, *args, **kwargs):
        if (self.lm_head_slots or not self.lora_terms["ran"]
                or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
            self.lora_terms["ran"] += 1
            return super()._get_logits(*args, **kwargs)
        self.lora_terms["skipped"] += 1
        wrapper = self.punica_wrapper
        self.punica_wrapper = _NoLogitsLoRA
        try:
            return super()._get_logits(*args, **kwargs)
        finally:
            self.punica_wrapper = wrapper


def layout_of_layer(layer) -> Optional[str]:
    """COLUMN/ROW for a BD layer, None for any other (stock) LoRA layer."""
    return getattr(layer, "bd_layout", None) if getattr(layer, "bdlora", False) else None
