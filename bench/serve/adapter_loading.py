"""Time from loading an adapter into a running server to its first token: BD-LoRA through the plugin against vLLM's
LoRA (and S-LoRA) of the same trainable parameters.

    python -m bench.serve.adapter_loading --config bench/serve/configs/loading_8b_tp4.yaml --out OUT [--ranks 64]

For every (TP, method, rank) of the config's grid (the sweep's ``expand_grid``: BD at the rank matching the standard
rank's parameters, ``base`` skipped) one server starts with no adapter, ``--max-loras 1 --max-cpu-loras 1`` and
runtime LoRA updating on. Then ``repeats`` times, each under a new adapter name (so no cache of vLLM holds it):

1. ``POST /v1/load_lora_adapter`` with the adapter's folder, timed to its response (``load_s``);
2. one streamed completion naming it (the config's first load's input length, 2 output tokens): its first token,
   timed from the start of step 1 (``first_token_s``, what a user waits after asking for a new adapter);
3. the same request again, the adapter now resident (``warm_ttft_s``, the part of step 2 that is not loading);
4. ``POST /v1/unload_lora_adapter``.

Writes ``OUT/adapter_loading.json`` (per server: the adapter's rank, trainable parameters and file bytes, every
repeat's times and their medians) and ``OUT/adapter_loading.md`` (a table), and each server's log under OUT.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

from .artifacts import shape_from
from .client import RequestSpec, one_request, random_prompts
from .server import VLLMServer, install_stop_handlers
from .sweep import (METHOD_LABELS, config_model, device_info, expand_grid, load_config, prepare_adapters,
                    server_args, vllm_version)


class LoadingError(RuntimeError):
    pass


def post_json(url: str, body: dict, timeout_s: float = 600.0) -> str:
    """POSTs ``body``; returns the response text, or raises LoadingError with the server's answer."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        raise LoadingError(f"{url} answered {e.code}: {e.read().decode(errors='replace')[:500]}") from None


def loading_server_args(cfg: dict, sc, model_dir: Path) -> list[str]:
    """The sweep's server arguments for ``sc`` with one LoRA slot and no adapter registered at start."""
    args = server_args(cfg, replace(sc, method="base"), model_dir, [])  # TP, lengths, dtype, the config's args
    args += ["--enable-lora", "--max-lora-rank", str(sc.max_lora_rank), "--max-loras", "1", "--max-cpu-loras", "1"]
    if sc.method == "slora":
        args.append("--fully-sharded-loras")
    if sc.method == "bd":
        args += [str(a) for a in cfg.get("bd_args", ["--enable-bdlora"])]
    return args + [str(a) for a in cfg.get("method_args", {}).get(sc.method, [])]


def time_loading(url: str, name: str, adapter: Path, prompt: list[int]) -> dict:
    """Steps 1-4 of the module docstring for one adapter name."""
    import asyncio

    t0 = time.monotonic()
    post_json(url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter)})
    load_s = time.monotonic() - t0
    spec = RequestSpec(name, prompt, 2)
    first = asyncio.run(one_request(url + "/v1/completions", spec))
    warm = asyncio.run(one_request(url + "/v1/completions", spec))
    for r in (first, warm):
        if r["error_code"] is not None:
            raise LoadingError(f"request to adapter {name} failed: {r['error_msg']}")
    post_json(url + "/v1/unload_lora_adapter", {"lora_name": name})
    return {"load_s": load_s, "first_token_s": load_s + first["ttft_s"], "warm_ttft_s": warm["ttft_s"]}


def run(cfg: dict, out: Path, repeats: int, methods=None, ranks=None, log=print) -> list[dict]:
    shape = shape_from(cfg.get("model", {}))
    model_dir = config_model(cfg)
    it = int(cfg.get("loads", [{"it": 128}])[0]["it"])
    prompt = random_prompts(str(model_dir), 1, it, seed=0)[0]
    srv_cfg = cfg.get("server", {})
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **{str(k): str(v) for k, v in srv_cfg.get("env", {}).items()}}
    rows = []
    for sc in expand_grid(cfg, methods_filter=methods, ranks_filter=ranks):
        if sc.method == "base" or sc.skip_reason:
            continue
        (adapter,) = prepare_adapters(cfg, replace(sc, adapter_mode="single"), shape, model_dir)
        row = {"server_id": sc.id, "method": sc.method, "tp": sc.tp, "rank": sc.rank, "std_rank": sc.std_rank,
               "nblocks": sc.nblocks, "trainable_params": sc.trainable_params,
               "file_bytes": sum(f.stat().st_size for f in adapter.iterdir() if f.is_file()), "repeats": []}
        server = VLLMServer(model_dir, loading_server_args(cfg, sc, model_dir), out / sc.id / "server.log", env=env,
                            startup_timeout_s=float(srv_cfg.get("startup_timeout_s", 900)))
        try:
            with server:
                row["startup_s"], row["compile_s"] = server.startup_s, server.compile_s
                for i in range(repeats):
                    row["repeats"].append(time_loading(server.url, f"{sc.method}-r{sc.rank}-{i}", adapter, prompt))
        except Exception as e:  # record and go on with the next server
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["log_tail"] = server.tail(40)
        for key in ("load_s", "first_token_s", "warm_ttft_s"):
            vals = [r[key] for r in row["repeats"]]
            row[f"median_{key}"] = statistics.median(vals) if vals else None
        log(f"[{sc.id}] " + ("ERROR " + row["error"] if "error" in row else
                             f"load {row['median_load_s']:.3f} s, first token {row['median_first_token_s']:.3f} s, "
                             f"warm TTFT {row['median_warm_ttft_s']:.3f} s (medians of {repeats})"))
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| TP | method | rank | trainable params | file MiB | load (s) | load to first token (s) | warm TTFT (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        times = ("error", "", "") if r.get("error") else tuple(
            f"{r[f'median_{k}']:.3f}" for k in ("load_s", "first_token_s", "warm_ttft_s"))
        lines.append(f"| {r['tp']} | {METHOD_LABELS[r['method']]} | {r['rank']} | {r['trainable_params']:,} | "
                     f"{r['file_bytes'] / 2**20:.1f} | " + " | ".join(times) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a sweep config (bench/serve/configs/*.yaml)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=None, help="a subset of the config's methods, comma-separated")
    ap.add_argument("--ranks", default=None, help="a subset of the config's standard ranks, comma-separated")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {a.repeats}")
    install_stop_handlers()
    cfg = load_config(a.config)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run(cfg, out, a.repeats, a.methods and a.methods.split(","),
               a.ranks and [int(r) for r in a.ranks.split(",")])
    result = {"config": cfg.get("name"), "device": device_info(), "vllm": vllm_version(),
              "date": time.strftime("%Y-%m-%d"), "repeats": a.repeats, "servers": rows}
    (out / "adapter_loading.json").write_text(json.dumps(result, indent=2))
    (out / "adapter_loading.md").write_text(markdown(rows))
    print(markdown(rows))
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
