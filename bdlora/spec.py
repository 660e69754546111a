"""What a BD-LoRA adapter is: block count, rank, scaling and which modules are column- or row-parallel.

Megatron tensor parallelism shards a linear layer one of two ways, and BD-LoRA makes the LoRA factor that would
otherwise need communication block-diagonal:

* column-parallel layers (q/k/v/gate/up): output split across devices -> **B** is block-diagonal
  (PEFT: ``BdLoraConfig.target_modules_bd_b``);
* row-parallel layers (o/down): input split across devices -> **A** is block-diagonal
  (PEFT: ``BdLoraConfig.target_modules_bd_a``).

Each of the N blocks is an independent rank ``r/N`` adapter, so with rsLoRA the scale is
``alpha / sqrt(r/N) = alpha * sqrt(N) / sqrt(r)``. PEFT computes ``lora_alpha / sqrt(r)`` with the full r, so the
adapter config stores ``lora_alpha = alpha * sqrt(N)``: every engine that reads the folder (PEFT, vLLM) then
reproduces exactly the scale used in training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from .layout import COLUMN, ROW, Layout, layout_by_name

_LLAMA_LIKE = {
    COLUMN: ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
    ROW: ("o_proj", "down_proj"),
}

# Mixture-of-Experts models whose experts are fused 3-D tensors (bdlora.moe adapts those through
# ``target_parameters``): the presets name the attention projections, and Qwen2-MoE's shared expert MLP.
_ATTENTION_ONLY = {COLUMN: ("q_proj", "k_proj", "v_proj"), ROW: ("o_proj",)}

#: Column-/row-parallel projection names by Hugging Face ``config.model_type``, as vLLM shards them.
PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    **{name: _LLAMA_LIKE
       for name in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "smollm3", "granite",
                    "qwen2_moe")},
    **{name: _ATTENTION_ONLY for name in ("qwen3_moe", "mixtral", "olmoe")},
}


#: vLLM's fused column-parallel modules (q/k/v and gate/up packed), as adapters of other tools may name them.
FUSED_COLUMN_MODULES = ("qkv_proj", "gate_up_proj")


def serving_layout(leaf: str) -> str:
    """How vLLM shards a projection of this name under tensor parallelism: COLUMN for every preset's column-parallel
    names and vLLM's fused ones, ROW otherwise."""
    columns = {name for preset in PRESETS.values() for name in preset[COLUMN]} | set(FUSED_COLUMN_MODULES)
    return COLUMN if leaf in columns else ROW


class BDLoraError(ValueError):
    """Bad BD-LoRA configuration or adapter; the message says what is wrong and how to fix it."""


def rslora_block_scale(lora_alpha: float, r: int, nblocks: int) -> float:
    """Scale of a BD-LoRA adapter trained as ``nblocks`` independent rsLoRA adapters of rank ``r/nblocks``."""
    return lora_alpha * math.sqrt(nblocks) / math.sqrt(r)


def peft_scaling(lora_alpha: float, r: int, use_rslora: bool) -> float:
    """The scale PEFT (and vLLM) derive from an adapter config."""
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def preset_for(model_type: str) -> dict[str, tuple[str, ...]]:
    try:
        return PRESETS[model_type]
    except KeyError:
        raise BDLoraError(
            f"no BD-LoRA preset for model_type={model_type!r} (presets: {', '.join(sorted(PRESETS))}); "
            "pass column_modules= (column-parallel, e.g. q/k/v/gate/up) and row_modules= "
            "(row-parallel, e.g. o/down) explicitly"
        ) from None


