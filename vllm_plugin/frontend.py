"""Front-end patches: the ``--enable-bdlora`` flag, engine-config checks, and adapter checks where requests and
``/v1/load_lora_adapter`` calls arrive (so a bad adapter never reaches, and never kills, the engine)."""

from __future__ import annotations

import argparse
import contextvars
import functools
import logging
from typing import Any, Optional

from bdlora.spec import BDLoraError

from . import vllm_api as api
from .validate import AdapterNotFound, CONFIG_KEY, validate_adapter, validate_engine_config

logger = logging.getLogger("bdlora.vllm_plugin")

FLAG = "--enable-bdlora"
#: Former opt-in kernel experiments, now what --enable-bdlora does: accepted (hidden, with a warning) so that old
#: command lines still start.
LEGACY_FLAGS = ("--bdlora-fused-decode", "--bdlora-fold-shrink")


def _add_cli_args(orig_add):
    def add_cli_args(parser, *args, **kwargs):
        parser = orig_add(parser, *args, **kwargs)
        if FLAG not in getattr(parser, "_option_string_actions", {}):
            group = parser.add_argument_group(
                title="BD-LoRA (bdlora plugin)",
                description="Serve Block-Diagonal LoRA adapters without LoRA communication.")
            group.add_argument(
                FLAG, action="store_true", default=False,
                help="Serve BD-LoRA adapters (PEFT use_bdlora): each tensor-parallel rank loads only its own "
                     "blocks and runs them with no LoRA collective. Per forward and module it runs the fastest "
                     "measured path for the token count (per GPU: the LoRA shrink folded "
                     "into the base GEMM and one expand launch; vLLM's kernels on CPU). Implies --enable-lora; "
                     "same as --additional-config '{\"bdlora\": true}'.")
            for legacy in LEGACY_FLAGS:
                group.add_argument(legacy, action="store_true", default=False, help=argparse.SUPPRESS)
        return parser

    return add_cli_args


def _from_cli_args(orig_from):
    def from_cli_args(cls, args):
        engine_args = orig_from(cls, args)
        legacy = getattr(args, "bdlora_fused_decode", False) or getattr(args, "bdlora_fold_shrink", False)
        if getattr(args, "enable_bdlora", False) or legacy:
            extra = dict(engine_args.additional_config or {})
            if not extra.get(CONFIG_KEY):
                extra[CONFIG_KEY] = True
            if legacy:
                logger.warning("%s: --enable-bdlora picks bdlora's kernels per token count by default; the flag "
                               "has no effect and will be removed", " / ".join(LEGACY_FLAGS))
            engine_args.additional_config = extra
            engine_args.enable_lora = True
        return engine_args

    return from_cli_args


def _create_engine_config(create):
    @functools.wraps(create)
    def create_engine_config(self, *args, **kwargs):
        config = create(self, *args, **kwargs)
        validate_engine_config(config)
        return config

    return create_engine_config


def patch_engine_args() -> None:
    """``EngineArgs.add_cli_args`` (the flags), ``from_cli_args`` (flags -> additional_config) and
    ``create_engine_config`` (BD-mode refusals); see :mod:`.vllm_api` for the touch points."""
    api.wrap("EngineArgs.add_cli_args", _add_cli_args)  # a staticmethod: patch keeps it one
    api.wrap("EngineArgs.from_cli_args", _from_cli_args)  # a classmethod
    api.wrap("EngineArgs.create_engine_config", _create_engine_config)


# ------------------------------------------------------------------------------------------- adapter refusals

#: While vLLM's ``/v1/load_lora_adapter`` handler runs: a list that the ``add_lora`` wrapper appends its refusal to,
#: so that the handler's answer can carry the refusal's HTTP status (see :func:`patch_openai_lora_errors`).
_REFUSALS: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("bdlora_refusals", default=None)


