"""Checks that run where a request or a ``/v1/load_lora_adapter`` call arrives (the front-end process).

An exception raised inside a vLLM worker kills the engine and the caller only sees ``EngineDeadError``, so every
adapter is checked here first, from its ``adapter_config.json`` and the safetensors *header* (no tensor is read):
a bad adapter gets a clear :class:`~bdlora.spec.BDLoraError` (a ``ValueError``) and the server keeps serving.

Nothing here imports vLLM; it only reads attributes of the ``VllmConfig`` it is given.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

from bdlora.adapter import (CONFIG_NAME, PEFT_A_SUFFIX, PEFT_B_SUFFIX, WEIGHTS_NAME, AdapterConfig, check_factor_shapes,
                            check_supported_features, check_tensor_names, module_paths, read_config)
from bdlora.layout import COLUMN, ROW, packed_shapes
from bdlora.moe import PEFT_TARGET_PARAMETERS, expert_module_suffixes
from bdlora.sharding import check_tp_compatible
from bdlora.spec import PRESETS, BDLoraError, serving_layout

from .fast_path import FastPathOptions

logger = logging.getLogger("bdlora.vllm_plugin")

#: ``additional_config`` key that switches BD mode on: ``True`` or a dict of :class:`BDOptions` fields.
CONFIG_KEY = "bdlora"
#: The former key of the opt-in kernel experiments, now the default of BD mode: ``false`` still turns bdlora's
#: kernels off (as ``{"bdlora": {"kernels": false}}``), other values are ignored with a warning.
LEGACY_KERNELS_KEY = "bdlora_fused_decode"
PEFT_PREFIX = "base_model.model."

SUPPORTED_VLLM = ("0.26.0", "0.34")  # [lo, hi): every touch point checked on 0.26, 0.32, 0.33 (vllm_api.py)


# ----------------------------------------------------------------------------------------------- engine settings


@dataclass(frozen=True)
class BDOptions:
    """BD mode settings read from ``additional_config["bdlora"]``.

    ``min_nblocks``: the smallest nblocks (dense adapters count as 1) the server must hold when nblocks is below the
    tensor-parallel degree. The per-device LoRA buffers have rank ``max_lora_rank / min(min_nblocks, tp)``; the
    default (``min_nblocks = tp``) makes them exactly ``1/tp`` of stock vLLM's.

    ``max_rank``: the largest adapter rank r the server holds, where it is below ``--max-lora-rank`` (which vLLM
    takes only from 1, 8, 16, 32, 64, 128, 256, 320, 512): the buffers then hold ``max_rank / min(min_nblocks, tp)``
    ranks, rounded up to a multiple of ``DEVICE_RANK_MULTIPLE``, instead of ``max_lora_rank``'s share. A BD adapter of
    r=152 at TP=4 (the parameter-matched rank of an r=64 LoRA on Llama-3.1-8B) needs ``--max-lora-rank 256``: 64 rows
    per GPU, 26 of them zeros; with ``max_rank`` 152, 48: a quarter less LoRA memory per slot (the kernels take the
    same time at 48 as at 64: BENCHMARKS.md, "bdlora.max_rank").

    ``kernels``: how the BD layers pick their kernels (:class:`bdlora.vllm_plugin.fast_path.FastPathOptions`); None
    (``"kernels": false``) runs vLLM's punica kernels for every size. The default is bdlora's kernels by token
    count, from the device's tuning file; ``{"backend": "torch", "tuning": {...}}`` replaces the backend or tuning
    keys (kernel work and tests).
    """

    min_nblocks: Optional[int] = None
    max_rank: Optional[int] = None
    kernels: Optional[FastPathOptions] = FastPathOptions()


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _config_switch(vllm_config: Any, key: str, known: tuple, example: str, int_key: Optional[str] = None
                   ) -> Optional[dict]:
    """``additional_config[key]`` as None (off: absent, false, "off", {"enabled": false}), {} (on with defaults:
    true, "on") or the dict of its settings, whose keys must be in ``known``; ``int_key``: a bare integer means
    ``{int_key: value}``."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    value = extra.get(key) if isinstance(extra, dict) else None
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, str) and value.lower() in _ON + _OFF:
        return {} if value.lower() in _ON else None
    if int_key and isinstance(value, int):
        value = {int_key: value}
    if not isinstance(value, dict):
        raise BDLoraError(f"additional_config['{key}'] must be true or a dict like {example}, got {value!r}")
    if not value.get("enabled", True):
        return None
    unknown = set(value) - {"enabled", *known}
    if unknown:
        raise BDLoraError(f"additional_config['{key}'] has unknown keys {sorted(unknown)}; "
                          f"known: {', '.join(repr(k) for k in ('enabled', *known))}")
    return {k: v for k, v in value.items() if k != "enabled"}


