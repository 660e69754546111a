"""Worker side of BD mode: build the LoRA layers with the BD classes, and load each adapter zero-free per rank.

``WorkerLoRAManager.create_lora_manager`` is wrapped: in BD mode this build's BD layer classes
(:func:`bdlora.vllm_plugin.layers.layer_classes`, carrying the per-device buffer rank and the fast path's build) go
in front of ``vllm.lora.utils._all_lora_classes`` while the manager wraps the model (restored right after; the logits
processor is wrapped by :class:`~bdlora.vllm_plugin.layers.BDLogitsProcessorWithLoRA`, which skips the lm_head term
while no slot has lm_head factors), and the worker's ``LoRAModel`` class is swapped for :class:`BDLoRAModel`, whose
``from_local_checkpoint`` reads from safetensors only this TP rank's blocks (``safe_open(...).get_slice`` +
:func:`bdlora.sharding.shard_factors`), sliced with the adapter's own ``r`` and ``nblocks`` (never
``--max-lora-rank``). Dense adapters are served as ``nblocks=1``, which is exactly vLLM's standard sharding.
``_load_adapter`` is wrapped to refuse BD folders when BD mode is off (vLLM 0.26's ``PEFTHelper`` drops ``use_bdlora``
silently) and, in BD mode, to lift vLLM 0.32's "does not support block-diagonal LoRA" check for the adapter being
loaded. The BD layers are built with the buffers and hooks of the fast path (:mod:`bdlora.vllm_plugin.fast_path`)
unless ``{"bdlora": {"kernels": false}}``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from bdlora.adapter import CONFIG_NAME, WEIGHTS_NAME, AdapterConfig, check_factor_shapes, module_paths, read_config
from bdlora.moe import expert_module_suffixes
from bdlora.sharding import check_tp_compatible, shard_factors
from bdlora.spec import BDLoraError

from . import layers as bd_layers
from . import vllm_api as api
from .fast_path.state import LayerBuild
from .validate import bd_options, device_rank, local_rank_of, refuse_bd_without_mode, tp_size_of

from bdlora.adapter import PEFT_A_SUFFIX as _A, PEFT_B_SUFFIX as _B


@dataclass
class BDRuntime:
    """BD state of one worker's LoRA manager."""

    tp_size: int
    tp_rank: int
    device_rank: int
    min_nblocks: Optional[int]
    layer_map: dict = field(default_factory=dict)  # vLLM sub-module name -> (layer, layout or None, slice index)


#: The adapter being loaded in this thread (set by the wrapped ``_load_adapter``, read by ``BDLoRAModel``): vLLM
#: calls ``from_local_checkpoint`` without a way to pass the per-rank runtime, so it travels thread-locally.
_ctx = threading.local()


@contextlib.contextmanager
def _loading(runtime: BDRuntime, cfg: AdapterConfig):
    prev = getattr(_ctx, "value", None)
    _ctx.value = (runtime, cfg)
    try:
        yield
    finally:
        _ctx.value = prev


def loading_context() -> Optional[tuple]:
    return getattr(_ctx, "value", None)


def _tp_rank_size() -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def build_layer_map(adapter_manager) -> dict:
    """{vLLM module name of each LoRA'd projection: (layer, layout, slice index)}; packed layers are listed under
    their projections' names (``...self_attn.q_proj`` -> the qkv_proj layer, slice 0)."""
    mapping = getattr(adapter_manager, "packed_modules_mapping", {}) or {}
    out = {}
    for name, layer in adapter_manager.modules.items():
        leaf = name.rsplit(".", 1)[-1]
        parent = name[: -len(leaf)]
        subs = mapping.get(leaf) or []
        layout = bd_layers.layout_of_layer(layer)
        if len(subs) > 1 or (len(subs) == 1 and subs[0] != leaf):
            for i, sub in enumerate(subs):
                out[parent + sub] = (layer, layout, i)
        else:
            out[name] = (layer, layout, 0)
    return out


