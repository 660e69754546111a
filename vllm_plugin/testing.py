"""Probes for tests and benchmarks, run inside vLLM workers through ``LLM.collective_rpc`` (each takes the worker as
its first argument; with worker processes set ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` so callables can be sent).

* :func:`install_collective_counters` wraps the module-level collectives the LoRA layers call
  (``tensor_model_parallel_all_gather`` in ``column_parallel_linear``, ``tensor_model_parallel_all_reduce`` in
  ``row_parallel_linear``) and counts calls by caller: ``forward`` is the base model's own collective, anything else
  (``_mcp_apply``, ``apply``) is a LoRA collective. Run the engine with ``enforce_eager=True`` so calls are not
  traced away by torch.compile.
* :func:`lora_memory` reports the bytes one adapter occupies on a rank.
* :func:`read_fused_decode_counters` / :func:`reset_fused_decode_counters`: calls of the fused decode op
  (``bdlora_fused_decode``) by path; :func:`fused_decode_self_check` compares, on every BD layer of a worker, the
  fused op with vLLM's punica path for one token -> adapter mapping.
"""

from __future__ import annotations

import sys
from collections import Counter

COUNTS: Counter = Counter()

_TARGETS = (  # vllm_api touch points
    ("column_parallel_linear.tensor_model_parallel_all_gather", "all_gather"),
    ("row_parallel_linear.tensor_model_parallel_all_reduce", "all_reduce"),
)
#: Marker of the counting wrappers (not the plugin's own patches).
COUNTER_MARKER = "__bdlora_counter__"


def _counting(fn, op):
    def wrapper(*args, **kwargs):
        import torch

        if torch.compiler.is_compiling():  # graph mode: Dynamo cannot trace sys._getframe; count only eager calls
            return fn(*args, **kwargs)
        caller = sys._getframe(1).f_code.co_name
        COUNTS[("base" if caller == "forward" else "lora", op)] += 1
        return fn(*args, **kwargs)

    return wrapper


def install_collective_counters(worker=None) -> bool:
    from . import vllm_api as api

    for key, op in _TARGETS:
        api.wrap(key, lambda fn, op=op: _counting(fn, op), marker=COUNTER_MARKER)
    COUNTS.clear()
    return True


def reset_collective_counters(worker=None) -> bool:
    COUNTS.clear()
    return True


def read_collective_counters(worker=None) -> dict:
    return {f"{kind}:{op}": n for (kind, op), n in COUNTS.items()}


def reset_fused_decode_counters(worker=None) -> bool:
    from .layers import FUSED_COUNTS

    FUSED_COUNTS.clear()
    return True


def read_fused_decode_counters(worker=None) -> dict:
    """{"fused:triton" | "fused:torch": calls that ran bdlora's decode kernel, "folded:triton" | "folded:torch": the
    same in fold mode, "stock": calls above max_tokens that ran vLLM's punica path}, counted in this process since the
    last reset."""
    from .layers import FUSED_COUNTS

    return dict(FUSED_COUNTS)


