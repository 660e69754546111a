"""Refusals through the real OpenAI server at tensor-parallel size 2 (``bdlora serve``, loopback only), one server for
every case (a TP=2 start costs about a minute on CPU):

* eight kinds of bad adapters posted to ``/v1/load_lora_adapter`` are refused where the call arrives, before any
  worker is asked, with HTTP 400 (404 for a missing folder) and a message naming the adapter and the file at fault;
* after each refusal the server keeps serving: a good request gives HF+PEFT's tokens, and a good load works;
* a worker-side failure of ``add_lora`` (forced on rank 0, rank 1 or both through ``BDLORA_TEST_FAIL_ADD_LORA``,
  read by ``tests/faults/sitecustomize.py`` in every server process) leaves no stale reply: the next good load
  succeeds and serves correct outputs (vLLM 0.32's ``collective_rpc`` alone makes it fail with the previous
  adapter's error);
* a completion that names a loaded adapter whose files were damaged since is refused with 400, naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from bdlora.vllm_plugin import testing as T  # noqa: E402
from vllm_bad_adapters import make_bad_adapters  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [5, 17, 42, 99, 7]
TOL = 1e-4
FAULTS = {"fault-r0": "0", "fault-r1": "1", "fault-all": None}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-tp2") / "server.log"
    faults = Path(__file__).parent / "faults"  # sitecustomize: the injection in every server process
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(faults), os.environ.get("PYTHONPATH")])),
           "BDLORA_TEST_FAIL_ADD_LORA": ",".join(n if r is None else f"{n}@{r}" for n, r in FAULTS.items())}
    proc, base = T.start_server(tiny_llama_dir, [
        "--tensor-parallel-size", "2", "--dtype", "float32", "--max-lora-rank", "16", "--max-loras", "2",
        "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "4", "--served-model-name", "base"], log,
        env=env)
    try:
        yield base
    finally:
        T.stop_server(proc)


def _load(base, name, path):
    return T.http_call(base + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def _ensure_loaded(base, name, path):
    """Loads ``name`` unless the server already has it (tests share the module's server, but xdist may run another
    module's tests between two of these, and then the server is a new one)."""
    models = {m["id"] for m in json.loads(T.http_call(base + "/v1/models")[1])["data"]}
    if name not in models:
        status, body = _load(base, name, path)
        assert status == 200, body


def _unload(base, name):
    status, body = T.http_call(base + "/v1/unload_lora_adapter", {"lora_name": name})
    assert status == 200, body


def _complete(base, model, max_tokens=6):
    status, body = T.http_call(base + "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
        "ignore_eos": True, "return_tokens_as_token_ids": True})
    return status, body


def _tokens(base, model):
    status, body = _complete(base, model)
    assert status == 200, body
    lp = json.loads(body)["choices"][0]["logprobs"]
    return [int(t.split(":", 1)[1]) for t in lp["tokens"]], lp["token_logprobs"]


def _assert_hf(model_dir, adapter_dir, got):
    tokens, logprobs = got
    ref_lp, ref_tokens = T.hf_teacher_forced(model_dir, adapter_dir, PROMPT, tokens)
    assert ref_tokens == tokens, (tokens, ref_tokens)
    assert max(abs(a - b) for a, b in zip(logprobs, ref_lp)) < TOL


def _error(body):
    err = json.loads(body)["error"]
    return err["code"], err["type"], err["message"]


def test_tp2_server_bad_adapters_are_client_errors(server, tiny_llama_dir, vllm_adapters, tmp_path):
    status, body = _load(server, "bd", vllm_adapters["bd2_r16"])
    assert status == 200, body
    good = _tokens(server, "bd")
    _assert_hf(tiny_llama_dir, vllm_adapters["bd2_r16"], good)
    base = _tokens(server, "base")
    assert base[0] != good[0]

    cases = make_bad_adapters(vllm_adapters["bd2_r8"], vllm_adapters["dense_r16"], tmp_path)
    assert len(cases) >= 8
    for i, (name, path, want, needles) in enumerate(cases):
        status, body = _load(server, name, path)
        assert status == want, (name, status, body)
        code, kind, message = _error(body)
        assert (code, kind) == (want, "NotFoundError" if want == 404 else "BadRequestError"), (name, body)
        for needle in needles:
            assert needle in message, (name, needle, message)
        # The server keeps serving everyone else: same tokens as before, and a good load works right after.
        assert T.http_call(server + "/health")[0] == 200
        assert _tokens(server, "bd") == good, name
        status, body = _load(server, f"good-{i}", vllm_adapters["bd4_r16"])
        assert status == 200, (name, body)
        _unload(server, f"good-{i}")
        models = {m["id"] for m in json.loads(T.http_call(server + "/v1/models")[1])["data"]}
        assert name not in models
    _assert_hf(tiny_llama_dir, vllm_adapters["bd2_r16"], _tokens(server, "bd"))


@pytest.mark.parametrize("fault", list(FAULTS))
def test_tp2_server_worker_failure_leaves_no_stale_reply(server, tiny_llama_dir, vllm_adapters, fault):
    """add_lora fails inside a worker (forced: the adapter itself is good); the next good load succeeds and serves
    HF+PEFT's tokens, and the failed adapter was loaded nowhere."""
    status, body = _load(server, fault, vllm_adapters["bd2_r8"])
    assert status == 500, body
    _, kind, message = _error(body)
    rank = FAULTS[fault]
    assert fault in message and "fault injected" in message, message
    assert (f"rank(s) {rank} of 2" if rank is not None else "rank(s) 0, 1 of 2") in message, message
    name = f"after-{fault}"
    status, body = _load(server, name, vllm_adapters["bd2_r8"])
    assert status == 200, body
    got = _tokens(server, name)
    _assert_hf(tiny_llama_dir, vllm_adapters["bd2_r8"], got)
    status, body = _complete(server, fault)  # never registered
    assert status == 404, body
    status, body = _load(server, f"again-{fault}", vllm_adapters["bd4_r16"])
    assert status == 200, body
    _assert_hf(tiny_llama_dir, vllm_adapters["bd4_r16"], _tokens(server, f"again-{fault}"))
    _unload(server, name)
    _unload(server, f"again-{fault}")


def test_tp2_server_request_for_damaged_adapter_is_400(server, tiny_llama_dir, vllm_adapters, tmp_path):
    import shutil

    path = tmp_path / "damaged"
    shutil.copytree(vllm_adapters["bd2_r8"], path)
    status, body = _load(server, "damaged", path)
    assert status == 200, body
    weights = path / "adapter_model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    status, body = _complete(server, "damaged")
    assert status == 400, body
    _, kind, message = _error(body)
    assert kind == "BadRequestError" and "damaged" in message and "adapter_model.safetensors" in message, body
    _ensure_loaded(server, "bd", vllm_adapters["bd2_r16"])
    _assert_hf(tiny_llama_dir, vllm_adapters["bd2_r16"], _tokens(server, "bd"))
