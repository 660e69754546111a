"""Front-end patches: the ``--enable-bdlora``, ``--bdlora-fused-decode`` and ``--bdlora-fold-shrink`` flags,
engine-config checks, and adapter checks where requests and ``/v1/load_lora_adapter`` calls arrive (so a bad adapter
never reaches, and never kills, the engine)."""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Optional

from bdlora.spec import BDLoraError

from .validate import AdapterNotFound, CONFIG_KEY, FUSED_DECODE_KEY, validate_adapter, validate_engine_config

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


# ------------------------------------------------------------------------------------------- adapter refusals

#: While vLLM's ``/v1/load_lora_adapter`` handler runs: a list that the ``add_lora`` wrapper appends its refusal to,
#: so that the handler's answer can carry the refusal's HTTP status (see :func:`patch_openai_lora_errors`).
_REFUSALS: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("bdlora_refusals", default=None)


@functools.lru_cache(maxsize=None)
def _typed_cls(kind: str):
    """A subclass of the plugin's error and of vLLM's typed client error (vLLM >= 0.27: ``vllm.exceptions``), so that
    the OpenAI server answers 404 (``VLLMNotFoundError``) or 400 (``VLLMClientError``). vLLM 0.32's
    ``AsyncLLM.generate`` turns any other exception, a plain ``ValueError`` included, into ``EngineGenerateError``:
    HTTP 500 with an empty message. None on vLLM 0.26 (no typed errors: plain ``ValueError``s are 400 there)."""
    try:
        from vllm import exceptions as vexc  # checked on vLLM 0.32
    except ImportError:  # pragma: no cover - vLLM 0.26
        return None
    if kind == "not_found":
        base, ours, name = getattr(vexc, "VLLMNotFoundError", None), AdapterNotFound, "AdapterNotFoundError"
    else:
        base, ours, name = getattr(vexc, "VLLMClientError", None), BDLoraError, "AdapterRefusedError"
    if base is None:
        return None
    return type(name, (base, ours), {"__module__": __name__})


def _typed(e: Exception) -> Exception:
    cls = _typed_cls("not_found" if isinstance(e, AdapterNotFound) else "refused")
    if cls is None or isinstance(e, cls):
        return e
    return cls(str(e))


def check_adapter(lora_request, vllm_config: Any) -> None:
    """Runs :func:`validate_adapter` for a ``LoRARequest``; records the refusal for the HTTP answer and raises it
    (a ``BDLoraError``, i.e. a ``ValueError``, that is also vLLM's ``VLLMClientError``: HTTP 400; a missing folder
    also ``VLLMNotFoundError``: HTTP 404)."""
    try:
        validate_adapter(lora_request.lora_path, vllm_config, lora_request.lora_name)
    except BDLoraError as e:
        err = _typed(e)
        _record(err)
        raise err from None


def _record(err: Exception) -> None:
    box = _REFUSALS.get()
    if box is not None:
        box.append(err)


def refusal_status(err: Exception) -> tuple[int, str]:
    """(HTTP status, error type) of a plugin refusal: 404 NotFoundError for a missing adapter, else 400."""
    if isinstance(err, AdapterNotFound):
        return 404, "NotFoundError"
    return 400, "BadRequestError"


def _set_error(resp: Any, err: Exception) -> Any:
    """Rewrites vLLM's ``ErrorResponse`` (pydantic) in place with the refusal's status, type and message."""
    code, kind = refusal_status(err)
    message = str(err)
    try:  # vLLM 0.32 strips file paths from client-facing messages; do the same (the file's name stays)
        from vllm.entrypoints.serve.exception_handling.utils import sanitize_message

        message = sanitize_message(message)
    except ImportError:  # pragma: no cover - vLLM 0.26
        pass
    info = getattr(resp, "error", None) or resp  # vLLM 0.32: ErrorResponse.error (ErrorInfo); older: flat fields
    for field, value in (("code", code), ("type", kind), ("message", message)):
        if not hasattr(info, field):
            raise AttributeError(f"bdlora: vLLM's ErrorResponse has no '{field}' field (checked on vLLM 0.32)")
        setattr(info, field, value)
    return resp


def patch_openai_lora_errors() -> None:
    """HTTP status of ``/v1/load_lora_adapter`` refusals.

    vLLM 0.32's ``OpenAIServingModels.load_lora_adapter`` (``vllm/entrypoints/openai/models/serving.py``; vLLM 0.26:
    ``vllm/entrypoints/openai/serving_models.py``) turns every exception of ``engine_client.add_lora`` into HTTP 500
    ``InternalServerError`` except its own not-found error (404, matched by message). The wrapper gives the plugin's
    refusals (recorded by :func:`check_adapter`) their status: 400 ``BadRequestError`` (a bad adapter is the
    client's error) or 404 ``NotFoundError``. Requests (completions, chat) that name an adapter raise the same
    ``ValueError`` / not-found error, which the server's exception handlers already map to 400 / 404.
    """
    cls = None
    for mod_name in ("vllm.entrypoints.openai.models.serving",  # vLLM 0.32
                     "vllm.entrypoints.openai.serving_models"):  # vLLM 0.26
        try:
            mod = __import__(mod_name, fromlist=["OpenAIServingModels"])
        except ImportError:
            continue
        cls = getattr(mod, "OpenAIServingModels", None)
        if cls is not None:
            break
    if cls is None or not hasattr(cls, "load_lora_adapter"):
        raise ImportError("bdlora: vLLM's OpenAIServingModels.load_lora_adapter not found (checked on vLLM 0.26 and "
                          "0.32); this vLLM is not supported")
    orig = cls.load_lora_adapter
    if _patched(orig):
        return

    @_mark
    @functools.wraps(orig)
    async def load_lora_adapter(self, request, *args, **kwargs):
        box: list = []
        token = _REFUSALS.set(box)
        try:
            resp = await orig(self, request, *args, **kwargs)
        finally:
            _REFUSALS.reset(token)
        if box and not isinstance(resp, str):  # an ErrorResponse caused by a plugin refusal
            return _set_error(resp, box[-1])
        return resp

    cls.load_lora_adapter = load_lora_adapter


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
                check_adapter(lora_request, self.vllm_config)
            return result

        InputProcessor._validate_lora = _validate_lora

    from vllm.v1.engine.llm_engine import LLMEngine

    orig_add = LLMEngine.add_lora
    if not _patched(orig_add):

        @_mark
        @functools.wraps(orig_add)
        def add_lora(self, lora_request):
            check_adapter(lora_request, self.vllm_config)
            return orig_add(self, lora_request)

        LLMEngine.add_lora = add_lora

    from vllm.v1.engine.async_llm import AsyncLLM

    orig_async_add = AsyncLLM.add_lora
    if not _patched(orig_async_add):

        @_mark
        @functools.wraps(orig_async_add)
        async def add_lora_async(self, lora_request):
            check_adapter(lora_request, self.vllm_config)
            return await orig_async_add(self, lora_request)

        AsyncLLM.add_lora = add_lora_async
