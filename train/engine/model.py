"""The frozen base of a run: the whole model (:func:`load_base`) or one pipeline stage's layers of it
(:func:`load_stage_model`, read from the safetensors files straight onto the stage's device)."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from .scheduler import EngineError


def load_base(path: str | os.PathLike, precision: str = "fp32", device="cpu", attn_implementation=None,
              stage: Optional[tuple[int, int]] = None):
    """The frozen base and its tokenizer, loaded like ``bdlora train`` does (:func:`bdlora.models.load_causal_lm`):
    straight in ``precision``'s dtype (bf16: no fp32 copy), from a folder ``path``.

    ``stage=(s, P)``: only pipeline stage s of P (:func:`load_stage_model`): the model
    is built on the meta device and only that stage's decoder layers (+ the embeddings on the first stage, the final
    norm and LM head on the last) are read from the safetensors files, straight onto ``device``: a stage never holds
    the whole base, on the CPU or on its GPU."""
    from transformers import AutoTokenizer

    from bdlora.models import load_causal_lm, torch_dtype_of

    device = torch.device(device)
    if stage is not None:
        model = load_stage_model(path, torch_dtype_of(precision, device.type), device, attn_implementation, *stage)
    else:
        model = load_causal_lm(path, torch_dtype_of(precision, device.type), attn_implementation)
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.to(device).eval()  # eval(): no base-model dropout, like a frozen base in PEFT
    return model, tok


def load_kbit_base(cfg, path: str | os.PathLike, device):
    """The frozen base quantized to 4 bits by bitsandbytes at load, as ``bdlora train`` loads it for
    ``load_in_4bit`` (``cfg``: a job's TrainConfig, whose run-level quantization keys every job shares), straight onto
    ``device``, and its tokenizer."""
    from transformers import AutoTokenizer

    from ..trainer import load_kbit_base_model

    device = torch.device(device)
    index = (device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else None
    model = load_kbit_base_model(cfg, Path(path), device.type, device_index=index)
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.eval()
    return model, tok


def stage_bounds(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """Even split of ``n_layers`` decoder layers into ``stages`` contiguous ranges (earlier stages get extras)."""
    if stages > n_layers:
        raise ValueError(f"{stages} pipeline stages but the model has only {n_layers} decoder layers")
    base, extra = divmod(n_layers, stages)
    out, lo = [], 0
    for s in range(stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


class _OtherStage(nn.Module):
    """Stands in for a decoder layer that another pipeline stage holds (never materialized here)."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"decoder layer {self.index} lives on another pipeline stage")


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered inside goes to the meta device (no memory, no initialization work: nn.Linear's
    ``reset_parameters`` runs after the registration); buffers are created normally, so the rotary embedding's
    non-persistent ``inv_freq`` is computed as in a normal load."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _rss_bytes() -> Optional[int]:
    """This process's resident set size now (Linux /proc), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _reset_peak_rss() -> bool:
    """Resets this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0: ``/proc/self/clear_refs``), so the
    next :func:`_peak_rss_bytes` is the peak since now; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> Optional[int]:
    """This process's peak resident set size (Linux ``VmHWM``; else getrusage's ``ru_maxrss``, KiB on Linux), or
    None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _checkpoint_index(path: Path) -> dict[str, Path]:
    """{tensor key: safetensors file} of the checkpoint folder: ``model.safetensors.index.json``'s weight map
    (sharded) or the keys of the single ``model.safetensors`` (read from its header only)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            return {k: path / v for k, v in json.load(f)["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise EngineError(f"{path}: a pipeline stage loads its layers from safetensors files, but the folder has "
                          "neither model.safetensors nor model.safetensors.index.json")
    with safe_open(str(single), framework="pt", device="cpu") as f:
        return {k: single for k in f.keys()}


def _module_name(model: nn.Module, target: Optional[nn.Module]) -> Optional[str]:
    if target is None:
        return None
    return next((n for n, m in model.named_modules() if m is target), None)


def load_stage_model(path, dtype: torch.dtype, device, attn_implementation: Optional[str], stage: int,
                     stages: int) -> nn.Module:
    """Pipeline stage ``stage`` of ``stages`` of the causal LM in folder ``path``, holding only what it runs.

    The model is built with its parameters on the meta device; the decoder layers of other stages are replaced by
    placeholders (:class:`_OtherStage`, so this stage's layers keep their module paths ``model.layers.<i>``), the
    input embeddings are dropped on every stage but the first, the final norm (an identity there) and the LM head on
    every stage but the last. Only the remaining parameters are materialized on ``device`` in their built dtype
    (``dtype``), each read by key from the checkpoint's safetensors (``model.safetensors`` or the shards of
    ``model.safetensors.index.json``), one ``safe_open`` per tensor, so the file's memory map never holds more than
    one tensor's pages. A tied LM head (``tie_word_embeddings``) reads the input embeddings' tensor. The stage's
    memory is about 1/``stages`` of the weights (plus the embeddings / head at the ends); what it read is recorded in
    ``model.stage_load`` (keys, bytes read, bytes materialized, the checkpoint's total bytes, the peak RSS growth
    over the load)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    exact = _reset_peak_rss()
    rss0 = _rss_bytes()
    path, device = Path(path), torch.device(device)
    config = AutoConfig.from_pretrained(str(path))
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.config.use_cache = False
    decoder = getattr(model, model.base_model_prefix)
    n_layers = len(decoder.layers)
    lo, hi = stage_bounds(n_layers, stages)[stage]
    first, last = stage == 0, stage == stages - 1
    in_name = _module_name(model, model.get_input_embeddings())
    out_name = _module_name(model, model.get_output_embeddings())
    tied = dict(getattr(model, "_tied_weights_keys", None) or {}) if isinstance(
        getattr(model, "_tied_weights_keys", None), dict) else {}
    if getattr(config, "tie_word_embeddings", False) and in_name and out_name:
        tied.setdefault(f"{out_name}.weight", f"{in_name}.weight")
    for i in range(n_layers):
        if not lo <= i < hi:
            decoder.layers[i] = _OtherStage(i)

    def drop(name):
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, None)

    if not first and in_name:
        drop(in_name)
    if not last:
        decoder.norm = nn.Identity()
        if out_name:
            drop(out_name)

    files = _checkpoint_index(path)
    prefix = model.base_model_prefix + "."

    def key_of(name: str) -> str:
        for k in (name, tied.get(name), name[len(prefix):] if name.startswith(prefix) else None):
            if k is not None and k in files:
                return k
        raise EngineError(f"{path}: pipeline stage {stage}: tensor {name!r} is not in the checkpoint's safetensors")

    keys, read, done = [], 0, {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for leaf, t in list(getattr(mod, kind).items()):
                if t is None:
                    continue
                name = f"{mod_name}.{leaf}" if mod_name else leaf
                if kind == "_buffers":  # buffers were built normally; a persistent one in the checkpoint is read
                    if leaf in mod._non_persistent_buffers_set or name not in files:
                        continue
                elif not t.is_meta:
                    continue
                if id(t) in done:  # tied on this stage: materialized once, shared
                    getattr(mod, kind)[leaf] = done[id(t)]
                    continue
                key = key_of(name)
                with safe_open(str(files[key]), framework="pt", device="cpu") as f:
                    src = f.get_tensor(key)
                    read += src.numel() * src.element_size()
                    # a copy: the safetensors tensor maps the file; the model keeps no view of it
                    val = src.to(device=device, dtype=t.dtype, copy=True)
                    del src
                keys.append(key)
                new = nn.Parameter(val, requires_grad=t.requires_grad) if kind == "_parameters" else val
                getattr(mod, kind)[leaf] = new
                done[id(t)] = new
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise EngineError(f"{path}: pipeline stage {stage}: parameters left unloaded: {left[:5]}")
    model.to(device).eval()
    total = 0
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                total += math.prod(sl.get_shape()) * _SAFETENSORS_BYTES[sl.get_dtype()]
    materialized = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = _peak_rss_bytes()
    model.stage_load = {"stage": stage, "layers": [lo, hi], "keys": keys, "bytes_read": read,
                        "bytes_materialized": materialized, "checkpoint_bytes": total,
                        # the process's peak RSS over the load minus its RSS before (CPU memory; on a GPU the
                        # weights go to the device): exact where the peak could be reset first (Linux
                        # /proc/self/clear_refs), else an upper bound (the peak since the process started); None
                        # off Linux
                        "peak_rss_growth_bytes": peak - rss0 if peak is not None and rss0 is not None else None,
                        "peak_rss_growth_exact": exact}
    return model


_SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                      "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


__all__ = ["load_base", "load_stage_model", "stage_bounds"]
