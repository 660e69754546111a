"""A small async streaming load client that follows the LLMPerf protocol (ray-project/llmperf,
``token_benchmark_ray.py``), for a vLLM OpenAI-compatible server.

Ray LLMPerf itself cannot be installed on these machines (no Ray, no network on the GPU box), so this client
reproduces what the paper's runs measured:

* requests go out in batches of ``BS`` concurrent requests; the next batch starts only when every request of the
  previous one finished; ``num_requests`` requests in total (paper: 128);
* every request has exactly ``IT`` input tokens (the prompt is a list of random token ids of the model's tokenizer,
  sent as token ids, so no re-tokenisation changes its length) and exactly ``OT`` output tokens
  (``max_tokens=OT``, ``ignore_eos=true``); the server's usage counts are checked against both;
* per request: ``ttft_s``, ``inter_token_latency_s`` (LLMPerf's definition: sum of the gaps between streamed tokens,
  first one = TTFT, divided by the output tokens), ``end_to_end_latency_s``, ``request_output_throughput_token_per_s``
  (output tokens / E2E), and ``tpot_s`` = (E2E - TTFT) / (OT - 1), the paper's "decoding latency";
* the summary uses LLMPerf's flattened layout (``results_<metric>_quantiles_p50``, ``..._mean``, ...,
  ``results_mean_output_throughput_token_per_s`` = all output tokens / wall time of the run).

Streaming uses ``/v1/completions`` with ``stream=true`` and ``stream_options.continuous_usage_stats`` so every
chunk carries the cumulative completion token count: token counts are exact even when a chunk's text is empty
(random token ids often decode to partial UTF-8).

HTTP goes through aiohttp when it is importable, otherwise through a minimal asyncio HTTP/1.1 client (the GPU box
has no guaranteed aiohttp).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence
from urllib.parse import urlparse

RESULTS_VERSION = "2023-08-31"  # LLMPerf's results layout version

# LLMPerf metric keys (llmperf/common_metrics.py)
INTER_TOKEN_LAT = "inter_token_latency_s"
TTFT = "ttft_s"
E2E_LAT = "end_to_end_latency_s"
NUM_INPUT_TOKENS = "number_input_tokens"
NUM_OUTPUT_TOKENS = "number_output_tokens"
NUM_TOTAL_TOKENS = "number_total_tokens"
REQ_OUTPUT_THROUGHPUT = "request_output_throughput_token_per_s"
ERROR_MSG = "error_msg"
ERROR_CODE = "error_code"
# ours, beside LLMPerf's: the paper's decoding latency (time per output token after the first)
TPOT = "tpot_s"

SUMMARY_METRICS = (INTER_TOKEN_LAT, TTFT, E2E_LAT, REQ_OUTPUT_THROUGHPUT, NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS, TPOT)
QUANTILES = (0.25, 0.5, 0.75, 0.9, 0.95, 0.99)


# ----------------------------------------------------------------------------------------------------------------
# prompts


def random_prompts(tokenizer_dir: str, num: int, input_tokens: int, seed: int) -> list[list[int]]:
    """``num`` prompts of exactly ``input_tokens`` random token ids of the tokenizer (special tokens excluded)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(input_tokens)] for _ in range(num)]


# ----------------------------------------------------------------------------------------------------------------
# HTTP: aiohttp or a tiny asyncio fallback, both yielding the SSE "data:" payloads of a streamed POST


class _HttpError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