def _filter_kwargs(fn, kwargs: dict) -> dict:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def read_rank_tensors(lora_dir: str, cfg: AdapterConfig, runtime: BDRuntime, weights_mapper=None,
                      skip=None) -> dict[str, torch.Tensor]:
    """This TP rank's factors of every module of a PEFT folder, read block by block from safetensors."""
    from safetensors import safe_open
    from vllm.lora.utils import parse_fine_tuned_lora_name

    weights = os.path.join(lora_dir, WEIGHTS_NAME)
    if not os.path.isfile(weights):
        raise BDLoraError(f"{lora_dir}: no {WEIGHTS_NAME}; BD mode needs safetensors to read per-rank blocks")
    n = cfg.nblocks if cfg.is_bd else 1
    m, rank = runtime.tp_size, runtime.tp_rank
    check_tp_compatible(n, m)
    r_local = local_rank_of(cfg.r, n, m)
    if r_local > runtime.device_rank:
        raise BDLoraError(f"{lora_dir}: needs rank {r_local} per device, BD buffers hold {runtime.device_rank}")
    tensors: dict[str, torch.Tensor] = {}
    unknown, problems = [], []
    with safe_open(weights, framework="pt") as f:
        keys = list(f.keys())
        others = [k for k in keys if not (k.endswith(_A) or k.endswith(_B))]
        if others:
            raise BDLoraError(f"{lora_dir}: tensors {others[:4]} are not lora_A/lora_B factors")
        targets = cfg.raw.get("target_parameters")
        if targets:  # expert factors: read whole, this rank's blocks handed over per expert
            suffixes = expert_module_suffixes(targets)
            expert_keys = {k for k in keys if k.rsplit(".lora_", 1)[0].endswith(suffixes)}  # all lora_A/B here
            tensors.update(rank_expert_tensors({k: f.get_tensor(k) for k in expert_keys}, cfg, runtime,
                                               weights_mapper, lora_dir))
            keys = [k for k in keys if k not in expert_keys]
        for p in module_paths(keys):
            a_name, b_name = p + _A, p + _B
            if skip is not None and skip(a_name):
                continue
            module_name, _ = parse_fine_tuned_lora_name(a_name, weights_mapper)
            entry = runtime.layer_map.get(module_name)
            if entry is None:
                unknown.append(module_name)
                continue
            layer, layout, _ = entry
            a_h, b_h = f.get_slice(a_name), f.get_slice(b_name)
            a_shape, b_shape = tuple(a_h.get_shape()), tuple(b_h.get_shape())
            if cfg.is_bd:
                adapter_layout = check_factor_shapes(cfg, p, a_shape, b_shape)
                if layout is None:
                    problems.append(f"{module_name}: its vLLM layer {type(layer).__name__} is not a tensor-parallel "
                                    "projection BD-LoRA supports")
                    continue
                if adapter_layout != layout:
                    problems.append(f"{module_name}: the adapter makes it {adapter_layout}-parallel, vLLM shards it "
                                    f"{layout}-parallel")
                    continue
            elif layout is None:  # a stock vLLM layer: it slices the full factors itself
                tensors[a_name], tensors[b_name] = f.get_tensor(a_name), f.get_tensor(b_name)
                continue
            base = getattr(layer, "base_layer", None)
            if getattr(base, "num_kv_head_replicas", 1) > 1 and module_name.rsplit(".", 1)[-1] in ("k_proj", "v_proj"):
                problems.append(f"{module_name}: vLLM replicates KV heads at this TP size; BD blocks cannot follow")
                continue
            a_loc, b_loc = shard_factors(a_h, b_h, layout, n, m, rank)
            tensors[a_name], tensors[b_name] = a_loc.contiguous(), b_loc.contiguous()
    if unknown:
        raise BDLoraError(f"{lora_dir}: modules {unknown[:4]} are not LoRA-capable modules of the served model "
                          f"(known e.g. {sorted(runtime.layer_map)[:6]})")
    if problems:
        raise BDLoraError(f"{lora_dir}: " + "; ".join(problems[:4]))
    return tensors


def moe_packing_scale(lora_alpha: float, r: int, scale: float) -> float:
    """The scale this vLLM gives a per-expert MoE LoRA of PEFT ``lora_alpha`` and rank ``r`` whose own scaling is
    ``scale``: probed on ``PackedLoRALayerWeights.pack_moe`` (0.26 packs ``lora_alpha / r`` whatever ``use_rslora``
    says; 0.32 keeps each LoRA's scaling)."""
    from vllm.lora.lora_weights import LoRALayerWeights

    pack_moe = api.resolve("PackedLoRALayerWeights.pack_moe")
    one = torch.zeros(1, 1)
    loras = [LoRALayerWeights(f"probe.{i}", r, lora_alpha, one, one, scaling=scale) for i in range(3)]
    return float(pack_moe(loras, "probe").scaling[0])