@dataclass(frozen=True)
class BDLoraSpec:
    """A BD-LoRA adapter's shape and scaling.

    Args:
        nblocks: N, the number of diagonal blocks = the tensor-parallel degree the adapter is served at.
        r: total LoRA rank; every block has rank ``r // nblocks``.
        lora_alpha: the rsLoRA alpha of one block adapter (``scale = lora_alpha * sqrt(N) / sqrt(r)``).
        column_modules: names (last path component, exact) of column-parallel projections: B block-diagonal.
        row_modules: names of row-parallel projections: A block-diagonal.
        lora_dropout: dropout on the LoRA input during training.
    """

    nblocks: int
    r: int
    lora_alpha: float = 16.0
    column_modules: tuple[str, ...] = _LLAMA_LIKE[COLUMN]
    row_modules: tuple[str, ...] = _LLAMA_LIKE[ROW]
    lora_dropout: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "column_modules", tuple(self.column_modules))
        object.__setattr__(self, "row_modules", tuple(self.row_modules))
        if not isinstance(self.nblocks, int) or self.nblocks < 1:
            raise BDLoraError(f"nblocks must be a positive integer (the serving TP degree), got {self.nblocks!r}")
        if not isinstance(self.r, int) or self.r < 1:
            raise BDLoraError(f"rank r must be a positive integer, got {self.r!r}")
        if self.r % self.nblocks:
            lo = self.r - self.r % self.nblocks
            hi = lo + self.nblocks
            raise BDLoraError(
                f"rank r={self.r} is not divisible by nblocks={self.nblocks}: every block needs rank r/nblocks; "
                f"use r={hi}" + (f" or r={lo}" if lo else "")
            )
        if not (self.column_modules or self.row_modules):
            raise BDLoraError("no target modules: give column_modules and/or row_modules")
        overlap = set(self.column_modules) & set(self.row_modules)
        if overlap:
            raise BDLoraError(f"modules {sorted(overlap)} are listed as both column- and row-parallel; pick one")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise BDLoraError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")

    @classmethod
    def from_preset(
        cls, model_type: str, nblocks: int, r: int, lora_alpha: float = 16.0,
        target_modules: Iterable[str] | None = None, lora_dropout: float = 0.0,
    ) -> "BDLoraSpec":
        """Column/row split from ``PRESETS[model_type]``, optionally restricted to ``target_modules``."""
        preset = preset_for(model_type)
        cols, rows = preset[COLUMN], preset[ROW]
        if target_modules is not None:
            wanted = list(target_modules)
            unknown = [m for m in wanted if m not in cols + rows]
            if unknown:
                raise BDLoraError(
                    f"unknown target modules {unknown} for model_type={model_type!r}; "
                    f"known: column-parallel {list(cols)}, row-parallel {list(rows)}"
                )
            cols = tuple(m for m in cols if m in wanted)
            rows = tuple(m for m in rows if m in wanted)
        return cls(nblocks=nblocks, r=r, lora_alpha=lora_alpha, column_modules=cols, row_modules=rows,
                   lora_dropout=lora_dropout)

    @property
    def block_rank(self) -> int:
        return self.r // self.nblocks

    @property
    def scale(self) -> float:
        return rslora_block_scale(self.lora_alpha, self.r, self.nblocks)

    @property
    def peft_lora_alpha(self) -> float:
        """``lora_alpha`` to write into a PEFT config (with ``use_rslora``) so PEFT's scale equals :attr:`scale`."""
        return self.lora_alpha * math.sqrt(self.nblocks)

    @property
    def target_modules(self) -> tuple[str, ...]:
        return self.column_modules + self.row_modules

    def layout_of(self, module_name: str) -> Layout:
        """Layout of a module given its full dotted path or its last component (exact match)."""
        layout = layout_by_name(module_name, self.column_modules, self.row_modules)
        if layout is not None:
            return layout
        raise BDLoraError(
            f"module {module_name!r} is not a BD-LoRA target (column: {list(self.column_modules)}, "
            f"row: {list(self.row_modules)})"
        )

    def matching_modules(self, model) -> dict[str, Layout]:
        """Exact-name match of the targets against ``model``'s ``nn.Linear`` modules: {full name: layout}.

        Raises when a target name matches nothing (a typo PEFT's substring match would hide) or a matched layer's
        dimension is not divisible by ``nblocks``.
        """
        import torch.nn as nn

        found: dict[str, Layout] = {}
        seen: set[str] = set()
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            module = getattr(module, "base_layer", module)  # a PEFT LoRA layer wraps the nn.Linear it adapts
            if leaf not in self.target_modules or not isinstance(module, nn.Linear):
                continue
            seen.add(leaf)
            layout = self.layout_of(leaf)
            # The sharded dimension must split into N equal blocks.
            dim = module.out_features if layout == COLUMN else module.in_features
            if dim % self.nblocks:
                raise BDLoraError(
                    f"{name}: {'out' if layout == COLUMN else 'in'}_features={dim} is not divisible by "
                    f"nblocks={self.nblocks}; choose an nblocks that divides it (a TP degree the model supports)"
                )
            found[name] = layout
        missing = [m for m in self.target_modules if m not in seen]
        if missing:
            linear_leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise BDLoraError(f"target modules {missing} match no nn.Linear in the model; linear layers are named "
                              f"{linear_leaves}")
        return found

    def to_peft_config(self, **lora_kwargs):
        """A ``peft.LoraConfig`` that builds exactly this adapter (rsLoRA, ``use_bdlora``)."""
        from peft import LoraConfig
        from peft.tuners.lora.config import BdLoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.peft_lora_alpha,
            use_rslora=True,
            lora_dropout=self.lora_dropout,
            target_modules=list(self.target_modules),
            use_bdlora=BdLoraConfig(
                target_modules_bd_a=list(self.row_modules),
                target_modules_bd_b=list(self.column_modules),
                nblocks=self.nblocks,
            ),
            **lora_kwargs,
        )

    def to_dict(self) -> dict:
        return {
            "nblocks": self.nblocks, "r": self.r, "lora_alpha": self.lora_alpha,
            "column_modules": list(self.column_modules), "row_modules": list(self.row_modules),
            "lora_dropout": self.lora_dropout,
        }