def bd_options(vllm_config: Any) -> Optional[BDOptions]:
    """The BD options of an engine config, or None when BD mode is off."""
    value = _config_switch(vllm_config, CONFIG_KEY, ("min_nblocks", "max_rank", "kernels"), "{'min_nblocks': 1}")
    if value is None:
        return None
    for key in ("min_nblocks", "max_rank"):
        v = value.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise BDLoraError(f"additional_config['bdlora']['{key}'] must be a positive integer, got {v!r}")
    kernels = value.get("kernels", True)
    legacy = _legacy_kernels(vllm_config)
    if legacy is not None and "kernels" not in value:
        kernels = legacy
    return BDOptions(min_nblocks=value.get("min_nblocks"), max_rank=value.get("max_rank"),
                     kernels=_kernel_options(kernels))


def _kernel_options(value: Any) -> Optional[FastPathOptions]:
    """``additional_config['bdlora']['kernels']`` checked: true (the device's tuning), false (vLLM's kernels) or a
    dict of ``backend`` and ``tuning``."""
    where = "additional_config['bdlora']['kernels']"
    if value is True:
        return FastPathOptions()
    if value is False:
        return None
    if not isinstance(value, dict) or set(value) - {"backend", "tuning"}:
        raise BDLoraError(f"{where} must be true, false or a dict of 'backend' (auto | triton | torch) and 'tuning' "
                          f"(a dict of ServingTuning keys), got {value!r}")
    backend = value.get("backend", "auto")
    if backend not in ("auto", "triton", "torch"):
        raise BDLoraError(f"{where}['backend'] must be auto, triton or torch, got {backend!r}")
    tuning = value.get("tuning") or {}
    if not isinstance(tuning, dict):
        raise BDLoraError(f"{where}['tuning'] must be a dict of ServingTuning keys, got {tuning!r}")
    if tuning:
        from .fast_path.tuning import ServingTuning  # noqa: PLC0415 - kernel tile checks, only when a tuning is given

        try:
            ServingTuning.from_dict(tuning)
        except (TypeError, ValueError) as e:
            raise BDLoraError(f"{where}['tuning']: {e}") from None
    return FastPathOptions(backend=backend, tuning=tuple(sorted((k, _frozen(v)) for k, v in tuning.items())))