def rank_expert_tensors(tensors: dict, cfg: AdapterConfig, runtime: "BDRuntime", weights_mapper, lora_dir: str
                        ) -> dict[str, torch.Tensor]:
    """This TP rank's expert factors of a BD expert adapter, keyed as vLLM's MoE LoRA layer of the served model reads
    them: per expert (``<experts>.<e>.gate_proj|up_proj|down_proj``) for vLLM's per-expert MoE models, PEFT's
    flattened ``<experts>[.base_layer].lora_A/B`` for its 3-D ones. Each rank gets ``bdlora.moe.device_factors``
    (M | N or N | M; a dense expert LoRA is N = 1): gate and up rows of its intermediate shard (B) with its ranks of
    gate_up's A, down's A over its intermediate inputs with its ranks of B."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    from bdlora.adapter import _read_expert_factors
    from bdlora.moe import device_factors, to_peft_layout

    n, m, k = (cfg.nblocks or 1) if cfg.is_bd else 1, runtime.tp_size, runtime.tp_rank
    experts = _read_expert_factors(dict(tensors), cfg.raw["target_parameters"], cfg.r, n, cfg.scale, lora_dir)
    out: dict[str, torch.Tensor] = {}
    correction = None
    for path, fac in experts.items():
        module, name = path.rsplit(".", 1)  # <PEFT experts module path>, gate_up_proj | down_proj
        try:
            a, b = device_factors(name, fac.lora_A, fac.lora_B, n, k, m)
        except BDLoraError as e:
            raise BDLoraError(f"{lora_dir}: {e}") from None
        vllm_name, _ = parse_fine_tuned_lora_name(module + _A, weights_mapper)
        entry = runtime.layer_map.get(vllm_name + ".0.gate_proj") or runtime.layer_map.get(vllm_name)
        if entry is None or bd_layers.layout_of_layer(entry[0]) != "experts":
            raise BDLoraError(f"{lora_dir}: {vllm_name} is not a MoE layer the plugin serves BD expert adapters on")
        if isinstance(entry[0], bd_layers.FusedMoE3DWithLoRA):  # PEFT's flattened 3-D keys at this rank's shapes
            flat_a, flat_b = to_peft_layout(a, b)
            stem = module + (".base_layer" if name == "gate_up_proj" else "")
            out[stem + _A], out[stem + _B] = flat_a.contiguous(), flat_b.contiguous()
            continue
        if correction is None:  # per-expert packing may not apply rsLoRA: the factors carry the difference
            correction = cfg.scale / moe_packing_scale(cfg.peft_lora_alpha, cfg.r, cfg.scale)
        b = b * correction
        for e in range(a.shape[0]):
            if name == "gate_up_proj":
                i_k = b.shape[1] // 2
                for proj, rows in (("gate_proj", slice(0, i_k)), ("up_proj", slice(i_k, 2 * i_k))):
                    out[f"{module}.{e}.{proj}{_A}"] = a[e].contiguous()
                    out[f"{module}.{e}.{proj}{_B}"] = b[e, rows].contiguous()
            else:
                out[f"{module}.{e}.down_proj{_A}"] = a[e].contiguous()
                out[f"{module}.{e}.down_proj{_B}"] = b[e].contiguous()
    return out


def make_bd_lora_model_cls(base_cls):
    """A subclass of the worker's ``LoRAModel`` class whose checkpoint loading is per-rank and zero-free."""

    class BDLoRAModel(base_cls):
        @classmethod
        def from_local_checkpoint(cls, lora_dir, expected_lora_modules, peft_helper, *, lora_model_id=None,
                                  device="cuda", dtype=None, weights_mapper=None, skip_prefixes=None, **kwargs):
            ctx = loading_context()
            if ctx is None:  # not a BD-mode load (should not happen): vLLM's own path
                return super().from_local_checkpoint(
                    lora_dir, expected_lora_modules, peft_helper, lora_model_id=lora_model_id, device=device,
                    dtype=dtype, weights_mapper=weights_mapper, skip_prefixes=skip_prefixes, **kwargs)
            runtime, cfg = ctx
            skip = None
            if skip_prefixes:
                skip = lambda name: cls._should_skip_module(name, skip_prefixes)  # noqa: E731
            tensors = read_rank_tensors(lora_dir, cfg, runtime, weights_mapper, skip)
            if lora_model_id is None:
                from vllm.lora.utils import get_lora_id

                lora_model_id = get_lora_id()
            call = dict(lora_model_id=lora_model_id, tensors=tensors, peft_helper=peft_helper, device=device,
                        dtype=dtype, weights_mapper=weights_mapper, skip_prefixes=skip_prefixes,
                        model_vocab_size=kwargs.get("model_vocab_size"))
            return cls.from_lora_tensors(**_filter_kwargs(cls.from_lora_tensors, call))

    BDLoRAModel.__name__ = BDLoRAModel.__qualname__ = f"BD{base_cls.__name__}"
    return BDLoRAModel


