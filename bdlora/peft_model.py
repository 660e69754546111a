"""A PEFT model built from a :class:`~bdlora.spec.BDLoraSpec` made a checked, correctly initialised BD-LoRA model:
what ``bdlora train`` does after ``get_peft_model``, public for users who train with their own loop or with TRL's
``SFTTrainer`` (``examples/trl_sft.py``)."""

from __future__ import annotations

import math

import torch

from .layout import COLUMN, ROW
from .spec import BDLoraError, BDLoraSpec


def init_block_a_like_lora(peft_model) -> None:
    """Re-initialize block-diagonal A factors as N independent standard LoRA A's (kaiming-uniform, a=sqrt(5)).

    PEFT's BlockDiagonalLinear draws its packed (r, d_in/N) weight with a=0; a standard LoRA A of one shard,
    (r/N, d_in/N), uses a=sqrt(5). Both have fan-in d_in/N, so one call on the packed weight gives each block the
    distribution of an independent shard LoRA.
    """
    from peft.tuners.lora.variants import BlockDiagonalLinear

    for module in peft_model.modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict):
            continue
        for sub in lora_a.values():
            if isinstance(sub, BlockDiagonalLinear):
                torch.nn.init.kaiming_uniform_(sub.weight, a=math.sqrt(5))


def check_bd_structure(peft_model, spec: BDLoraSpec, expected: dict[str, str]) -> None:
    """After get_peft_model: exactly the expected modules carry LoRA, with the right factor block-diagonal."""
    from peft.tuners.lora.variants import BlockDiagonalLinear

    seen = {}
    for name, module in peft_model.named_modules():
        if isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict) and "default" in module.lora_A:
            a, b = module.lora_A["default"], module.lora_B["default"]
            layout = ROW if isinstance(a, BlockDiagonalLinear) else COLUMN if isinstance(b, BlockDiagonalLinear) else None
            key = name.removeprefix("base_model.model.")
            bd = a if layout == ROW else b if layout == COLUMN else None
            if bd is not None and (bd.nblocks != spec.nblocks or not bd.weight.is_floating_point()
                                   or tuple(bd.weight.shape) != (bd.out_features, bd.in_features // spec.nblocks)):
                raise BDLoraError(f"{key}: block-diagonal factor of {bd.nblocks} blocks, shape "
                                  f"{tuple(bd.weight.shape)}, {bd.weight.dtype}; expected {spec.nblocks} blocks packed "
                                  f"as ({bd.out_features}, {bd.in_features // spec.nblocks}) float")
            seen[key] = layout
    want = dict(expected)
    if spec.nblocks == 1:  # one block: PEFT may or may not wrap a 1-block matrix; layout is moot
        seen = {k: want.get(k) for k in seen}
    if seen != want:
        extra = sorted(set(seen) - set(want))
        missing = sorted(set(want) - set(seen))
        wrong = sorted(k for k in set(seen) & set(want) if seen[k] != want[k])
        raise BDLoraError(f"PEFT built a different adapter than the spec: unexpected {extra[:5]}, missing "
                          f"{missing[:5]}, wrong block-diagonal factor {wrong[:5]}")


def prepare_bd_model(peft_model, spec: BDLoraSpec, a_init: str = "lora"):
    """Checks that PEFT built exactly ``spec``'s adapter on ``peft_model`` (the spec's modules by exact name, the
    right factor block-diagonal with N packed blocks: PEFT matches names by substring) and, with ``a_init="lora"``,
    starts every block-diagonal A like an independent rank r/N LoRA A of its shard. Returns the model; raises
    :class:`~bdlora.spec.BDLoraError` naming what differs."""
    if a_init not in ("lora", "peft"):
        raise BDLoraError(f"a_init: {a_init!r} is not 'lora' or 'peft'")
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    check_bd_structure(peft_model, spec, spec.matching_modules(base))
    if a_init == "lora":
        init_block_a_like_lora(peft_model)
    return peft_model


__all__ = ["check_bd_structure", "init_block_a_like_lora", "prepare_bd_model"]
