"""Liger Kernel (fused RMSNorm, SwiGLU, RoPE and linear cross-entropy Triton kernels) in bdlora's two training
paths: whether a run uses it (the ``use_liger_kernel`` key: unset = where it can run) and, for the multi-LoRA
engine, applying it to the loaded base. ``bdlora train`` hands the decision to transformers' own integration
(``TrainingArguments.use_liger_kernel``); the engine runs its own packed forward and loss, so it patches the base's
RMSNorm, SwiGLU and RoPE itself and keeps its per-job cross-entropy over response tokens."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Optional

from .config import ConfigError


def liger_decision(requested: Optional[bool], model_type: Optional[str], on_gpu: bool,
                   unsupported: Optional[str] = None) -> tuple[bool, str]:
    """(use Liger, why) for ``use_liger_kernel: requested`` (None = auto) on a model of ``model_type``;
    ``unsupported``: a reason of the caller's why this run cannot use it (a k-bit base, pipeline stages). ``true``
    where it cannot run is a ConfigError naming what is missing."""
    why_not = None
    if not on_gpu:
        why_not = "no GPU (Liger's kernels are Triton GPU kernels)"
    elif importlib.util.find_spec("liger_kernel") is None:
        why_not = "liger-kernel is not installed (pip install liger-kernel)"
    elif unsupported:
        why_not = unsupported
    else:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            why_not = f"liger-kernel has no kernels for model type {model_type!r}"
    if requested is False:
        return False, "off (use_liger_kernel: false)"
    if why_not is None:
        return True, "on" + ("" if requested else " (auto)")
    if requested:
        raise ConfigError(f"use_liger_kernel: true, but {why_not}; install it / use a GPU, or drop the key (auto)")
    return False, f"off (auto: {why_not})"


def folder_model_type(folder) -> Optional[str]:
    """The ``model_type`` of a model folder's config.json (None where it cannot be read): what decides before the
    weights load."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def apply_liger_to_base(model) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE on ``model`` (a loaded transformers causal LM whose type
    :func:`liger_decision` accepted), through liger-kernel's own per-architecture function. Its cross-entropy
    kernels stay off: the engine computes each job's loss over its response tokens itself."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    try:
        MODEL_TYPE_TO_APPLY_LIGER_FN[model.config.model_type](
            model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
    except Exception as e:  # a layout liger-kernel's function does not expect: say so instead of a traceback
        raise ConfigError(f"use_liger_kernel: liger-kernel could not patch this {model.config.model_type} model "
                          f"({type(e).__name__}: {e}); set use_liger_kernel: false") from None