# ------------------------------------------------------------------------------------------------ patches


def _adapter_config_of(lora_request) -> Optional[AdapterConfig]:
    from vllm.lora.utils import get_adapter_absolute_path

    try:
        path = get_adapter_absolute_path(lora_request.lora_path)
    except Exception:  # let vLLM report a missing adapter its own way
        return None
    if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return None
    return read_config(path)


def patch_worker_manager() -> None:
    """Wraps ``create_lora_manager`` (each class's own definition: ``LRUCacheWorkerLoRAManager`` overrides it) and
    ``WorkerLoRAManager._load_adapter``, through :func:`.vllm_api.wrap`."""
    for key in ("WorkerLoRAManager.create_lora_manager", "LRUCacheWorkerLoRAManager.create_lora_manager"):
        owner, attr = api.owner_of(key)
        if attr in owner.__dict__:
            api.wrap(key, _wrap_create, owner=owner, attr=attr)
    api.wrap("WorkerLoRAManager._load_adapter", _wrap_load)


def _wrap_load(orig_load):
    def _load_adapter(self, lora_request):
        runtime = getattr(self, "_bdlora", None)
        cfg = _adapter_config_of(lora_request)
        if runtime is None:
            if cfg is not None:
                refuse_bd_without_mode(cfg, lora_request.lora_path)
            return orig_load(self, lora_request)
        if cfg is None:
            raise BDLoraError(f"{lora_request.lora_path}: BD mode serves local PEFT folders with "
                              f"{CONFIG_NAME} and {WEIGHTS_NAME}")
        with _loading(runtime, cfg):
            return orig_load(self, lora_request)

    return _load_adapter


def _wrap_create(orig_create):
    def create_lora_manager(self, model, vllm_config=None, *args, **kwargs):
        from vllm.config import get_current_vllm_config

        cfg = vllm_config if vllm_config is not None else get_current_vllm_config()
        opts = bd_options(cfg)
        self._bdlora = None
        if opts is None:
            return orig_create(self, model, vllm_config, *args, **kwargs)
        lora_config = cfg.lora_config
        if getattr(lora_config, "fully_sharded_loras", False):
            raise BDLoraError("--enable-bdlora and --fully-sharded-loras exclude each other")
        tp_rank, tp = _tp_rank_size()
        if tp != tp_size_of(cfg):
            raise BDLoraError(f"tensor-parallel group has {tp} ranks but the config says {tp_size_of(cfg)}")
        runtime = BDRuntime(tp_size=tp, tp_rank=tp_rank, min_nblocks=opts.min_nblocks,
                            device_rank=device_rank(lora_config.max_lora_rank, tp, opts.min_nblocks, opts.max_rank))
        # This build's layer classes carry its state (buffer rank, fast path): nothing global to set and reset. Its
        # layers enter the engine's own registry, which vLLM's forward context hands to the custom ops.
        build = LayerBuild(rank=runtime.device_rank, options=opts.kernels,
                           registry=cfg.compilation_config.static_forward_context)
        bd_classes = bd_layers.layer_classes(build)
        with api.swapped("lora.utils._all_lora_classes",
                         lambda saved: bd_classes + tuple(c for c in saved if not getattr(c, "bdlora", False))), \
                api.swapped("lora.utils.LogitsProcessorWithLoRA", lambda saved: bd_layers.BDLogitsProcessorWithLoRA):
            result = orig_create(self, model, vllm_config, *args, **kwargs)
        runtime.layer_map = build_layer_map(self._adapter_manager)
        self._bdlora = runtime
        if not getattr(self._lora_model_cls, "__bdlora_cls__", False):
            self._lora_model_cls = make_bd_lora_model_cls(self._lora_model_cls)
            self._lora_model_cls.__bdlora_cls__ = True
        return result

    return create_lora_manager


def patch_peft_helper() -> None:
    """vLLM >= 0.27 rejects ``use_bdlora`` in ``PEFTHelper._validate_features``; lift that for BD-mode loads only
    (0.26's accepts it, dropping the key: the wrapper filters nothing there)."""

    def wrapper(orig):
        def _validate_features(self):
            msgs = orig(self)
            if loading_context() is not None and isinstance(msgs, list):
                msgs = [m for m in msgs if "block-diagonal" not in m.lower() and "bd-lora" not in m.lower()]
            return msgs

        return _validate_features

    api.wrap("PEFTHelper._validate_features", wrapper)
