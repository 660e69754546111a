"""Testing helpers: check a BD adapter served by vLLM against HF transformers + PEFT on the same weights.

Engines (``start_llm``) and OpenAI servers (``start_server``) started the way a user starts them, HF + PEFT
teacher-forced references (``hf_teacher_forced``) and token-by-token parity reports (``assert_parity``). The test
suite, ``bench/serve/gpu_parity.py`` and anyone checking their own adapter use the same functions. Nothing here is
imported by the serving path; the probes that run inside vLLM workers are :mod:`bdlora.vllm_plugin.diagnostics`.
"""

from __future__ import annotations

import sys


# ----------------------------------------------------------------------------------------------- references


def make_peft_adapter(model_dir, out_dir, peft_config, seed: int = 0, std: float = 0.05):
    """Saves a PEFT adapter of ``peft_config`` on the model at ``model_dir`` with random (non-zero) factors.

    PEFT initialises lora_B to zero; every LoRA factor is refilled with N(0, std^2) so the adapter visibly changes
    outputs. Works for BD (``BDLoraSpec.to_peft_config()``) and dense ``LoraConfig`` alike. Only the LoRA factors
    are saved (``save_embedding_layers=False``: with an lm_head target PEFT would also save lm_head's base weight,
    which vLLM does not serve).
    """
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, peft_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(str(out_dir), save_embedding_layers=False)
    return out_dir


def hf_teacher_forced(model_dir, adapter_dir, prompt_ids, gen_ids, device: str = "cpu", gaps: bool = False):
    """HF (+PEFT) log-probabilities of ``gen_ids`` after ``prompt_ids`` and the greedy token at each step.

    Returns (logprobs, argmax); one forward over prompt+generation, so a greedy vLLM generation is correct iff
    ``argmax == gen_ids`` and its logprobs match. With ``gaps``, also HF's margin at each step: its best logprob
    minus that of ``gen_ids`` (0 where they agree; small where a low-precision engine flipped a near-tie).
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).to(device)
    model.eval()
    ids = torch.tensor([list(prompt_ids) + list(gen_ids)], device=device)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    n = len(prompt_ids)
    rows = logp[n - 1: n - 1 + len(gen_ids)]
    picked = rows.gather(1, torch.tensor(list(gen_ids), device=device).unsqueeze(1)).squeeze(1)
    if gaps:
        return picked.cpu().tolist(), rows.argmax(-1).cpu().tolist(), (rows.max(-1).values - picked).cpu().tolist()
    return picked.cpu().tolist(), rows.argmax(-1).cpu().tolist()


def vllm_logprobs(completion) -> list[float]:
    """Sampled-token logprobs of one vLLM ``CompletionOutput`` generated with ``logprobs=0``."""
    return [d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids)]


# ----------------------------------------------------------------------------------------------- engines


def start_llm(model_dir, env: dict | None = None, **kwargs):
    """An ``LLM`` on ``model_dir`` (float32, eager) with ``env`` applied first (vLLM's env cache is reset)."""
    import os

    saved = {k: os.environ.get(k) for k in (env or {})}
    for k, v in (env or {}).items():
        os.environ[k] = str(v)
    import vllm.envs as envs

    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    from vllm import LLM

    opts = dict(dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0,
                gpu_memory_utilization=0.5)
    opts.update(kwargs)
    try:
        llm = LLM(str(model_dir), **opts)
    except BaseException:
        _restore_env(saved)
        raise
    llm._bdlora_saved_env = saved
    return llm


def _restore_env(saved: dict) -> None:
    import os

    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def stop_llm(llm) -> None:
    """Shuts an engine from :func:`start_llm` down and restores the environment it changed (idempotent)."""
    import gc

    saved = getattr(llm, "_bdlora_saved_env", None)
    llm._bdlora_saved_env = None
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:
        pass
    if saved:
        _restore_env(saved)
    import vllm.envs as envs

    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()


def generate_mixed(llm, jobs, max_tokens: int = 8):
    """Runs one batch: ``jobs`` is a list of (prompt token ids, LoRARequest or None); returns CompletionOutputs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p, _ in jobs]
    outs = llm.generate(prompts, sp, lora_request=[lr for _, lr in jobs], use_tqdm=False)
    return [o.outputs[0] for o in outs]


def parity_report(model_dir, jobs, outputs, adapter_dirs) -> list[dict]:
    """Per job: token equality with HF(+PEFT) greedy, max |logprob diff| (teacher forced), and at the first step
    where the tokens differ (if any) HF's margin between its own choice and the engine's (``hf_gap_at_flip``)."""
    rows = []
    for (prompt, lr), out, adir in zip(jobs, outputs, adapter_dirs):
        ref_lp, ref_argmax, gap = hf_teacher_forced(model_dir, adir, prompt, out.token_ids, gaps=True)
        got = vllm_logprobs(out)
        flips = [i for i, (a, b) in enumerate(zip(ref_argmax, out.token_ids)) if a != b]
        rows.append({"adapter": lr.lora_name if lr else None, "tokens": list(out.token_ids),
                     "tokens_equal": not flips,
                     "max_logprob_diff": max(abs(a - b) for a, b in zip(got, ref_lp)),
                     "hf_gap_at_flip": gap[flips[0]] if flips else None})
    return rows


def tokens_match(row: dict, tie_tol: float) -> bool:
    """A :func:`parity_report` row's greedy tokens agree with HF: equal, or first differing where HF's own margin
    between its token and the engine's is below ``tie_tol`` (a near-tie; 0 demands exact equality)."""
    gap = row["hf_gap_at_flip"]
    return row["tokens_equal"] or (gap is not None and gap < tie_tol)


def assert_parity(llm, model_dir, jobs, adapter_dirs, tol: float) -> list[dict]:
    """Runs ``jobs`` as one batch and asserts, per request, greedy tokens equal to HF(+PEFT) and
    max |logprob diff| < ``tol``; returns the :func:`parity_report` rows."""
    rows = parity_report(model_dir, jobs, generate_mixed(llm, jobs), adapter_dirs)
    for row in rows:
        assert row["tokens_equal"], row
        assert row["max_logprob_diff"] < tol, row
    return rows


# ------------------------------------------------------------------------------------ the OpenAI server in tests


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_call(url: str, payload=None, timeout: float = 120) -> tuple[int, str]:
    """(status, body) of a GET (payload None) or JSON POST; HTTP errors are returned, not raised."""
    import json
    import urllib.error
    import urllib.request

    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def start_server(model_dir, args, log_path, env: dict | None = None, startup_s: float = 300):
    """``bdlora serve MODEL args`` on 127.0.0.1 (in its own process group); returns (process, base URL) once /health answers."""
    import os
    import subprocess
    import time

    port = free_port()
    full_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
                    VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    full_env.pop("BDLORA_COUNT_COLLECTIVES", None)
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "bdlora.cli", "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           *args]
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, env=full_env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + startup_s
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
            try:
                if http_call(base + "/health", timeout=5)[0] == 200:
                    return proc, base
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server not up after {startup_s}s:\n{open(log_path).read()[-4000:]}")
            time.sleep(1)
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc) -> None:
    """SIGTERM to the server's process group (the server and the engine processes it started), then SIGKILL."""
    import os
    import signal
    import subprocess

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
