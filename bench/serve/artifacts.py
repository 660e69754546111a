"""What the serving benchmark serves: random-weight Llamas of real shapes and random-weight LoRA / BD-LoRA adapters.

Latency does not depend on weight values when every request generates exactly OT tokens (``ignore_eos``), so
weights are random. Two ways to get a model folder:

* ``weights: random`` — :func:`bdlora.models.build_random_llama` writes a full safetensors checkpoint (built on the
  GPU when ``build_device: cuda``: an 8B shape takes seconds to initialise, plus the disk write);
* ``weights: dummy`` — only ``config.json`` + tokenizer are written and the server runs with
  ``--load-format dummy`` (vLLM initialises random weights itself). Same kernels, same shapes, no 16 GB (8B) /
  140 GB (70B) checkpoint to write and read: the way to fit a sweep into a 10-minute GPU call.

Either way the tokenizer is a 32k byte-level BPE trained here (:func:`build_tokenizer_32k`), so prompts of random
token ids look like a real vocabulary's.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

COLUMN_MODULES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_MODULES = ("o_proj", "down_proj")
ALL_MODULES = COLUMN_MODULES + ROW_MODULES

#: vLLM's accepted ``--max-lora-rank`` values (vllm/config/lora.py MaxLoRARanks, 0.26 - 0.32)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of every LoRA target projection."""
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        return {
            "q_proj": (h, self.num_heads * hd), "k_proj": (h, self.num_kv_heads * hd),
            "v_proj": (h, self.num_kv_heads * hd), "o_proj": (self.num_heads * hd, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }


SHAPES: dict[str, Shape] = {
    # bdlora.models.build_random_llama's default (the tests' TP=2-capable model)
    "tiny": Shape(256, 2, 4, 2, 512, 512, 2048),
    # Llama-3.1-8B / 70B layer shapes with a 32k vocabulary (the anchors' setup)
    "llama8b": Shape(4096, 32, 32, 8, 14336, 32000),
    "llama70b": Shape(8192, 80, 64, 8, 28672, 32000),
}


def shape_from(cfg: dict) -> Shape:
    name = cfg.get("shape", "tiny")
    base = SHAPES[name] if name in SHAPES else None
    fields = {k: cfg[k] for k in Shape.__dataclass_fields__ if k in cfg}
    if base is None:
        if len(fields) < 6:
            raise ValueError(f"unknown shape {name!r} (known: {sorted(SHAPES)}); or give all of "
                             f"{list(Shape.__dataclass_fields__)}")
        return Shape(**fields)
    return Shape(**{**base.__dict__, **fields})


# ----------------------------------------------------------------------------------------------------------------
# tokenizer and model


def _corpus(n_lines: int = 20000, seed: int = 0):
    """Synthetic text with a Zipf-ish word distribution: enough distinct pairs for a 32k BPE."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    pool = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(60000)]
    for _ in range(n_lines):
        words = []
        for _ in range(rng.randint(8, 24)):
            if rng.random() < 0.3:
                words.append(pool[min(int(rng.paretovariate(0.7)) - 1, len(pool) - 1)])
            else:
                words.append(rng.choice(pool))
        yield " ".join(words)


def build_tokenizer_32k(path: str | Path, vocab_size: int = 32000):
    """A byte-level BPE of exactly ``vocab_size`` tokens (if the corpus allows), saved as a transformers folder."""
    from bdlora.models import build_tokenizer

    return build_tokenizer(path, vocab_size=vocab_size, corpus=_corpus())


def model_dir_for(root: str | Path, shape_name: str, shape: Shape, dtype: str, weights: str) -> Path:
    tag = f"{shape_name}-h{shape.hidden_size}-l{shape.num_layers}-{dtype}-{weights}"
    return Path(root) / tag


def build_model(root: str | Path, shape_name: str, shape: Shape, dtype: str = "bfloat16", weights: str = "random",
                build_device: str = "cpu", tokenizer_vocab: Optional[int] = None) -> Path:
    """Builds (once; cached by shape/dtype/weights) a model folder vLLM can serve; returns its path."""
    import torch
    from transformers import LlamaConfig

    from bdlora.adapter import atomic_output_dir
    from bdlora.models import build_random_llama

    path = model_dir_for(root, shape_name, shape, dtype, weights)
    if (path / "config.json").is_file() and (path / "tokenizer_config.json").is_file():
        return path
    tok_vocab = tokenizer_vocab or shape.vocab_size
    if weights == "random":
        # build_random_llama creates the module with torch's current default device/dtype: build on the GPU in
        # the target dtype when asked (an 8B shape then takes seconds instead of minutes of CPU init).
        old_dtype = torch.get_default_dtype()
        try:
            if build_device != "cpu":
                torch.set_default_dtype(getattr(torch, dtype))
            with torch.device(build_device):
                build_random_llama(path, hidden_size=shape.hidden_size, num_layers=shape.num_layers,
                                   num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                                   intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size,
                                   max_position_embeddings=shape.max_position_embeddings, dtype=dtype,
                                   tokenizer=tok_vocab == 512)
        finally:
            torch.set_default_dtype(old_dtype)
        if tok_vocab != 512:
            build_tokenizer_32k(path, vocab_size=tok_vocab)
    elif weights == "dummy":
        with atomic_output_dir(path) as tmp:
            config = LlamaConfig(hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers,
                                 num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                                 intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size,
                                 max_position_embeddings=shape.max_position_embeddings, tie_word_embeddings=False,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype=dtype,
                                 architectures=["LlamaForCausalLM"])
            config.save_pretrained(str(tmp))
            build_tokenizer_32k(tmp, vocab_size=tok_vocab)
    else:
        raise ValueError(f"weights must be 'random' or 'dummy', got {weights!r}")
    return path


# ----------------------------------------------------------------------------------------------------------------
# adapters


def matched_bd_rank(r: int, shape: Shape, nblocks: int) -> int:
    """BD rank with the trainable parameters of standard LoRA rank r (paper Table 1), rounded to a multiple of N."""
    from bdlora.spec import matched_lora_rank

    exact = matched_lora_rank(r, shape.hidden_size, shape.intermediate_size, nblocks)
    return max(nblocks, nblocks * round(exact / nblocks))


def vllm_max_lora_rank(r: int, allowed=VLLM_MAX_LORA_RANKS) -> Optional[int]:
    """Smallest ``--max-lora-rank`` value vLLM accepts that holds rank r (None if none does)."""
    for a in sorted(allowed):
        if a >= r:
            return a
    return None


def adapter_num_params(shape: Shape, r: int, nblocks: Optional[int], modules=ALL_MODULES) -> int:
    """Trainable parameters of a standard (nblocks None) or packed BD-LoRA adapter on every layer."""
    total = 0
    for name, (d_in, d_out) in shape.module_dims().items():
        if name not in modules:
            continue
        if nblocks is None:
            total += r * (d_in + d_out)
        elif name in COLUMN_MODULES:
            total += r * d_in + d_out * (r // nblocks)
        else:
            total += r * (d_in // nblocks) + d_out * r
    return total * shape.num_layers


def make_adapter(path: str | Path, shape: Shape, r: int, nblocks: Optional[int] = None, dtype: str = "bfloat16",
                 seed: int = 0, lora_alpha: float = 16.0, base_model: Optional[str] = None,
                 modules=ALL_MODULES, std: float = 0.01) -> Path:
    """A random-weight PEFT folder on every layer's projections: dense LoRA (rsLoRA) or BD-LoRA
    (:meth:`bdlora.BDLoraSpec.to_peft_config` layout, packed factors) when ``nblocks`` is given. Cached."""
    import torch
    from peft import LoraConfig

    from bdlora.adapter import Adapter, AdapterConfig, _jsonable, save_adapter
    from bdlora.layout import LoraFactors, packed_shapes
    from bdlora.spec import BDLoraSpec

    path = Path(path)
    if (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file():
        return path
    cols = tuple(m for m in COLUMN_MODULES if m in modules)
    rows = tuple(m for m in ROW_MODULES if m in modules)
    if nblocks is None:
        raw = LoraConfig(r=r, lora_alpha=lora_alpha, use_rslora=True, target_modules=list(cols + rows),
                         task_type="CAUSAL_LM", base_model_name_or_path=base_model).to_dict()
        cfg = AdapterConfig.from_dict(_jsonable(raw))
    else:
        spec = BDLoraSpec(nblocks=nblocks, r=r, lora_alpha=lora_alpha, column_modules=cols, row_modules=rows)
        cfg = AdapterConfig.from_spec(spec, base_model_name_or_path=base_model)
    gen = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)
    mods = {}
    dims = shape.module_dims()
    for layer in range(shape.num_layers):
        for name in cols + rows:
            d_in, d_out = dims[name]
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            layout = None
            if nblocks is None:
                a_shape, b_shape = (r, d_in), (d_out, r)
            else:
                layout = "column" if name in cols else "row"
                a_shape, b_shape = packed_shapes(layout, d_in, d_out, r, nblocks)
            a = (torch.randn(a_shape, generator=gen) * std).to(tdtype)
            b = (torch.randn(b_shape, generator=gen) * std).to(tdtype)
            mods[key] = LoraFactors(a, b, layout, nblocks or 1, cfg.scale)
    save_adapter(Adapter(cfg, mods), path)
    return path


def adapter_meta(path: str | Path) -> dict:
    cfg = json.loads((Path(path) / "adapter_config.json").read_text())
    bd = cfg.get("use_bdlora") or {}
    return {"r": cfg["r"], "nblocks": bd.get("nblocks"), "lora_alpha": cfg["lora_alpha"],
            "use_rslora": cfg.get("use_rslora")}


__all__ = ["SHAPES", "Shape", "VLLM_MAX_LORA_RANKS", "adapter_num_params", "build_model", "build_tokenizer_32k",
           "make_adapter", "matched_bd_rank", "shape_from", "vllm_max_lora_rank"]
