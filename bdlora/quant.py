"""BD-LoRA on a bitsandbytes 4-/8-bit base (QLoRA-style training of a block-diagonal adapter).

PEFT 0.21 builds its LoRA layer for a bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` base from its own
``peft.tuners.lora.bnb`` classes, whose ``resolve_lora_variant`` knows DoRA, aLoRA and Arrow only: with
``LoraConfig(use_bdlora=...)`` they return ``None`` and PEFT silently trains a plain dense LoRA (on a 4-bit q_proj of
a 256-wide model: ``lora_B`` (256, 8) dense instead of (256, 4) packed). :func:`enable_bdlora_on_kbit` fixes that by
wrapping the two classes' ``resolve_lora_variant``:

* ``use_bdlora`` set (and no other variant requested) -> :class:`BdLoraKbitVariant`, a subclass of PEFT's own
  ``BdLoraLinearVariant`` (the class the unquantized ``lora.Linear`` resolves to). It builds the same
  ``BlockDiagonalLinear`` factors with the same name matching, so the adapter (parameter names, packed shapes,
  scaling, saved folder) is exactly what PEFT builds on an unquantized base. What it changes, and why:

  - ``init``: PEFT's variant creates the block-diagonal factor in ``base_layer.weight.dtype``, which on a k-bit base
    is the *storage* dtype (uint8 for 4-bit, int8 for 8-bit): an integer parameter that cannot be trained. The k-bit
    variant uses the dtype and device of the dense factor PEFT just made for that adapter (fp32 unless asked
    otherwise), as PEFT's own k-bit layers do for their dense factors.
  - ``forward``: the LoRA path is added to the base output out of place (PEFT's variant adds in place; the 4-bit
    layer clones the base output for exactly this reason, the 8-bit one does not). Same math:
    ``result + s * B(A(dropout(x)))``.
  - ``merge``/``unmerge``: PEFT's bnb layers already dequantize the weight, call the variant's ``merge_safe`` /
    ``unmerge`` on the dequantized float weight and requantize; PEFT's variant would cast the delta to the storage
    dtype (uint8/int8) first. The k-bit variant computes the delta (``B_bd @ A_bd * s``, blocks on the diagonal) in
    fp32 and adds it in the dequantized weight's dtype. The merged weight is re-quantized, so it equals the
    unquantized merge only up to the quantization error (PEFT warns about that itself).

* anything else -> PEFT's own method, unchanged (the wrapper is a no-op for every config without ``use_bdlora``).

PEFT's bnb layers also drop the module name on the way from their ``__init__`` to ``update_layer`` (the
unquantized ``lora.Linear`` passes it on), and the BD variant needs it to tell column from row modules; the patch
wraps the two classes' ``__init__`` to hand ``target_name`` to the variant through a context variable (nothing else
changes; an existing layer's ``update_layer``, used for a second adapter, passes the name itself).

On CPU, bitsandbytes 0.50 repacks 4-bit weights for inference at the first eval-mode forward and loses autograd
from then on: :func:`disable_cpu_inference_packing` (the trainer calls it after loading on CPU).

The patch is idempotent, process-wide, and only ever replaces PEFT's silent dense fallback by the BD layout; a BD
config combined with another variant (DoRA, aLoRA, ...) raises instead of guessing. :func:`check_kbit_bd` verifies
the result after ``get_peft_model`` (every LoRA'd k-bit layer runs the BD variant with N-block packed factors).

Adapters trained this way are ordinary BD-LoRA PEFT folders: they load with ``PeftModel.from_pretrained`` on the
unquantized base. To load one onto a k-bit base (inference), call :func:`enable_bdlora_on_kbit` first; without it
PEFT builds dense factors and refuses the packed weights with a size mismatch.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib.util
from typing import Optional

import torch

from bdlora.spec import BDLoraError

#: the bitsandbytes release the project tests (``pip install bdlora[quant]``)
BNB_VERSION = "0.50.2"


class QuantError(BDLoraError):
    """A k-bit (bitsandbytes) setup that cannot train a BD-LoRA adapter; the message says why and what to do."""


def bnb_problem() -> Optional[str]:
    """None when bitsandbytes is importable, else why not (with the install line)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return (f"bitsandbytes is not installed; pip install 'bdlora[quant]' (or pip install --no-deps "
                f"bitsandbytes=={BNB_VERSION})")
    try:
        import bitsandbytes  # noqa: F401
    except Exception as e:  # a broken native library raises many kinds
        return f"bitsandbytes does not import here ({type(e).__name__}: {e})"
    return None