def fused_decode_self_check(worker, lora_ids=None, pad: int = 3, seed: int = 0) -> dict:
    """Sets the token -> adapter mapping ``lora_ids`` (LoRA int ids, 0 = base; default: base and every adapter in a
    slot, twice) through the LoRA manager, then for every BD layer with fused decode feeds random inputs to vLLM's
    punica ``add_lora_linear`` (len(lora_ids) tokens) and to ``torch.ops.bdlora.lora_linear`` (the same tokens plus
    ``pad`` padding rows, as a CUDA graph of a larger size would) and returns the largest differences, whether the
    padding rows stayed untouched and whether the int32 slot map matches the mapping (-1 after it). Layers in fold
    mode also run ``torch.ops.bdlora.fold_linear`` on the same rows, checked against the base GEMM plus punica's
    result (``fold_max_abs_diff``; its padding rows must be the base output alone)."""
    import torch
    from vllm.lora.layers import LoRAMapping

    from .layers import FUSED_COUNTS

    mgr = _adapter_manager(worker)
    slots = list(mgr.lora_index_to_id)
    if lora_ids is None:
        active = [i for i in slots if i]
        lora_ids = ([0] + active) * 2
    want = [slots.index(i) if i else -1 for i in lora_ids]
    mgr.set_adapter_mapping(LoRAMapping(tuple(lora_ids), tuple(lora_ids), is_prefill=False))
    n = len(lora_ids)
    gen = torch.Generator().manual_seed(seed)
    out = {"layers": 0, "max_abs_diff": 0.0, "max_abs_lora": 0.0, "padding_untouched": True, "slots_ok": True,
           "slot_map": want, "fold_layers": 0, "fold_max_abs_diff": 0.0, "fold_max_abs_out": 0.0,
           "fold_shares_weight": True}

    def calls(kind):
        return sum(v for k, v in FUSED_COUNTS.items() if k.startswith(kind + ":"))

    before = {kind: calls(kind) for kind in ("fused", "folded")}
    for layer in mgr.modules.values():
        st = getattr(layer, "_bd_fused", None)
        if st is None or getattr(layer, "bd_fused_name", None) is None:
            continue
        a0 = layer.lora_a_stacked[0]
        d_in, d_out = a0.shape[-1], sum(layer.output_slices)
        buf = st.slots.buf
        out["slots_ok"] &= buf[:n].tolist() == want and bool((buf[n:] == -1).all())
        extra = max(0, min(pad, st.max_tokens - n))
        x = torch.randn(n + extra, d_in, generator=gen).to(a0.dtype).to(a0.device)
        y_stock = torch.zeros(n, d_out, dtype=a0.dtype, device=a0.device)
        layer.punica_wrapper.add_lora_linear(y_stock, x[:n], layer.lora_a_stacked, layer.lora_b_stacked, 1.0,
                                             layer.output_slices)
        y_fused = torch.zeros(n + extra, d_out, dtype=a0.dtype, device=a0.device)
        torch.ops.bdlora.lora_linear(y_fused, x, layer.bd_fused_name)
        out["layers"] += 1
        out["max_abs_diff"] = max(out["max_abs_diff"], float((y_fused[:n] - y_stock).abs().max()))
        out["max_abs_lora"] = max(out["max_abs_lora"], float(y_stock.abs().max()))
        out["padding_untouched"] &= bool((y_fused[n:] == 0).all())
        if st.folded is not None:
            base = torch.nn.functional.linear(x, st.folded.base)
            y_fold = torch.ops.bdlora.fold_linear(x, None, layer.bd_fused_name)
            out["fold_layers"] += 1
            out["fold_max_abs_diff"] = max(out["fold_max_abs_diff"],
                                           float((y_fold[:n] - (base[:n] + y_stock)).abs().max()))
            out["fold_max_abs_out"] = max(out["fold_max_abs_out"], float(y_fold.abs().max()))
            out["fold_shares_weight"] &= layer.base_layer.weight.data_ptr() == st.folded.w_ext.data_ptr()
            out["padding_untouched"] &= bool(torch.allclose(y_fold[n:], base[n:], rtol=1e-5, atol=1e-5))
    out["fused_calls"] = calls("fused") - before["fused"]
    out["folded_calls"] = calls("folded") - before["folded"]
    return out


def _adapter_manager(worker):
    runner = getattr(worker, "model_runner", worker)
    return runner.lora_manager._adapter_manager


def _nbytes(t) -> int:
    if t is None:
        return 0
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def lora_memory(worker, lora_int_id: int) -> dict:
    """Bytes of one adapter on this rank: ``loaded`` (the LoRAModel tensors kept on the host), ``slot`` (its slot
    in the stacked buffers of every LoRA layer), plus ``buffer_rank`` and layer-class names."""
    mgr = _adapter_manager(worker)
    model = mgr._registered_adapters[lora_int_id]
    loaded = sum(_nbytes(w.lora_a) + _nbytes(w.lora_b) for w in model.loras.values())
    slot = mgr.lora_index_to_id.index(lora_int_id) if lora_int_id in mgr.lora_index_to_id else None
    slot_bytes = 0
    ranks, classes = set(), set()
    for layer in mgr.modules.values():
        stacked_a = getattr(layer, "lora_a_stacked", None)
        if stacked_a is None or not isinstance(stacked_a, tuple):
            continue
        classes.add(type(layer).__name__)
        for a, b in zip(layer.lora_a_stacked, layer.lora_b_stacked):
            ranks.add(int(a.shape[2]))
            if slot is not None:
                slot_bytes += _nbytes(a[slot]) + _nbytes(b[slot])
    loaded_shapes = {
        name: ([tuple(x.shape) for x in w.lora_a] if isinstance(w.lora_a, list) else tuple(w.lora_a.shape),
               [tuple(x.shape) for x in w.lora_b] if isinstance(w.lora_b, list) else tuple(w.lora_b.shape))
        for name, w in model.loras.items()
    }
    return {"loaded": loaded, "slot": slot_bytes, "buffer_ranks": sorted(ranks), "classes": sorted(classes),
            "shapes": loaded_shapes}


