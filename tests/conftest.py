"""Shared fixtures: a tiny random-weight Llama (TP=2 capable) and PEFT-made BD-LoRA adapters on it."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton decides interpreted vs compiled when it is first imported, and test collection imports it early (vLLM,
# the engine): switch the interpreter on here so the kernel tests run Triton on CPU whatever imported it first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """hidden 256, 4 heads, 2 KV heads (q 256, k/v 128 wide), intermediate 512, 2 layers, vocab 512."""
    from bdlora.models import build_random_llama

    return build_random_llama(tmp_path_factory.mktemp("models") / "tiny-llama", init_std=0.05)


def randomize_lora(model, seed: int = 0, std: float = 0.05) -> None:
    """PEFT initializes B to zero; give every LoRA factor random values so the adapter visibly changes outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std)


def make_peft_bd_adapter(model_dir, out_dir, spec, seed: int = 0, std: float = 0.05):
    """Writes a BD-LoRA adapter with PEFT itself (get_peft_model + save_pretrained); returns the PeftModel."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, spec.to_peft_config())
    randomize_lora(model, seed=seed, std=std)
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="session")
def peft_bd_adapter(tiny_llama_dir, tmp_path_factory):
    """A PEFT-written BD-LoRA adapter: nblocks=2, r=8, all seven projections."""
    from bdlora import BDLoraSpec

    out = tmp_path_factory.mktemp("adapters") / "bd-n2-r8"
    make_peft_bd_adapter(tiny_llama_dir, out, BDLoraSpec(nblocks=2, r=8, lora_alpha=16), seed=1)
    return out


@pytest.fixture(scope="session")
def vllm_adapters(tiny_llama_dir, tmp_path_factory):
    """PEFT-written adapters of several ranks and block counts for the vLLM plugin tests: {name: folder}."""
    from peft import LoraConfig

    from bdlora import BDLoraSpec
    from bdlora.vllm_plugin.testing import make_peft_adapter

    root = tmp_path_factory.mktemp("vllm-adapters")
    all7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    configs = {
        "bd2_r8": BDLoraSpec(nblocks=2, r=8, lora_alpha=16).to_peft_config(),
        "bd2_r16": BDLoraSpec(nblocks=2, r=16, lora_alpha=16).to_peft_config(),
        "bd4_r16": BDLoraSpec(nblocks=4, r=16, lora_alpha=16).to_peft_config(),
        "bd1_r8": BDLoraSpec(nblocks=1, r=8, lora_alpha=16).to_peft_config(),
        "bd2_part": BDLoraSpec(nblocks=2, r=8, lora_alpha=16, column_modules=("q_proj", "v_proj"),
                               row_modules=("down_proj",)).to_peft_config(),
        "dense_r8": LoraConfig(r=8, lora_alpha=16, target_modules=all7),
        "dense_r16": LoraConfig(r=16, lora_alpha=16, target_modules=all7),
        "lm_head_r8": LoraConfig(r=8, lora_alpha=16, target_modules=["lm_head"]),  # only the logits' LoRA term
    }
    return {name: make_peft_adapter(tiny_llama_dir, root / name, cfg, seed=i + 1)
            for i, (name, cfg) in enumerate(configs.items())}


#: The modules that take minutes (vLLM engines and servers, the serving benchmarks run for real, the pipeline's
#: process groups), longest first. scripts/test.sh runs pytest-xdist with ``--dist loadfile --no-loadscope-reorder``:
#: every module runs on one worker (the modules whose engine or server is a module-scoped fixture start it once) and
#: modules are handed out in collection order, so these go first and the quick ones fill both workers' ends.
LONG_MODULES = ("test_vllm_plugin_fast_path.py", "test_bench_serve.py", "test_vllm_plugin_errors.py",
                "test_vllm_plugin_tp2.py", "test_engine_pipeline.py", "test_vllm_plugin.py", "test_vllm_plugin_server.py")


@pytest.fixture
def sdpa_backend_flags(monkeypatch):
    """The list that every call of torch's sdpa appends its enabled backends to, as (cudnn, flash, mem_efficient,
    math) flags at the time of the call; the real sdpa still runs."""
    import torch

    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        cuda = torch.backends.cuda
        seen.append((cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
                     cuda.math_sdp_enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    return seen


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_MODULES)))  # stable: a module keeps its order