def _legacy_kernels(vllm_config: Any) -> Any:
    """What the former ``bdlora_fused_decode`` key still means: false turns the kernels off; a dict of mode "auto"
    carries its backend and tuning; None: absent or without meaning now (validate_engine_config warns)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    value = extra.get(LEGACY_KERNELS_KEY) if isinstance(extra, dict) else None
    if value is False:
        return False
    if isinstance(value, dict) and value.get("mode") == "auto":
        return {k: v for k, v in value.items() if k in ("backend", "tuning")}
    return None


def _frozen(v):
    return tuple(_frozen(x) for x in v) if isinstance(v, (list, tuple)) else v


def tp_size_of(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)


#: ``max_rank``'s per-device buffer rank is rounded up to this. Triton specializes integer arguments divisible by 16,
#: so at such a rank the kernels' B rows and rank masks load as vectors; at 40 or 24 (multiples of 8 only) they load
#: element by element, and the expand took up to 2 us more per call than at 64 (H200, 4 slots).
DEVICE_RANK_MULTIPLE = 16


def device_rank(max_lora_rank: int, tp_size: int, min_nblocks: Optional[int] = None,
                max_rank: Optional[int] = None) -> int:
    """Rank of the per-device LoRA buffers in BD mode.

    An adapter of rank r with N blocks holds ``r / min(N, M)`` ranks on each of the M devices (M | N: N/M whole
    blocks; N | M: one block, shared). With ``max_lora_rank`` the largest r and ``min_nblocks`` the smallest N
    served, that is at most ``max_lora_rank / min(min_nblocks, M)``; with ``max_rank`` (BDOptions) the largest r
    instead, ``max_rank / min(min_nblocks, M)`` rounded up to a multiple of ``DEVICE_RANK_MULTIPLE``, never above
    max_lora_rank's share.
    """
    m = min(min_nblocks or tp_size, tp_size)
    share = max(1, math.ceil(max_lora_rank / m))
    if max_rank is None:
        return share
    own = math.ceil(math.ceil(max_rank / m) / DEVICE_RANK_MULTIPLE) * DEVICE_RANK_MULTIPLE
    return min(share, own)


def local_rank_of(r: int, nblocks: int, tp_size: int) -> int:
    """Ranks of an (r, nblocks) adapter held by one of ``tp_size`` devices."""
    return r // min(nblocks, tp_size)


def engine_device_rank(vllm_config: Any) -> int:
    opts = bd_options(vllm_config) or BDOptions()
    return device_rank(vllm_config.lora_config.max_lora_rank, tp_size_of(vllm_config), opts.min_nblocks,
                       opts.max_rank)


def check_vllm_version(version: Optional[str] = None) -> str:
    """Raises a clear error outside the supported vLLM range; returns the version."""
    from packaging.version import Version

    if version is None:
        import vllm

        version = getattr(vllm, "__version__", "0")
    lo, hi = SUPPORTED_VLLM
    v = Version(version)
    if not (Version(lo) <= Version(v.base_version) < Version(hi)):
        if os.environ.get("BDLORA_ALLOW_UNSUPPORTED_VLLM") == "1":
            return version
        raise BDLoraError(
            f"bdlora's vLLM plugin supports vLLM {lo} <= version < {hi}, found {version}. Install a supported vLLM "
            f"(`pip install 'vllm>={lo},<{hi}'`), or set BDLORA_ALLOW_UNSUPPORTED_VLLM=1 to try anyway"
        )
    return version


def validate_engine_config(vllm_config: Any) -> None:
    """Refuses BD mode settings that cannot work, before any engine process starts."""
    opts = bd_options(vllm_config)
    extra = getattr(vllm_config, "additional_config", None) or {}
    if isinstance(extra, dict) and extra.get(LEGACY_KERNELS_KEY) not in (None, False) \
            and _legacy_kernels(vllm_config) is None:
        logger.warning("additional_config '%s' (--bdlora-fused-decode, --bdlora-fold-shrink) is ignored: "
                       "--enable-bdlora picks bdlora's kernels per token count by default; "
                       "{'bdlora': {'kernels': false}} runs vLLM's instead", LEGACY_KERNELS_KEY)
    if opts is None:
        return
    check_vllm_version()
    lora = getattr(vllm_config, "lora_config", None)
    if lora is None:
        raise BDLoraError("--enable-bdlora (additional_config={'bdlora': True}) needs LoRA: add --enable-lora "
                          "(LLM(..., enable_lora=True))")
    if getattr(lora, "fully_sharded_loras", False):
        raise BDLoraError("--enable-bdlora and --fully-sharded-loras exclude each other: BD-LoRA shards the adapter "
                          "itself and needs no LoRA communication; drop --fully-sharded-loras")
    max_lora_rank = int(getattr(lora, "max_lora_rank", 0) or 0)
    if opts.max_rank is not None and max_lora_rank and opts.max_rank > max_lora_rank:
        raise BDLoraError(f"additional_config['bdlora']['max_rank'] {opts.max_rank} is above --max-lora-rank "
                          f"{max_lora_rank}; vLLM refuses adapters above --max-lora-rank, so raise it to at least "
                          f"{opts.max_rank} (one of vLLM's values) or lower max_rank")


# ----------------------------------------------------------------------------------------------- adapter checks

# Header reads of the API process, keyed by path (and the files' size and mtime for adapters): every engine of the
# process would read the same bytes, so they are shared by the process, bounded, behind one lock.
_cache_lock = threading.Lock()
_model_keys_cache: dict[str, Optional[dict]] = {}  # model folder -> parameter shapes (headers)
_adapter_cache: dict[tuple, Optional[BDLoraError]] = {}  # (folder, file stats, engine facts) -> refusal or None


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _model_weights(model_path: str) -> Optional[dict]:
    """{parameter name: shape or None} of a local safetensors checkpoint (headers only; shape None for non-float
    tensors such as packed quantized weights, whose stored shape is not the layer's); None when not local."""
    with _cache_lock:
        if model_path in _model_keys_cache:
            return _model_keys_cache[model_path]
    weights: Optional[dict] = None
    if model_path and os.path.isdir(model_path):
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
        if files:
            from safetensors import safe_open

            weights = {}
            for fn in files:
                with safe_open(fn, framework="pt") as f:
                    for k in f.keys():
                        sl = f.get_slice(k)
                        weights[k] = tuple(sl.get_shape()) if sl.get_dtype() in _FLOAT_DTYPES else None
    with _cache_lock:
        _model_keys_cache[model_path] = weights
    return weights


def _model_weight_names(model_path: str) -> Optional[frozenset]:
    """Parameter names of a local safetensors checkpoint (headers only); None when not local."""
    weights = _model_weights(model_path)
    return None if weights is None else frozenset(weights)


def config_module_shapes(text_config: Any) -> dict:
    """{projection leaf: (d_out, d_in)} of a dense Llama-like decoder from its config (q/k/v/o, gate/up/down), used
    when the checkpoint is not a local folder; {} when the config lacks the sizes."""
    h = getattr(text_config, "hidden_size", None)
    inter = getattr(text_config, "intermediate_size", None)
    nh = getattr(text_config, "num_attention_heads", None)
    if not (h and inter and nh):
        return {}
    nkv = getattr(text_config, "num_key_value_heads", None) or nh
    hd = getattr(text_config, "head_dim", None) or h // nh
    q, kv = nh * hd, nkv * hd
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def _stat(path: str) -> tuple:
    try:
        st = os.stat(path)
        return (st.st_mtime_ns, st.st_size)
    except OSError:
        return (None, None)


@dataclass(frozen=True)
class EngineFacts:
    """What adapter validation needs to know about the engine (hashable, for caching)."""

    bd: bool
    tp_size: int
    max_lora_rank: int
    device_rank: int
    model_path: str
    model_type: str
    num_kv_heads: Optional[int]
    config_shapes: tuple = ()  # ((leaf, (d_out, d_in)), ...) from the model config (config_module_shapes)
    bd_max_rank: Optional[int] = None  # additional_config bdlora.max_rank

    @classmethod
    def of(cls, vllm_config: Any) -> "EngineFacts":
        opts = bd_options(vllm_config)
        tp = tp_size_of(vllm_config)
        lora = getattr(vllm_config, "lora_config", None)
        max_rank = int(getattr(lora, "max_lora_rank", 0) or 0)
        mc = vllm_config.model_config
        hf = getattr(mc, "hf_config", None)
        text = hf.get_text_config() if hf is not None and hasattr(hf, "get_text_config") else hf
        kv = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
        return cls(
            bd=opts is not None, tp_size=tp, max_lora_rank=max_rank,
            device_rank=device_rank(max_rank, tp, opts.min_nblocks, opts.max_rank) if (opts and max_rank) else max_rank,
            bd_max_rank=opts.max_rank if opts else None,
            model_path=str(getattr(mc, "model", "") or ""), model_type=str(getattr(text, "model_type", "") or ""),
            num_kv_heads=int(kv) if kv else None,
            config_shapes=tuple(sorted(config_module_shapes(text).items())) if text is not None else (),
        )


class AdapterNotFound(BDLoraError):
    """The adapter path does not exist (HTTP 404). The message contains vLLM's own not-found sentence
    (``LoRAAdapterNotFoundError``: "Loading lora NAME failed: No adapter found for PATH"), which vLLM's
    ``/v1/load_lora_adapter`` handler maps to 404 by itself."""


def not_found_message(name: Optional[str], lora_path: str) -> str:
    return f"Loading lora {name} failed: No adapter found for {lora_path}"


def resolve_adapter_path(lora_path: str, name: Optional[str] = None) -> Optional[str]:
    """The absolute folder of a local adapter; None for a Hugging Face hub id (the workers resolve and check those).

    Raises :class:`AdapterNotFound` for a local path that does not exist (absolute, ``~``, ``./``, ``../`` or with
    more than one ``/``, which no hub id has) and :class:`BDLoraError` for a path that is not an adapter folder."""
    if not lora_path:
        return None
    expanded = os.path.expanduser(lora_path)
    p = os.path.abspath(expanded)
    if os.path.exists(expanded):
        if not os.path.isdir(p):
            raise BDLoraError(f"{p} is a file; expected the adapter's folder (holding {CONFIG_NAME} and "
                              f"{WEIGHTS_NAME})")
        if not os.path.isfile(os.path.join(p, CONFIG_NAME)):
            raise BDLoraError(f"{p}: no {CONFIG_NAME}; expected a PEFT LoRA adapter folder")
        return p
    local = (os.path.isabs(expanded) or lora_path.startswith(("~", "./", "../")) or lora_path in (".", "..")
             or lora_path.strip("/").count("/") > 1)
    if local:
        raise AdapterNotFound(f"{not_found_message(name, lora_path)} (no such folder: {p})")
    return None


def local_adapter_dir(lora_path: str) -> Optional[str]:
    """The folder of a local adapter, or None (hub ids are resolved, and checked, by the workers)."""
    if not lora_path:
        return None
    p = os.path.abspath(os.path.expanduser(lora_path))
    return p if os.path.isfile(os.path.join(p, CONFIG_NAME)) else None


def refuse_bd_without_mode(cfg: AdapterConfig, path: str) -> None:
    if cfg.is_bd:
        raise BDLoraError(
            f"adapter {path} is a BD-LoRA adapter (use_bdlora, nblocks={cfg.nblocks}) but this vLLM engine runs "
            "without BD-LoRA support, so it would compute wrong outputs from the packed factors. Start vLLM with "
            "--enable-lora --enable-bdlora (`bdlora serve MODEL` does that), or in Python "
            "LLM(..., enable_lora=True, additional_config={'bdlora': True}); or convert the adapter to a standard one "
            "with `bdlora convert to-dense`"
        )


def validate_adapter(lora_path: str, vllm_config: Any, name: Optional[str] = None) -> Optional[AdapterConfig]:
    """Checks an adapter folder against an engine config; raises :class:`BDLoraError` (a ``ValueError``: the
    client's error, HTTP 400) or :class:`AdapterNotFound` (HTTP 404) whose message names the adapter, its folder
    and the file at fault.

    Returns the adapter config (None for hub adapters, which the workers check when they load them).
    """
    label = f"LoRA adapter {name!r}" if name else "LoRA adapter"
    try:
        path = resolve_adapter_path(lora_path, name)
    except AdapterNotFound:
        raise
    except BDLoraError as e:
        raise BDLoraError(f"{label} refused: {e}") from None
    if path is None:
        return None
    facts = EngineFacts.of(vllm_config)
    key = (path, _stat(os.path.join(path, CONFIG_NAME)), _stat(os.path.join(path, WEIGHTS_NAME)), facts)
    with _cache_lock:
        cached = _adapter_cache.get(key, False)
    if cached is False:
        try:
            _check_adapter(path, facts)
            cached = None
        except BDLoraError as e:
            cached = e
        except Exception as e:  # never a bare library message: name the folder
            cached = BDLoraError(f"{path}: {type(e).__name__}: {e}")
        with _cache_lock:
            if len(_adapter_cache) > 4096:
                _adapter_cache.clear()
            _adapter_cache[key] = cached
    if cached is not None:
        msg = str(cached)
        where = "" if path in msg else f" ({path})"
        raise BDLoraError(f"{label}{where} refused: {msg}")
    return read_config(path)


def _read_config(path: str) -> AdapterConfig:
    """The adapter config; errors start with the file's name (the OpenAI server strips paths from messages)."""
    try:
        return read_config(path)
    except BDLoraError as e:
        if str(e).startswith(CONFIG_NAME):
            raise
        raise BDLoraError(f"{CONFIG_NAME}: {e}") from None
    except Exception as e:  # JSONDecodeError, UnicodeDecodeError, OSError
        raise BDLoraError(f"{CONFIG_NAME} in {path}: cannot be read as a PEFT adapter config ({type(e).__name__}: "
                          f"{e}); the file is truncated or corrupt, re-save the adapter") from None


def _read_header(weights: str) -> dict:
    """{tensor name: shape} from a safetensors header; a clear error naming the file when it is not readable."""
    from safetensors import safe_open

    try:
        with safe_open(weights, framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # SafetensorError ("incomplete metadata, file not fully covered"), OSError
        raise BDLoraError(f"{os.path.basename(weights)} in {os.path.dirname(weights)}: not a readable safetensors "
                          f"file ({type(e).__name__}: {e}); it is truncated or corrupt (an interrupted copy or save?), "
                          "re-save or re-copy the adapter") from None


def _check_model_shapes(path: str, cfg: AdapterConfig, shapes: dict, paths: list, facts: EngineFacts) -> None:
    """Every factor against the served model's own layer shapes: full (d_out, d_in) per module from the checkpoint
    header (or, for a hub model, from its config), then the per-device shards at the engine's tensor-parallel size.
    """
    weights = _model_weights(facts.model_path)
    conf = dict(facts.config_shapes)
    n = (cfg.nblocks or 1) if cfg.is_bd else 1
    m = facts.tp_size
    for p in paths:
        inner = p[len(PEFT_PREFIX):] if p.startswith(PEFT_PREFIX) else p
        leaf = inner.rsplit(".", 1)[-1]
        a, b = shapes[p + PEFT_A_SUFFIX], shapes[p + PEFT_B_SUFFIX]
        if len(a) != 2 or len(b) != 2:
            raise BDLoraError(f"{WEIGHTS_NAME}: {inner}: lora_A {a} / lora_B {b} are not matrices")
        layout = cfg.layout_of(p)
        d_in, d_out = a[1] * (n if layout == ROW else 1), b[0]
        want = None
        if weights is not None:
            w = weights.get(inner + ".weight", weights.get(p + ".weight"))
            want = tuple(w) if w is not None and len(w) == 2 else None
        elif "expert" not in inner:
            want = conf.get(leaf)
        if want is not None and (d_out, d_in) != want:
            r = cfg.r
            ea, eb = ((r, want[1]), (want[0], r)) if layout is None else packed_shapes(layout, want[1], want[0], r, n)
            raise BDLoraError(
                f"{WEIGHTS_NAME}: module {inner}: the adapter's factors are for a layer of d_out x d_in = "
                f"{d_out} x {d_in} (found lora_A {tuple(a)}, lora_B {tuple(b)}), but the served model "
                f"{facts.model_path} has {leaf} of {want[0]} x {want[1]} (expected lora_A {ea}, lora_B {eb}). "
                "The adapter was trained for another model: serve it with the base model it was trained on")
        if layout is not None or facts.bd:
            split = d_out if (layout or serving_layout(leaf)) == COLUMN else d_in
            what = "d_out" if split == d_out else "d_in"
            if split % max(n, m):
                raise BDLoraError(
                    f"{WEIGHTS_NAME}: module {inner}: {what}={split} cannot be split into {max(n, m)} equal parts "
                    f"(nblocks={n}, tensor-parallel size {m}), so no device can hold a whole shard of it")


def _check_adapter(path: str, facts: EngineFacts) -> None:
    cfg = _read_config(path)
    weights = os.path.join(path, WEIGHTS_NAME)
    if not facts.bd:
        refuse_bd_without_mode(cfg, path)
        if os.path.isfile(weights):  # stock mode: the header must be readable and fit the model
            shapes = _read_header(weights)
            lora = {k: v for k, v in shapes.items() if k.endswith((PEFT_A_SUFFIX, PEFT_B_SUFFIX))}
            if lora:
                _check_model_shapes(path, cfg, shapes, module_paths(lora), facts)
        return
    if not os.path.isfile(weights):
        raise BDLoraError(f"{path}: no {WEIGHTS_NAME}. BD mode reads only each device's blocks, which needs "
                          "safetensors; re-save the adapter with safe_serialization=True")
    if cfg.is_bd or cfg.raw.get("target_parameters"):  # what bdlora cannot read: the core's one list
        try:
            check_supported_features(cfg, os.path.join(path, CONFIG_NAME))
        except BDLoraError as e:
            raise BDLoraError(f"{e}. A dense adapter with these options can be served by vLLM's own LoRA (start "
                              "without --enable-bdlora)") from None
    targets = cfg.raw.get("target_parameters")
    if targets and sorted(targets) != sorted(PEFT_TARGET_PARAMETERS):
        raise BDLoraError(f"{path}: LoRA on MoE expert tensors (target_parameters={targets!r}) is served with "
                          f"--enable-bdlora on both fused expert tensors {list(PEFT_TARGET_PARAMETERS)} only; this "
                          "PEFT expert LoRA is for vLLM's own MoE LoRA (start without --enable-bdlora; on models vLLM "
                          "loads per expert, such as Qwen3-MoE, with --enable-mixed-moe-lora-format and the adapter's "
                          "is_3d_lora_weight: true)")
    n = cfg.nblocks if cfg.is_bd else 1
    m = facts.tp_size
    check_tp_compatible(n, m)
    if cfg.r > facts.max_lora_rank:
        raise BDLoraError(f"{path}: rank r={cfg.r} is larger than --max-lora-rank {facts.max_lora_rank}; "
                          f"restart with --max-lora-rank >= {cfg.r}")
    r_local = local_rank_of(cfg.r, n, m)
    if r_local > facts.device_rank:
        what = "a dense adapter (served as nblocks=1)" if not cfg.is_bd else f"nblocks={n}"
        mr = facts.bd_max_rank
        if mr is None:
            sized = f"max_lora_rank {facts.max_lora_rank} / min(min_nblocks, tp)"
            fix = f"'{{\"bdlora\": {{\"min_nblocks\": {n}}}}}' or a larger --max-lora-rank"
        else:
            sized = f"bdlora.max_rank {mr} / min(min_nblocks, tp), rounded up to a multiple of {DEVICE_RANK_MULTIPLE}"
            fix = (f"'{{\"bdlora\": {{\"max_rank\": {cfg.r}}}}}'" if cfg.r > mr else
                   f"'{{\"bdlora\": {{\"max_rank\": {mr}, \"min_nblocks\": {n}}}}}'")
        raise BDLoraError(
            f"{path}: {what} with r={cfg.r} needs rank {r_local} on each of the {m} devices, but BD mode sized the "
            f"per-device LoRA buffers for rank {facts.device_rank} (= {sized}). Restart with --additional-config "
            f"{fix}"
        )
    shapes = _read_header(weights)
    keys = list(shapes)
    check_tensor_names(keys, f"{WEIGHTS_NAME} in {path}")
    try:
        paths = module_paths(shapes)
    except BDLoraError as e:
        raise BDLoraError(f"{WEIGHTS_NAME} in {path}: {e}") from None
    if targets:  # the fused expert factors are checked where the loader reads them (bdlora.adapter)
        paths = [p for p in paths if not p.endswith(expert_module_suffixes(targets))]
    preset = PRESETS.get(facts.model_type)
    for p in paths:
        a, b = shapes[p + PEFT_A_SUFFIX], shapes[p + PEFT_B_SUFFIX]
        leaf = p.rsplit(".", 1)[-1]
        layout = check_factor_shapes(cfg, p, a, b)  # None for a dense adapter
        if preset is not None:
            known = COLUMN if leaf in preset[COLUMN] else ROW if leaf in preset[ROW] else None
            if cfg.is_bd and known is None:
                raise BDLoraError(
                    f"{p}: {leaf!r} is not a tensor-parallel projection of a {facts.model_type} model; BD-LoRA "
                    f"targets column-parallel {list(preset[COLUMN])} and row-parallel {list(preset[ROW])}")
            if layout is not None and known != layout:
                raise BDLoraError(
                    f"{p}: the adapter lists {leaf!r} as {layout}-parallel (use_bdlora."
                    f"{'target_modules_bd_b' if layout == COLUMN else 'target_modules_bd_a'}) but vLLM shards it "
                    f"{known}-parallel; {leaf} belongs in "
                    f"{'target_modules_bd_b' if known == COLUMN else 'target_modules_bd_a'}")
        if (facts.num_kv_heads and m > facts.num_kv_heads and leaf in ("k_proj", "v_proj")
                and (cfg.is_bd or n < m)):
            raise BDLoraError(
                f"{p}: tensor-parallel size {m} exceeds the model's {facts.num_kv_heads} KV heads, so vLLM replicates "
                f"{leaf} across devices and BD-LoRA blocks cannot follow its shards; serve at a tensor-parallel size "
                f"<= {facts.num_kv_heads} or leave k_proj/v_proj out of the adapter")
    names = _model_weight_names(facts.model_path)
    if names is not None:
        missing = []
        for p in paths:
            inner = p[len(PEFT_PREFIX):] if p.startswith(PEFT_PREFIX) else p
            if not any(k.startswith(inner + ".") or k.startswith(p + ".") for k in names):
                missing.append(inner)
        if missing:
            leaves = sorted({k.rsplit(".", 2)[-2] for k in names if k.endswith(".weight") and k.count(".") >= 1})
            raise BDLoraError(
                f"{path}: modules {missing[:4]}{' ...' if len(missing) > 4 else ''} do not exist in the base model "
                f"{facts.model_path} (its weights are named like {leaves[:12]}); was the adapter trained on "
                "another model?")
    _check_model_shapes(path, cfg, shapes, paths, facts)


__all__ = [
    "AdapterNotFound", "BDOptions", "CONFIG_KEY", "EngineFacts", "SUPPORTED_VLLM", "bd_options", "check_vllm_version",
    "config_module_shapes", "device_rank", "engine_device_rank", "local_adapter_dir", "local_rank_of",
    "refuse_bd_without_mode", "resolve_adapter_path", "tp_size_of", "validate_adapter", "validate_engine_config",
]