def lora_layer_classes(worker) -> dict:
    mgr = _adapter_manager(worker)
    return {name: type(layer).__name__ for name, layer in mgr.modules.items()}


# ----------------------------------------------------------------------------------------------- references


def make_peft_adapter(model_dir, out_dir, peft_config, seed: int = 0, std: float = 0.05):
    """Saves a PEFT adapter of ``peft_config`` on the model at ``model_dir`` with random (non-zero) factors.

    PEFT initialises lora_B to zero; every LoRA factor is refilled with N(0, std^2) so the adapter visibly changes
    outputs. Works for BD (``BDLoraSpec.to_peft_config()``) and dense ``LoraConfig`` alike.
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
    model.save_pretrained(str(out_dir))
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


def make_bad_adapters(good_bd2: str, too_big: str, root) -> list[tuple[str, str, int, tuple[str, ...]]]:
    """Broken copies of a good BD adapter (nblocks=2, r=8, on the tests' tiny Llama: q_proj 256 x 256) for refusal
    tests: [(name, path, expected HTTP status, substrings the message must contain, also after the OpenAI server
    replaced file paths in it by "<path>")]. ``too_big``: an adapter that
    does not fit the engine's per-device buffers (a dense r=16 one at TP=2, max_lora_rank 16)."""
    import json
    import os
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    root = str(root)
    cfg_name, w_name = "adapter_config.json", "adapter_model.safetensors"

    def copy(name):
        dst = os.path.join(root, name)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(good_bd2, dst)
        return dst

    out = []
    p = copy("bad-json")  # a hand-edited config with a trailing comma
    with open(os.path.join(p, cfg_name)) as f:
        text = f.read()
    with open(os.path.join(p, cfg_name), "w") as f:
        f.write(text.rstrip().rstrip("}") + ', }')
    out.append(("bad-json", p, 400, ("bad-json", cfg_name, "JSON")))
    p = copy("truncated")  # an interrupted copy
    w = os.path.join(p, w_name)
    size = os.path.getsize(w)
    with open(w, "r+b") as f:
        f.truncate(size // 2)
    out.append(("truncated", p, 400, ("truncated", w_name, "truncated or corrupt")))
    p = copy("wrong-shape")  # q_proj's B of another model (d_out 384 instead of 256)
    tensors = load_file(os.path.join(p, w_name))
    for k in list(tensors):
        if "layers.0.self_attn.q_proj.lora_B" in k:
            b = tensors[k]
            tensors[k] = torch.cat([b, b[: b.shape[0] // 2]])
    save_file(tensors, os.path.join(p, w_name))
    out.append(("wrong-shape", p, 400, ("wrong-shape", w_name, "model.layers.0.self_attn.q_proj", "384 x 256",
                                        "256 x 256", "trained for another model")))
    missing = os.path.join(root, "does-not-exist")
    out.append(("missing", missing, 404, ("missing", "No adapter found")))
    p = copy("nblocks3")
    with open(os.path.join(p, cfg_name)) as f:
        cfg = json.load(f)
    cfg["r"], cfg["use_bdlora"]["nblocks"] = 6, 3
    with open(os.path.join(p, cfg_name), "w") as f:
        json.dump(cfg, f)
    out.append(("nblocks3", p, 400, ("nblocks3", "nblocks=3 but tensor-parallel size is 2")))
    out.append(("too-big", str(too_big), 400, ("too-big", "needs rank 16 on each of the 2 devices")))
    p = copy("no-config")
    os.remove(os.path.join(p, cfg_name))
    out.append(("no-config", p, 400, ("no-config", cfg_name)))
    p = copy("ghost")  # module names of a deeper model
    tensors = load_file(os.path.join(p, w_name))
    save_file({k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}, os.path.join(p, w_name))
    out.append(("ghost", p, 400, ("ghost", "do not exist in the base model")))
    out.append(("a-file", os.path.join(good_bd2, w_name), 400, ("a-file", "is a file")))
    return out


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
    """``bdlora serve MODEL args`` on 127.0.0.1 (a new session); returns (process, base URL) once /health answers."""
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
