"""Fault injection for the server tests: put this folder on PYTHONPATH and set ``BDLORA_TEST_FAIL_ADD_LORA`` to
``name[@rank],...``; in every process of that server (API, engine core, workers) the plugin's per-worker
``add_lora`` then fails for adapters of that name (on that rank, or on all), a worker-side failure behind the
front-end checks. Python imports ``sitecustomize`` at start-up, so the injection reaches the worker processes,
which a monkeypatch in the test process cannot."""

import os

_SPEC = os.environ.get("BDLORA_TEST_FAIL_ADD_LORA", "")


def _faulty(lora_request, rank) -> bool:
    for item in filter(None, (i.strip() for i in _SPEC.split(","))):
        name, _, at = item.partition("@")
        if name == getattr(lora_request, "lora_name", None) and (not at or int(at) == rank):
            return True
    return False


class _FailingWorker:
    def __init__(self, rank):
        self.rank = rank

    def add_lora(self, lora_request):
        raise RuntimeError(f"fault injected by the test (BDLORA_TEST_FAIL_ADD_LORA) on rank {self.rank}")


if _SPEC:
    from bdlora.vllm_plugin import rpc_fix

    _original = rpc_fix.worker_add_lora

    def worker_add_lora(worker, lora_request):
        rank = getattr(worker, "rank", getattr(worker, "local_rank", 0))
        return _original(_FailingWorker(rank) if _faulty(lora_request, rank) else worker, lora_request)

    # pickled by reference as rpc_fix.worker_add_lora, which resolves to this wrapper in the workers too
    worker_add_lora.__module__ = rpc_fix.__name__
    worker_add_lora.__qualname__ = "worker_add_lora"
    rpc_fix.worker_add_lora = worker_add_lora
