"""The real OpenAI server through ``bdlora serve`` (vllm serve + --enable-lora --enable-bdlora), loopback only:
dynamic loading with /v1/load_lora_adapter, completions checked against HF+PEFT, refusals that keep it serving."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm")

from bdlora.vllm_plugin import testing as T  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [5, 17, 42, 99, 7]
STARTUP_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(url, payload=None, timeout=120):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read().decode()
            return r.status, body
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
               VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    env.pop("BDLORA_COUNT_COLLECTIVES", None)
    cmd = [sys.executable, "-m", "bdlora.cli", "serve", str(tiny_llama_dir), "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "float32", "--max-lora-rank", "16", "--max-loras", "2", "--enforce-eager",
           "--max-model-len", "256", "--max-num-seqs", "4", "--served-model-name", "base"]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + STARTUP_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if _call(base + "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server not up after {STARTUP_S}s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield base
    finally:
        from bdlora.vllm_plugin.testing import stop_server

        stop_server(proc)  # the server and the engine process it started


def _complete(base, model, max_tokens=6):
    status, body = _call(base + "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
        "ignore_eos": True, "return_tokens_as_token_ids": True})
    assert status == 200, body
    lp = json.loads(body)["choices"][0]["logprobs"]
    tokens = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
    return tokens, lp["token_logprobs"]


def test_server_bd_adapter_dynamic_load(server, tiny_llama_dir, vllm_adapters, tmp_path):
    status, body = _call(server + "/v1/load_lora_adapter",
                         {"lora_name": "bd", "lora_path": str(vllm_adapters["bd2_r16"])})
    assert status == 200, body
    status, body = _call(server + "/v1/load_lora_adapter",
                         {"lora_name": "bd4", "lora_path": str(vllm_adapters["bd4_r16"])})
    assert status == 200, body
    models = {m["id"] for m in json.loads(_call(server + "/v1/models")[1])["data"]}
    assert {"base", "bd", "bd4"} <= models
    seen = {}
    for model, adapter in (("bd", "bd2_r16"), ("bd4", "bd4_r16"), ("base", None)):
        tokens, logprobs = seen[model] = _complete(server, model)
        ref_lp, ref_tokens = T.hf_teacher_forced(tiny_llama_dir, vllm_adapters[adapter] if adapter else None,
                                                 PROMPT, tokens)
        assert ref_tokens == tokens, (model, tokens, ref_tokens)
        assert max(abs(a - b) for a, b in zip(logprobs, ref_lp)) < 1e-4

    # Refused where the call arrives, with the reason; the server keeps serving.
    bad = tmp_path / "n3"
    shutil.copytree(vllm_adapters["bd2_r8"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["use_bdlora"]["nblocks"] = 3
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    status, body = _call(server + "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    assert status >= 400 and "not divisible by use_bdlora.nblocks=3" in body, body
    assert _call(server + "/health")[0] == 200
    assert _complete(server, "bd") == seen["bd"]
    assert len({tuple(t) for t, _ in seen.values()}) == 3  # the adapters change the output
    status, body = _call(server + "/v1/unload_lora_adapter", {"lora_name": "bd4"})
    assert status == 200, body