@functools.lru_cache(maxsize=None)
def _typed_cls(kind: str):
    """A subclass of the plugin's error and of vLLM's typed client error (vLLM >= 0.27: ``vllm.exceptions``), so that
    the OpenAI server answers 404 (``VLLMNotFoundError``) or 400 (``VLLMClientError``). vLLM 0.32's
    ``AsyncLLM.generate`` turns any other exception, a plain ``ValueError`` included, into ``EngineGenerateError``:
    HTTP 500 with an empty message. vLLM 0.26 has ``VLLMNotFoundError`` but no ``VLLMClientError``: there a refusal
    stays a plain ``ValueError`` (400 on 0.26). Touch points ``VLLMClientError`` / ``VLLMNotFoundError``."""
    if kind == "not_found":
        base, ours, name = api.resolve("VLLMNotFoundError", None), AdapterNotFound, "AdapterNotFoundError"
    else:  # absent on vLLM 0.26
        base, ours, name = api.resolve("VLLMClientError", None), BDLoraError, "AdapterRefusedError"
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
    sanitize = api.resolve("sanitize_message", None)  # vLLM >= 0.32 strips file paths from client-facing messages
    if sanitize is not None:  # do the same (the file's name stays)
        message = sanitize(message)
    info = getattr(resp, "error", None) or resp  # ErrorResponse.error (ErrorInfo) on every checked vLLM
    for field, value in (("code", code), ("type", kind), ("message", message)):
        if not hasattr(info, field):
            raise api.missing(f"field '{field}' in the ErrorResponse of /v1/load_lora_adapter",
                              api.touch_point("ErrorInfo.code/type/message"))
        setattr(info, field, value)
    return resp


def patch_openai_lora_errors() -> None:
    """HTTP status of ``/v1/load_lora_adapter`` refusals.

    vLLM's ``OpenAIServingModels.load_lora_adapter`` (``vllm/entrypoints/openai/models/serving.py`` on 0.26, 0.32
    and 0.33) turns every exception of ``engine_client.add_lora`` into HTTP 500 ``InternalServerError`` except its
    own not-found error (404, matched by message). The wrapper gives the plugin's refusals (recorded by
    :func:`check_adapter`) their status: 400 ``BadRequestError`` (a bad adapter is the client's error) or 404
    ``NotFoundError``. Requests (completions, chat) that name an adapter raise the same ``ValueError`` / not-found
    error, which the server's exception handlers already map to 400 / 404. Raises
    :class:`~.vllm_api.TouchPointMissing` (an ``AttributeError``) when vLLM lacks the handler.
    """

    def wrapper(orig):
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

        return load_lora_adapter

    api.wrap("OpenAIServingModels.load_lora_adapter", wrapper)


def patch_request_validation() -> None:
    """``InputProcessor._validate_lora`` (every generate/chat/completion request) and ``add_lora`` of the
    engine clients (``LLMEngine``, ``AsyncLLM``: ``/v1/load_lora_adapter``, ``--lora-modules``)."""

    def validate_wrapper(orig_validate):
        @functools.wraps(orig_validate)
        def _validate_lora(self, lora_request):
            result = orig_validate(self, lora_request)
            if lora_request is not None and getattr(lora_request, "lora_path", None):
                check_adapter(lora_request, self.vllm_config)
            return result

        return _validate_lora

    def add_wrapper(orig_add):
        @functools.wraps(orig_add)
        def add_lora(self, lora_request):
            check_adapter(lora_request, self.vllm_config)
            return orig_add(self, lora_request)

        return add_lora

    def async_add_wrapper(orig_async_add):
        @functools.wraps(orig_async_add)
        async def add_lora_async(self, lora_request):
            check_adapter(lora_request, self.vllm_config)
            return await orig_async_add(self, lora_request)

        return add_lora_async

    api.wrap("InputProcessor._validate_lora", validate_wrapper)
    api.wrap("LLMEngine.add_lora", add_wrapper)
    api.wrap("AsyncLLM.add_lora", async_add_wrapper)