def matched_lora_rank(r: int, hidden: int, intermediate: int, nblocks: int) -> float:
    """BD-LoRA rank with the same parameter count as standard LoRA of rank ``r`` (the BD-LoRA paper, Wang et al., "Block-Diagonal LoRA for Eliminating Communication Overhead in Tensor Parallel LoRA Serving", Table 1)."""
    return r * (hidden + intermediate) / (hidden + intermediate / nblocks)


def _model_dims(model_config) -> dict:
    """``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``hidden_size`` of a transformers
    config object or its ``config.json`` dict; a multimodal config's ``text_config`` is used when present."""
    get = (lambda c, k: c.get(k)) if isinstance(model_config, dict) else (lambda c, k: getattr(c, k, None))
    text = get(model_config, "text_config")
    if text is not None and get(model_config, "num_attention_heads") is None:
        model_config = text
        get = (lambda c, k: c.get(k)) if isinstance(model_config, dict) else (lambda c, k: getattr(c, k, None))
    heads = get(model_config, "num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        raise BDLoraError(f"model config has no usable num_attention_heads (got {heads!r}); is it a decoder LLM "
                          "config.json?")
    kv = get(model_config, "num_key_value_heads") or heads  # absent: multi-head attention, one KV head per head
    return {"num_attention_heads": heads, "num_key_value_heads": kv,
            "intermediate_size": get(model_config, "intermediate_size"),
            "hidden_size": get(model_config, "hidden_size")}


def vllm_can_serve_tp(model_config, tp: int, nblocks: int | None = None, kv_lora: bool = False) -> str | None:
    """Why vLLM cannot serve ``model_config`` (a BD-LoRA adapter of ``nblocks`` blocks on it) at tensor-parallel
    degree ``tp``; None when it can.

    The rule, in one place (vLLM: ``ModelConfig.verify_with_parallel_config``, ``QKVParallelLinear``,
    ``MergedColumnParallelLinear``/``RowParallelLinear``):

    * ``num_attention_heads % tp == 0``;
    * KV heads: ``num_key_value_heads % tp == 0``, or ``tp % num_key_value_heads == 0`` (vLLM then replicates each KV
      head on ``tp / kv`` devices);
    * ``intermediate_size % tp == 0`` (gate/up outputs and down's input are split);
    * ``hidden_size`` is never split by tensor parallelism (only the heads are), so it adds no condition;
    * with ``nblocks`` (a BD-LoRA adapter): ``tp | nblocks`` or ``nblocks | tp`` (each device holds whole blocks or
      a slice of one, no LoRA communication);
    * with ``nblocks`` and ``kv_lora`` (the adapter has k_proj/v_proj factors): ``tp <= num_key_value_heads``, because
      replicated KV shards cannot hold different blocks (the vLLM plugin refuses that case).
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        return f"tensor-parallel degree must be a positive integer, got {tp!r}"
    d = _model_dims(model_config)
    heads, kv, inter = d["num_attention_heads"], d["num_key_value_heads"], d["intermediate_size"]
    if heads % tp:
        return f"num_attention_heads={heads} is not divisible by tp={tp}"
    if kv % tp and tp % kv:
        return f"num_key_value_heads={kv} neither divides nor is divisible by tp={tp}"
    if isinstance(inter, int) and inter % tp:
        return f"intermediate_size={inter} is not divisible by tp={tp}"
    if nblocks is not None:
        if tp % nblocks and nblocks % tp:
            return f"the adapter's nblocks={nblocks} neither divides nor is divisible by tp={tp}"
        if kv_lora and tp > kv:
            return (f"tp={tp} exceeds num_key_value_heads={kv}: vLLM replicates k_proj/v_proj, so their block-diagonal "
                    "LoRA blocks cannot follow the shards")
    return None


def servable_tp_degrees(model_config, nblocks: int | None = None, limit: int = 16, kv_lora: bool = False) -> list[int]:
    """Tensor-parallel degrees ``1..limit`` at which vLLM can serve the model (and the adapter with ``nblocks``
    blocks, ``kv_lora`` as in :func:`vllm_can_serve_tp`), ascending."""
    return [tp for tp in range(1, limit + 1) if vllm_can_serve_tp(model_config, tp, nblocks, kv_lora) is None]


__all__ = [
    "BDLoraError", "BDLoraSpec", "FUSED_COLUMN_MODULES", "PRESETS", "matched_lora_rank", "peft_scaling", "preset_for",
    "rslora_block_scale", "servable_tp_degrees", "serving_layout", "vllm_can_serve_tp",
]
