"""One patch of a vLLM internal: ``Executor.add_lora`` never leaves a worker's reply unread.

vLLM 0.32's ``MultiprocExecutor.collective_rpc`` (``vllm/v1/executor/multiproc_executor.py``, ``get_response``) reads
the workers' replies in rank order and raises at the first failed one without reading the others. When ``add_lora``
fails in a worker at tensor-parallel size >= 2, the unread replies stay in their queues and the NEXT call reads them:
a good adapter then fails with the previous adapter's error, or "succeeds" with a stale reply (stock vLLM has the
same bug; seen through ``/v1/load_lora_adapter``). vLLM 0.33 is unchanged here unless its ``enable_fault_tolerance``
is on.

The patch replaces ``Executor.add_lora`` (``vllm/v1/executor/abstract.py``: ``all(self.collective_rpc("add_lora",
...))``, the same in vLLM 0.26, 0.32 and 0.33) with a version that sends :func:`worker_add_lora` instead: it calls the
worker's own ``add_lora`` and returns a failure record instead of raising, so every rank replies ``SUCCESS`` and every
reply is read. After all ranks replied, a failure on any rank removes the adapter from the ranks that did load it
(no half-loaded adapter) and raises one error naming the adapter, its path and the failed ranks; vLLM's
``LoRAAdapterNotFoundError`` is re-raised as such (``/v1/load_lora_adapter`` answers 404 for it). The engine core
reports the error to the caller as before (a failed utility call), and keeps running.
"""

from __future__ import annotations

from typing import Any

_FAILURE = "__bdlora_add_lora_failure__"


def _worker_rank(worker: Any) -> int:
    for attr in ("rank", "local_rank"):
        value = getattr(worker, attr, None)
        if isinstance(value, int):
            return value
    return 0


def worker_add_lora(worker: Any, lora_request: Any) -> Any:
    """Runs in each worker (sent through ``collective_rpc``): the worker's ``add_lora``, never raising."""
    rank = _worker_rank(worker)
    try:
        return bool(worker.add_lora(lora_request))
    except Exception as e:  # noqa: BLE001 - reported to the engine core after every rank replied
        try:
            from vllm.exceptions import LoRAAdapterNotFoundError
            not_found = isinstance(e, LoRAAdapterNotFoundError)
        except ImportError:  # pragma: no cover
            not_found = False
        return {_FAILURE: True, "rank": rank, "type": type(e).__name__, "error": str(e), "not_found": not_found}


def _is_failure(reply: Any) -> bool:
    return isinstance(reply, dict) and reply.get(_FAILURE) is True


def patch_executor_add_lora() -> None:
    """Installs the patch (idempotent, through :func:`.vllm_api.patch`). Fails at startup with
    :class:`~.vllm_api.TouchPointMissing`, naming the vLLM version, when vLLM's ``Executor`` lacks ``add_lora`` /
    ``collective_rpc`` / ``remove_lora``."""
    from . import vllm_api as api

    for key in ("Executor.collective_rpc", "Executor.remove_lora"):  # raise TouchPointMissing, naming them
        api.resolve(key)

    def add_lora(self, lora_request) -> bool:
        assert lora_request.lora_int_id > 0, "lora_id must be greater than 0."
        replies = self.collective_rpc(worker_add_lora, args=(lora_request,))
        replies = list(replies) if isinstance(replies, (list, tuple)) else [replies]
        failed = [r for r in replies if _is_failure(r)]
        if not failed:
            return all(replies)
        if len(failed) < len(replies):  # some ranks loaded it: take it back out of them
            try:
                self.collective_rpc("remove_lora", args=(lora_request.lora_int_id,))
            except Exception:  # noqa: BLE001 - the load error below is what the caller needs
                pass
        first = failed[0]
        if all(f["not_found"] for f in failed):
            from vllm.exceptions import LoRAAdapterNotFoundError

            raise LoRAAdapterNotFoundError(lora_request.lora_name, lora_request.lora_path)
        ranks = ", ".join(str(f["rank"]) for f in failed)
        raise RuntimeError(
            f"LoRA adapter {lora_request.lora_name!r} ({lora_request.lora_path}) failed to load on worker rank(s) "
            f"{ranks} of {len(replies)}: {first['type']}: {first['error']}")

    add_lora.__doc__ = "bdlora: every rank's reply is read (see bdlora.vllm_plugin.rpc_fix)."
    api.patch(*api.owner_of("Executor.add_lora"), add_lora, point="Executor.add_lora")