async def _sse_data(chunks):
    """The payloads of the ``data:`` lines of a server-sent-event byte stream, however it is chunked."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip()


async def _sse_aiohttp(session, url: str, body: dict, timeout_s: float):
    import aiohttp

    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            raise _HttpError(resp.status, await resp.text())
        async for data in _sse_data(resp.content.iter_any()):
            yield data


async def _sse_raw(url: str, body: dict, timeout_s: float):
    """POST with a streamed (chunked or close-delimited) response over a plain asyncio connection."""
    u = urlparse(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
    try:
        payload = json.dumps(body).encode()
        head = (f"POST {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
        writer.write(head.encode() + payload)
        await writer.drain()
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        headers = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()

        async def chunks():
            if chunked:
                while True:
                    size_line = await reader.readline()
                    if not size_line:
                        return
                    size = int(size_line.split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        return
                    data = await reader.readexactly(size)
                    await reader.readexactly(2)
                    yield data
            else:
                while True:
                    data = await reader.read(65536)
                    if not data:
                        return
                    yield data

        if status != 200:
            text = b"".join([c async for c in chunks()]).decode(errors="replace")
            raise _HttpError(status, text)
        async for data in _sse_data(chunks()):
            yield data
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except Exception:
            pass


# ----------------------------------------------------------------------------------------------------------------
# one request


@dataclass
class RequestSpec:
    model: str  # served model name: the base model or a LoRA adapter name
    prompt: list[int]
    max_tokens: int


async def one_request(url: str, spec: RequestSpec, session=None, timeout_s: float = 600.0) -> dict[str, Any]:
    body = {
        "model": spec.model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "ignore_eos": True,
        "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    m: dict[str, Any] = {ERROR_CODE: None, ERROR_MSG: ""}
    gaps: list[float] = []
    ttft = 0.0
    n_out = 0
    n_in = len(spec.prompt)
    usage_prompt = None
    start = time.monotonic()
    last = start
    e2e = 0.0
    try:
        stream = _sse_aiohttp(session, url, body, timeout_s) if session is not None else _sse_raw(url, body, timeout_s)
        async for data in stream:
            if data == b"[DONE]":
                continue
            obj = json.loads(data)
            if "error" in obj:
                err = obj["error"]
                raise _HttpError(int(err.get("code") or 500) if str(err.get("code", "")).isdigit() else 500,
                                 str(err.get("message", err)))
            usage = obj.get("usage") or {}
            if usage.get("prompt_tokens") is not None:
                usage_prompt = usage["prompt_tokens"]
            count = usage.get("completion_tokens")
            if count is None:  # a server without continuous usage: one token per non-empty chunk
                count = n_out + (1 if obj.get("choices") and obj["choices"][0].get("text") else 0)
            if count > n_out:
                now = time.monotonic()
                if n_out == 0:
                    ttft = now - start
                    gaps.append(ttft)
                else:
                    gaps.append(now - last)
                last = now
                n_out = count
        e2e = time.monotonic() - start
    except Exception as e:  # LLMPerf records the error and keeps going
        m[ERROR_CODE] = getattr(e, "status", -1)
        m[ERROR_MSG] = f"{type(e).__name__}: {e}"[:2000]
        e2e = time.monotonic() - start
    if usage_prompt is not None:
        n_in = usage_prompt
    m[INTER_TOKEN_LAT] = sum(gaps) / n_out if n_out else 0.0
    m[TTFT] = ttft
    m[E2E_LAT] = e2e
    m[REQ_OUTPUT_THROUGHPUT] = n_out / e2e if e2e > 0 else 0.0
    m[NUM_INPUT_TOKENS] = n_in
    m[NUM_OUTPUT_TOKENS] = n_out
    m[NUM_TOTAL_TOKENS] = n_in + n_out
    m[TPOT] = (e2e - ttft) / (n_out - 1) if n_out > 1 else 0.0
    m["model"] = spec.model
    if m[ERROR_CODE] is None:
        if n_out != spec.max_tokens:
            m[ERROR_CODE], m[ERROR_MSG] = -2, f"got {n_out} output tokens, asked for exactly {spec.max_tokens}"
        elif n_in != len(spec.prompt):
            m[ERROR_CODE], m[ERROR_MSG] = -3, f"server counted {n_in} prompt tokens, sent {len(spec.prompt)}"
    return m


# ----------------------------------------------------------------------------------------------------------------
# the LLMPerf loop: batches of BS concurrent requests


async def _run_batches(url: str, specs: Sequence[RequestSpec], batch_size: int, timeout_s: float,
                       deadline: Optional[float]):
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - exercised on machines without aiohttp
        aiohttp = None
    results: list[dict] = []
    session = None
    if aiohttp is not None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False)
    try:
        t0 = time.monotonic()
        for i in range(0, len(specs), batch_size):
            if deadline is not None and time.monotonic() > deadline:
                break
            batch = specs[i:i + batch_size]
            sent = time.monotonic() - t0
            outs = await asyncio.gather(*(one_request(url, s, session, timeout_s) for s in batch))
            for o in outs:
                o["batch_index"] = i // batch_size
                o["request_start_time"] = sent  # LLMPerf's req_start_time: seconds since the run began
            results.extend(outs)
        t1 = time.monotonic()
    finally:
        if session is not None:
            await session.close()
    return results, t0, t1


def run_load(base_url: str, models: Sequence[str], prompts: Sequence[list[int]], output_tokens: int,
             batch_size: int, timeout_s: float = 600.0, deadline: Optional[float] = None):
    """Sends ``len(prompts)`` requests, request i to ``models[i % len(models)]``; returns (responses, t0, t1)."""
    url = base_url.rstrip("/") + "/v1/completions"
    specs = [RequestSpec(models[i % len(models)], list(p), output_tokens) for i, p in enumerate(prompts)]
    return asyncio.run(_run_batches(url, specs, batch_size, timeout_s, deadline))


# ----------------------------------------------------------------------------------------------------------------
# LLMPerf summary


def _quantile(sorted_vals: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (pandas' default, which LLMPerf uses)."""
    if not sorted_vals:
        return float("nan")
    pos = (len(sorted_vals) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def flatten_dict(d: dict, parent_key: str = "", sep: str = "_") -> dict:
    items: list[tuple[str, Any]] = []
    for k, v in d.items():
        key = f"{parent_key}{sep}{k}" if parent_key else k
        if isinstance(v, dict):
            items.extend(flatten_dict(v, key, sep).items())
        else:
            items.append((key, v))
    return dict(items)


def metrics_summary(responses: list[dict], start_time: float, end_time: float) -> dict:
    ok = [r for r in responses if r[ERROR_CODE] is None]
    ret: dict[str, Any] = {}
    for key in SUMMARY_METRICS:
        vals = sorted(float(r[key]) for r in ok)
        ret[key] = {
            "quantiles": {f"p{int(q * 100)}": _quantile(vals, q) for q in QUANTILES},
            "mean": statistics.fmean(vals) if vals else float("nan"),
            "min": vals[0] if vals else float("nan"),
            "max": vals[-1] if vals else float("nan"),
            "stddev": statistics.stdev(vals) if len(vals) > 1 else (0.0 if vals else float("nan")),
        }
    errors = [r[ERROR_CODE] for r in responses if r[ERROR_CODE] is not None]
    freq: dict[Any, int] = {}
    for e in errors:
        freq[e] = freq.get(e, 0) + 1
    wall = max(end_time - start_time, 1e-9)
    ret["num_requests_started"] = len(responses)
    ret["error_rate"] = len(errors) / len(responses) if responses else 0.0
    ret["number_errors"] = len(errors)
    ret["error_code_frequency"] = str(freq)
    ret["mean_output_throughput_token_per_s"] = sum(r[NUM_OUTPUT_TOKENS] for r in ok) / wall
    ret["num_completed_requests"] = len(ok)
    ret["num_completed_requests_per_min"] = len(ok) / wall * 60
    ret["wall_time_s"] = wall
    return ret


def llmperf_summary(name: str, model: str, input_tokens: int, output_tokens: int, batch_size: int,
                    responses: list[dict], t0: float, t1: float, metadata: Optional[dict] = None) -> dict:
    """LLMPerf's ``*_summary.json`` dict (flattened, ``results_`` prefix) plus our metadata keys."""
    summary = {
        "version": RESULTS_VERSION, "name": name, "model": model,
        "mean_input_tokens": input_tokens, "stddev_input_tokens": 0,
        "mean_output_tokens": output_tokens, "stddev_output_tokens": 0,
        "num_concurrent_requests": batch_size,
        "additional_sampling_params": {"ignore_eos": True, "temperature": 0.0},
        "results": metrics_summary(responses, t0, t1),
    }
    summary.update(metadata or {})
    summary["timestamp"] = int(time.time())
    return flatten_dict(summary)


__all__ = ["RequestSpec", "llmperf_summary", "metrics_summary", "one_request", "random_prompts", "run_load"]
