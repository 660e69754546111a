"""Front-end patches: the ``--enable-bdlora``, ``--bdlora-fused-decode`` and ``--bdlora-fold-shrink`` flags,
engine-config checks, and adapter checks where requests and ``/v1/load_lora_adapter`` calls arrive (so a bad adapter
never reaches, and never kills, the engine)."""

from __future__ import annotations

import functools

from .validate import CONFIG_KEY, FUSED_DECODE_KEY, validate_adapter, validate_engine_config

FLAG = "--enable-bdlora"
FUSED_FLAG = "--bdlora-fused-decode"
FOLD_FLAG = "--bdlora-fold-shrink"


def _mark(fn):
    fn.__bdlora__ = True
    return fn


def _patched(obj) -> bool:
    return getattr(obj, "__bdlora__", False)


def patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    add = EngineArgs.__dict__["add_cli_args"]  # staticmethod
    if not _patched(add.__func__):
        orig_add = add.__func__

        @_mark
        def add_cli_args(parser, *args, **kwargs):
            parser = orig_add(parser, *args, **kwargs)
            if FLAG not in getattr(parser, "_option_string_actions", {}):
                group = parser.add_argument_group(
                    title="BD-LoRA (bdlora plugin)",
                    description="Serve Block-Diagonal LoRA adapters without LoRA communication.")
                group.add_argument(
                    FLAG, action="store_true", default=False,
                    help="Serve BD-LoRA adapters (PEFT use_bdlora): each tensor-parallel rank loads only its own "
                         "blocks and runs them with no LoRA collective. Implies --enable-lora; same as "
                         "--additional-config '{\"bdlora\": true}'.")
                group.add_argument(
                    FUSED_FLAG, action="store_true", default=False,
                    help="In BD mode, compute the LoRA term of small batches (<= 8 tokens: decode) with bdlora's "
                         "decode kernels (one shrink and one expand launch per module for all its slices) instead "
                         "of vLLM's punica shrink + expand per slice: ~0.6-0.9 ms less per output token at batch 1 "
                         "on Llama-8B TP=4 (BENCHMARKS.md). "
                         "Implies --enable-bdlora; same as --additional-config "
                         "'{\"bdlora_fused_decode\": true}'.")
                group.add_argument(
                    FOLD_FLAG, action="store_true", default=False,
                    help="With the fused decode: store each BD layer's LoRA A buffers under its base weight, so "
                         "that one GEMM computes the base output and the LoRA shrink and a single launch adds the "
                         "expand (unquantized base weights; best with few --max-loras). Implies "
                         f"{FUSED_FLAG}; same as --additional-config "
                         "'{\"bdlora_fused_decode\": {\"fold_shrink\": true}}'.")
            return parser

        EngineArgs.add_cli_args = staticmethod(add_cli_args)

    from_cli = EngineArgs.__dict__["from_cli_args"]  # classmethod
    if not _patched(from_cli.__func__):
        orig_from = from_cli.__func__

        @_mark
        def from_cli_args(cls, args):
            engine_args = orig_from(cls, args)
            fold = getattr(args, "bdlora_fold_shrink", False)
            fused = getattr(args, "bdlora_fused_decode", False) or fold
            if getattr(args, "enable_bdlora", False) or fused:
                extra = dict(engine_args.additional_config or {})
                if not extra.get(CONFIG_KEY):
                    extra[CONFIG_KEY] = True
                if fused and not extra.get(FUSED_DECODE_KEY):
                    extra[FUSED_DECODE_KEY] = True
                if fold:
                    value = extra[FUSED_DECODE_KEY]
                    value = {"max_tokens": value} if isinstance(value, int) and value is not True else value
                    extra[FUSED_DECODE_KEY] = {**(value if isinstance(value, dict) else {}), "fold_shrink": True}
                engine_args.additional_config = extra
                engine_args.enable_lora = True
            return engine_args

        EngineArgs.from_cli_args = classmethod(from_cli_args)

    create = EngineArgs.create_engine_config
    if not _patched(create):

        @_mark
        @functools.wraps(create)
        def create_engine_config(self, *args, **kwargs):
            config = create(self, *args, **kwargs)
            validate_engine_config(config)
            return config

        EngineArgs.create_engine_config = create_engine_config


def patch_request_validation() -> None:
    """``InputProcessor._validate_lora`` (every generate/chat/completion request) and ``add_lora`` of the
    engine clients (``LLMEngine``, ``AsyncLLM``: ``/v1/load_lora_adapter``, ``--lora-modules``)."""
    try:
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:  # pragma: no cover - older layout
        from vllm.v1.engine.processor import Processor as InputProcessor

    orig_validate = InputProcessor._validate_lora
    if not _patched(orig_validate):

        @_mark
        @functools.wraps(orig_validate)
        def _validate_lora(self, lora_request):
            result = orig_validate(self, lora_request)
            if lora_request is not None and getattr(lora_request, "lora_path", None):
                validate_adapter(lora_request.lora_path, self.vllm_config, lora_request.lora_name)
            return result

        InputProcessor._validate_lora = _validate_lora

    from vllm.v1.engine.llm_engine import LLMEngine

    orig_add = LLMEngine.add_lora
    if not _patched(orig_add):

        @_mark
        @functools.wraps(orig_add)
        def add_lora(self, lora_request):
            validate_adapter(lora_request.lora_path, self.vllm_config, lora_request.lora_name)
            return orig_add(self, lora_request)

        LLMEngine.add_lora = add_lora

    from vllm.v1.engine.async_llm import AsyncLLM

    orig_async_add = AsyncLLM.add_lora
    if not _patched(orig_async_add):

        @_mark
        @functools.wraps(orig_async_add)
        async def add_lora_async(self, lora_request):
            validate_adapter(lora_request.lora_path, self.vllm_config, lora_request.lora_name)
            return await orig_async_add(self, lora_request)

        AsyncLLM.add_lora = add_lora_async
