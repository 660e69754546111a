"""Activation checkpointing of the base's decoder layers, shared by `bdlora train` and `bdlora sweep`: transformers'
own (non-reentrant ``torch.utils.checkpoint``), of every layer or of every n-th one."""

from __future__ import annotations

from .config import ConfigError


def every_n_layers_kwarg(n: int) -> dict:
    """The checkpointing keyword that recomputes only every n-th decoder layer (transformers' own selection), or {}
    for every layer; refused where the installed transformers cannot select layers."""
    if n == 1:
        return {}
    import inspect

    import transformers
    from transformers import PreTrainedModel

    enables = [getattr(PreTrainedModel, m, None) for m in ("activation_checkpointing_enable",
                                                           "gradient_checkpointing_enable")]  # >= 5.24: the first
    if not any(f is not None and "every_n_layers" in inspect.signature(f).parameters for f in enables):
        raise ConfigError(f"gradient_checkpointing_every_n_layers: {n} needs a transformers release whose "
                          "checkpointing takes every_n_layers (this is transformers "
                          f"{transformers.__version__}); upgrade transformers, or leave the key out (every layer)")
    return {"every_n_layers": n}


def checkpoint_decoder_layers(model, every_n_layers: int = 1) -> int:
    """Checkpoints the decoder layers of ``model`` kept in eval mode (the engine's frozen base: no dropout).
    transformers recomputes a layer only while that layer is training, so the checkpointed layers' own ``training``
    flag is set, not their submodules' (attention and MLP stay in eval mode). Returns how many layers recompute."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    # the checkpoint's keyword arguments positionally: their parameter is named after the method (transformers >= 5.24
    # renamed gradient checkpointing to activation checkpointing, keyword included)
    enable({"use_reentrant": False}, **every_n_layers_kwarg(every_n_layers))
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for layer in layers:
        layer.training = True
    return len(layers)


__all__ = ["checkpoint_decoder_layers", "every_n_layers_kwarg"]