# ---------------------------------------------------------------------------------------------------- the variant
#: the module name PEFT is building a k-bit LoRA layer for (set by the patched __init__, read by the variant's init)
_TARGET_NAME: contextvars.ContextVar[str] = contextvars.ContextVar("bdlora_kbit_target_name", default="")


def _variant_base():
    from peft.tuners.lora.variants import BdLoraLinearVariant

    return BdLoraLinearVariant


def _make_variant_class():
    from peft.tuners.lora.config import BdLoraConfig
    from peft.tuners.lora.variants import BlockDiagonalLinear

    Base = _variant_base()

    class BdLoraKbitVariant(Base):
        """PEFT's ``BdLoraLinearVariant`` for bitsandbytes 4-/8-bit base layers (see the module docstring)."""

        @staticmethod
        def init(module, adapter_name: str, config, **kwargs) -> None:
            use_bdlora = config.use_bdlora
            if isinstance(use_bdlora, dict):  # a saved config
                use_bdlora = BdLoraConfig(**use_bdlora)
            # PEFT's bnb layers drop target_name on the way from their __init__ to update_layer: the patched
            # __init__ keeps it in _TARGET_NAME (an existing layer's update_layer still passes it in kwargs)
            target_name = kwargs.get("target_name") or _TARGET_NAME.get()
            # PEFT's matching rule, unchanged (substring; bdlora validates exact names before PEFT runs)
            on_a = any(p in target_name for p in (use_bdlora.target_modules_bd_a or []))
            on_b = any(p in target_name for p in (use_bdlora.target_modules_bd_b or []))
            if on_a and on_b:
                raise ValueError(f"Target {target_name} matches both A and B block-diagonal patterns")
            if use_bdlora.match_strict and not (on_a or on_b):
                raise ValueError(f"Target {target_name} matches neither A nor B block-diagonal patterns. If this is "
                                 "intentional, set match_strict=False in BdLoraConfig during initialization.")
            base_layer = module.get_base_layer()
            n = use_bdlora.nblocks
            if on_a:
                dense = module.lora_A[adapter_name]  # (r, d_in): its dtype/device, not the base's storage dtype
                module.lora_A[adapter_name] = BlockDiagonalLinear(
                    base_layer.in_features, dense.out_features, nblocks=n, init_zero=False,
                    dtype=dense.weight.dtype, device=dense.weight.device)
            elif on_b:
                dense = module.lora_B[adapter_name]  # (d_out, r)
                module.lora_B[adapter_name] = BlockDiagonalLinear(
                    dense.in_features, base_layer.out_features, nblocks=n, init_zero=True,
                    dtype=dense.weight.dtype, device=dense.weight.device)

        @staticmethod
        def forward(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
            lora_A = module.lora_A[active_adapter]
            lora_B = module.lora_B[active_adapter]
            x = module._cast_input_dtype(module.lora_dropout[active_adapter](x), lora_A.weight.dtype)
            out = lora_B(lora_A(x)) * module.scaling[active_adapter]
            return result + out.to(result.dtype)

        @staticmethod
        def delta_weight(module, adapter: str) -> torch.Tensor:
            """The adapter's (d_out, d_in) weight delta ``s * B_bd @ A_bd`` in fp32 (blocks on the diagonal)."""
            get = Base._get_weight_from_module_maybe_blockdiagonal
            a = get(module.lora_A[adapter]).float()
            b = get(module.lora_B[adapter]).float()
            return (b @ a) * module.scaling[adapter]

        @staticmethod
        def merge_safe(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
            d = BdLoraKbitVariant.delta_weight(module, active_adapter)
            return (orig_weight.float() + d.to(orig_weight.device)).to(orig_weight.dtype)

        @staticmethod
        def merge_unsafe(module, active_adapter: str, orig_weight: torch.Tensor) -> None:
            orig_weight.data = BdLoraKbitVariant.merge_safe(module, active_adapter, orig_weight)

        @staticmethod
        def unmerge(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
            d = BdLoraKbitVariant.delta_weight(module, active_adapter)
            return (orig_weight.float() - d.to(orig_weight.device)).to(orig_weight.dtype)

    return BdLoraKbitVariant


@functools.lru_cache(maxsize=None)
def kbit_variant_class():
    """:class:`BdLoraKbitVariant`, one class per process (built on first use: importing bdlora must not import
    PEFT)."""
    return _make_variant_class()


def _requested_variants(config) -> list[str]:
    """The LoRA variants ``config`` asks for, by PEFT's own rule (``LoraLayer.resolve_lora_variant``)."""
    out = []
    for f in dataclasses.fields(config):
        if f.name == "init_lora_weights":
            out += [v for v in f.metadata.get("lora_variants", ()) if config.init_lora_weights == v]
        elif f.metadata.get("is_lora_variant") and getattr(config, f.name, None):
            out.append(f.name)
    return out


# ---------------------------------------------------------------------------------------------------- the patch
_PATCHED_ATTR = "_bdlora_kbit_patch"


def kbit_lora_classes() -> list[type]:
    """PEFT's LoRA layer classes for bitsandbytes bases (those that exist with the installed bitsandbytes)."""
    if bnb_problem() is not None:
        return []
    from peft.tuners.lora import bnb as peft_bnb

    return [c for c in (getattr(peft_bnb, "Linear4bit", None), getattr(peft_bnb, "Linear8bitLt", None)) if c]


def enable_bdlora_on_kbit() -> list[type]:
    """Make PEFT's bitsandbytes 4-/8-bit LoRA layers build BD-LoRA for ``use_bdlora`` configs (idempotent); returns
    the patched classes. Raises :class:`QuantError` when bitsandbytes is unusable."""
    problem = bnb_problem()
    if problem is not None:
        raise QuantError(problem)
    classes = kbit_lora_classes()
    for cls in classes:
        if getattr(cls.resolve_lora_variant, _PATCHED_ATTR, False):
            continue
        original = cls.resolve_lora_variant

        def resolve_lora_variant(self, *, config, _original=original, **kwargs):
            if not getattr(config, "use_bdlora", None):
                return _original(self, config=config, **kwargs)
            others = [v for v in _requested_variants(config) if v != "use_bdlora"]
            if others:
                raise ValueError(f"{type(self).__name__}: use_bdlora cannot be combined with {others} on a "
                                 "bitsandbytes base (no such variant exists in PEFT)")
            return kbit_variant_class()()

        original_init = cls.__init__

        def __init__(self, *args, _original=original_init, **kwargs):
            token = _TARGET_NAME.set(kwargs.get("target_name") or "")
            try:
                _original(self, *args, **kwargs)
            finally:
                _TARGET_NAME.reset(token)

        setattr(resolve_lora_variant, _PATCHED_ATTR, True)
        resolve_lora_variant.__doc__ = (f"bdlora: use_bdlora -> BdLoraKbitVariant; otherwise PEFT's "
                                        f"{cls.__name__}.resolve_lora_variant.")
        __init__.__doc__ = original_init.__doc__
        cls.resolve_lora_variant = resolve_lora_variant
        cls.__init__ = __init__
    return classes


def is_kbit_linear(module) -> bool:
    """A bitsandbytes 4-bit or 8-bit linear layer (the frozen base of a LoRA layer)."""
    if bnb_problem() is not None:
        return False
    import bitsandbytes as bnb

    return isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))


def check_kbit_bd(peft_model, nblocks: int, adapter: str = "default") -> int:
    """After ``get_peft_model`` on a k-bit base: every LoRA layer has a quantized base, runs the k-bit BD variant and
    carries one packed ``BlockDiagonalLinear`` factor of ``nblocks`` blocks. Returns the number of such layers;
    raises :class:`QuantError` naming the first layer that is not so (never a silent dense fallback)."""
    from peft.tuners.lora.variants import BlockDiagonalLinear

    Variant = kbit_variant_class()
    count = 0
    for name, module in peft_model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or adapter not in lora_a:
            continue
        name = name.removeprefix("base_model.model.")
        base = module.get_base_layer()
        if not is_kbit_linear(base):
            raise QuantError(f"{name}: its base layer is {type(base).__name__}, not quantized; the k-bit load left "
                             "a LoRA target unquantized")
        if nblocks == 1:  # N = 1 is a plain rsLoRA: PEFT's dense k-bit LoRA is the right thing
            count += 1
            continue
        variant = getattr(module, "lora_variant", {}).get(adapter)
        if not isinstance(variant, Variant):
            raise QuantError(f"{name}: PEFT built a {type(variant).__name__ if variant else 'dense'} LoRA on its "
                             f"{type(base).__name__} base instead of BD-LoRA; call bdlora.quant.enable_bdlora_on_kbit() "
                             "before get_peft_model")
        a, b = module.lora_A[adapter], module.lora_B[adapter]
        bd = [f for f in (a, b) if isinstance(f, BlockDiagonalLinear)]
        if len(bd) != 1 or bd[0].nblocks != nblocks:
            raise QuantError(f"{name}: expected exactly one block-diagonal factor of {nblocks} blocks, got "
                             f"lora_A {type(a).__name__}, lora_B {type(b).__name__}")
        f = bd[0]
        if tuple(f.weight.shape) != (f.out_features, f.in_features // nblocks) or not f.weight.is_floating_point():
            raise QuantError(f"{name}: block-diagonal factor has shape {tuple(f.weight.shape)} / dtype "
                             f"{f.weight.dtype}, expected packed ({f.out_features}, {f.in_features // nblocks}) float")
        count += 1
    if count == 0:
        raise QuantError("the model carries no LoRA layer")
    return count


def disable_cpu_inference_packing(model) -> int:
    """bitsandbytes 0.50 on a CPU with AVX512-BF16: a ``Linear4bit`` run in eval mode on an input without grad
    repacks its weight, once and for good, into a CPU inference layout whose matmul (``gemv_4bit``) has no autograd:
    every later training step then silently drops the gradient through the frozen base (all LoRA factors below the
    last layer get wrong gradients), and PEFT's dequantize (merge) reads the repacked bytes as garbage. Training
    evaluates (eval mode) between steps, so on CPU this switches the repacking off; call it right after loading.
    Returns the number of 4-bit layers. A layer already repacked is refused (:class:`QuantError`): bitsandbytes'
    inverse is lossy (absmax rounded to bf16) and, without double quantization, wrong. GPUs are not affected."""
    if bnb_problem() is not None:
        return 0
    import bitsandbytes as bnb

    n = 0
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        if getattr(getattr(module.weight, "quant_state", None), "packing_format_for_cpu", False):
            raise QuantError(f"{name}: bitsandbytes already repacked this 4-bit weight for CPU inference (the model "
                             "ran in eval mode); training on it would drop gradients. Reload the model and call "
                             "disable_cpu_inference_packing before any forward pass")
        module.support_avx512bf16_for_cpu = False
        n += 1
    return n


def dequantized_weight(layer) -> torch.Tensor:
    """The float (d_out, d_in) weight a bitsandbytes 4-/8-bit layer computes with (PEFT's dequantize helper)."""
    from peft.utils.integrations import dequantize_bnb_weight

    w = layer.weight
    state = getattr(w, "quant_state", None) if hasattr(w, "quant_state") else getattr(layer, "state", None)
    return dequantize_bnb_weight(w, state=state)


__all__ = ["BNB_VERSION", "QuantError", "bnb_problem", "check_kbit_bd", "dequantized_weight",
           "disable_cpu_inference_packing", "enable_bdlora_on_kbit", "is_kbit_linear", "kbit_lora_classes",
           "kbit_variant_class"]
