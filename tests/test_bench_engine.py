"""The engine benchmark's CPU paths: the pipeline-vs-data-parallel comparison (2 gloo processes) end to end, and the
config-only random-weight model of ``--shape llama8b``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from bench.train import bench_engine as B

ROOT = Path(__file__).resolve().parents[1]


def test_random_weights_folder_builds_on_load(tmp_path):
    """from_pretrained of a config-only folder builds the random model in the dtype asked; other paths untouched."""
    from transformers import AutoModelForCausalLM

    folder = B.write_config_folder(tmp_path / "m", dict(B.LLAMA8B_SMOKE_SHAPE, num_layers=1))
    assert not list(folder.glob("*.safetensors"))
    with B.RandomWeights(folder, torch.device("cpu")) as rw:
        m16 = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
        m32 = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        with pytest.raises(OSError):
            AutoModelForCausalLM.from_pretrained(str(tmp_path / "missing"))
    assert rw.builds == 2
    assert {p.dtype for p in m16.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in m32.parameters()} == {torch.float32}
    # same seed: the same weights whatever the dtype
    w16, w32 = m16.model.layers[0].mlp.up_proj.weight, m32.model.layers[0].mlp.up_proj.weight
    assert w32.shape == (896, 256) and torch.allclose(w16.float(), w32, atol=1e-2, rtol=1e-2)
    assert 0.015 < float(w32.detach().std()) < 0.025
    assert "from_pretrained" in AutoModelForCausalLM.__dict__  # restored: the class's own classmethod again
    assert AutoModelForCausalLM.from_pretrained.__func__.__name__ == "from_pretrained"


def test_trainer_data_is_the_token_lengths_asked_as_the_engine_encodes_it(tmp_path):
    """--seq: every record is exactly ``seq`` tokens as the trainer and the engine encode it (TokenLengths);
    --trainer-data: bench_trainer's records of 30-250 tokens, within those bounds and spread over them."""
    folder = B.write_config_folder(tmp_path / "m", dict(B.LLAMA8B_SMOKE_SHAPE, num_layers=1))
    data = B.trainer_data(tmp_path / "d.jsonl", folder, 12, 48, 48)
    lengths = B.TokenLengths(folder, data, 56).lengths
    assert len(lengths) == 12 and set(lengths.values()) == {48}
    data = B.trainer_data(tmp_path / "v.jsonl", folder, 200, 30, 250)
    lengths = list(B.TokenLengths(folder, data, 258).lengths.values())
    assert len(lengths) == 200 and 30 <= min(lengths) and max(lengths) <= 250
    assert 120 < sum(lengths) / len(lengths) < 160  # uniform over 30-250: mean ~140


def test_paired_summary_takes_each_repeats_own_ratio():
    """--repeats: per K the median / min / max over repeats of each repeat's ratio (paired), not a ratio of medians;
    a ratio a repeat could not form (a baseline cut by the time limit) is left out and counted."""
    entries = [{"k": 4, "repeat": 0, "engine_tokens_per_s": 100.0, "speedup_vs_engine_one_job": 0.9},
               {"k": 4, "repeat": 1, "engine_tokens_per_s": 130.0, "speedup_vs_engine_one_job": 1.1},
               {"k": 4, "repeat": 2, "engine_tokens_per_s": 120.0, "speedup_vs_engine_one_job": None},
               {"k": 1, "repeat": 0, "engine_tokens_per_s": 50.0}]
    paired = B.paired_summary(entries)
    assert paired["4"]["repeats"] == 3
    assert paired["4"]["engine_tokens_per_s"] == {"median": 120.0, "min": 100.0, "max": 130.0, "n": 3}
    assert paired["4"]["speedup_vs_engine_one_job"] == {"median": 1.0, "min": 0.9, "max": 1.1, "n": 2}
    assert "speedup_vs_trainer" not in paired["4"] and paired["1"]["repeats"] == 1


@pytest.mark.slow
def test_pipeline_vs_dp_cpu_smoke(tmp_path):
    out = tmp_path / "pvd.json"
    scratch = tmp_path / "scratch"  # a TMPDIR of its own: the random model and data it writes are removed at exit
    scratch.mkdir()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", TMPDIR=str(scratch))
    cmd = [sys.executable, str(ROOT / "bench" / "train" / "bench_engine.py"), "--pipeline-vs-dp", "--cpu-smoke",
           "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert not list(scratch.glob("bdlora-*")), list(scratch.iterdir())
    res = json.loads(out.read_text())
    assert res["partial"] is False and res["backend"] == "gloo" and res["processes"] == 2 and not res["skipped"]
    assert "pipeline.p2p_groups" in res["settings"]["p2p"]  # the engine's own message groups, no bench patch
    assert [e["k"] for e in res["experiments"]] == [1, 2]
    for e in res["experiments"]:
        dp, pp = e["dp"], e["pipeline"]
        assert dp["tokens"] == pp["tokens"] > 0 and e["same_tokens"]
        assert dp["tokens_per_s"] > 0 and pp["tokens_per_s"] > 0
        assert dp["active_jobs_first_round"] == e["k"] and pp["microbatches"] >= 3 * e["k"]
        assert e["pipeline"]["bubble_formula_max_D_minus_L_over_D"] == max((2 - e["k"]) / 2, 0.0)
        assert 0.0 <= pp["bubble_measured"] < 1.0 and 0.0 <= pp["bubble_schedule_unit_slots"] < 1.0
        assert set(dp["losses"]) == set(pp["losses"]) == {f"j{i}" for i in range(e["k"])}
        for job, d in dp["losses"].items():
            for key in ("final_train_loss", "final_eval_loss"):
                a, b = d[key], pp["losses"][job][key]
                assert math.isfinite(a) and math.isfinite(b) and 0 < a < 10
        # fp32 on CPU: the two parallel modes compute the same training up to summation order
        assert e["max_loss_rel_diff"] < 1e-4
        assert dp["peak_mem_gib_per_rank"] == pp["peak_mem_gib_per_rank"] == [None, None]  # CPU: no GPU peaks
    # one job on 2 stages: the pipeline waits for the job's own previous step (formula 0.5); the unit-slot
    # schedule of one job is exactly that
    assert res["experiments"][0]["pipeline"]["bubble_schedule_unit_slots"] == pytest.approx(0.5)


@pytest.mark.parametrize("flag,key,values", [("CUDNN_ATTENTION", "cudnn_attention", (False, True)),
                                             ("LOAD_IN_4BIT", "load_in_4bit", (False, True)),
                                             ("ATTN_IMPLEMENTATION", "attn_implementation", (None, "sdpa"))])
def test_process_flag_reaches_the_engine_and_its_trainer_baseline(tiny_llama_dir, tmp_path, monkeypatch, flag, key,
                                                                  values):
    """--cudnn-attention sets cudnn_attention, --load-in-4bit load_in_4bit, --masked-attention attn_implementation
    sdpa, for the engine's run and, through its jobs, for the sequential trainer's config; without the flag both
    keep the product's default."""
    data = B.make_data(tmp_path / "d.jsonl", 10, min_words=2, max_words=4)
    for value in values:
        monkeypatch.setattr(B, flag, value)
        run = B.engine_run_config(tiny_llama_dir, data, tmp_path / f"eng{value}", [{"name": "j0"}],
                                  dtype="float32", budget=256)
        cfg = B.trainer_config(run.jobs[0], model_path=tiny_llama_dir, data=data, out=tmp_path / "tr",
                               dtype="float32", val_fraction=0.1, steps=2)
        assert (getattr(run, key), getattr(cfg, key)) == (value, value)


def test_sequential_trainer_baseline_runs_the_engine_jobs_on_the_trainer(tiny_llama_dir, tmp_path):
    """trainer_config turns a parsed engine job into the single-job trainer's TrainConfig (same r, nblocks, alpha,
    lr, schedule, batch, steps, seed); run_trainer times its steps 2..n from metrics.jsonl and counts their tokens
    from tokens_seen, which the per-micro-batch sample records confirm."""
    from bdlora import load_adapter

    data = B.make_data(tmp_path / "d.jsonl", 40, min_words=2, max_words=8)
    jobs = [{"name": "j0", "r": 8, "nblocks": 2, "lora_alpha": 8, "lr": 1e-3, "batch_size": 2, "grad_accum": 2,
             "max_steps": 3, "seed": 4, "scheduler": "cosine"}]
    (job,) = B.engine_run_config(tiny_llama_dir, data, tmp_path / "eng", jobs, dtype="float32", budget=256,
                                 max_seq_len=64, val_fraction=0.1).jobs
    cfg = B.trainer_config(job, model_path=tiny_llama_dir, data=data, out=tmp_path / "tr", dtype="float32",
                           val_fraction=0.1)
    assert (cfg.r, cfg.nblocks, cfg.lora_alpha, cfg.lr, cfg.scheduler, cfg.batch_size, cfg.grad_accum, cfg.max_steps,
            cfg.seed, cfg.max_length, cfg.precision) == (8, 2, 8.0, 1e-3, "cosine", 2, 2, 3, 4, 64, "fp32")
    lengths = B.TokenLengths(tiny_llama_dir, data, 64)
    res = B.run_trainer(cfg, lengths)
    assert res["steps"] == 3 and res["seconds"] >= 0
    lines = [json.loads(line) for line in (tmp_path / "tr" / "samples.rank0.jsonl").read_text().splitlines()]
    micro = [rec["records"] for rec in lines if "records" in rec]
    assert len(micro) >= 3 * 2  # grad_accum micro-batches per step (then evaluation's)
    assert res["tokens"] == sum(lengths.lengths[i] for recs in micro[2:6] for i in recs) > 0
    ad = load_adapter(tmp_path / "tr" / "adapter")
    assert ad.config.nblocks == 2 and ad.config.r == 8


def test_early_exit_sweep_compares_the_same_grid_with_and_without(tmp_path, monkeypatch):
    """The early-exit benchmark runs one grid twice through the engine and reports the steps saved, both walls,
    each sweep's best job and the time to it, from the two runs' own results."""
    import bdlora.models as models
    from bench.train.early_exit_sweep import main as ee_main

    monkeypatch.setattr(models, "DEFAULT_CACHE", tmp_path / "cache")
    # one sweep per call, as on a machine lent in short calls: the comparison waits for both
    assert ee_main(["--out", str(tmp_path / "ee"), "--small", "--device", "cpu", "--part", "full"]) == 0
    assert not (tmp_path / "ee" / "early_exit.json").exists()
    assert ee_main(["--out", str(tmp_path / "ee"), "--small", "--device", "cpu", "--part", "early"]) == 0
    res = json.loads((tmp_path / "ee" / "early_exit.json").read_text())
    full = json.loads((tmp_path / "ee" / "full" / "results.json").read_text())["jobs"]
    early = json.loads((tmp_path / "ee" / "early" / "results.json").read_text())["jobs"]
    assert res["jobs"] == len(full) == len(early) == 4
    assert res["steps_full"] == sum(r["steps"] for r in full) == 4 * 8  # no job exits without early exit
    assert res["steps_early"] == sum(r["steps"] for r in early) < res["steps_full"]
    assert res["steps_saved_share"] == pytest.approx(1 - res["steps_early"] / res["steps_full"])
    assert "underperforming" in res["stop_reasons"].values()  # warm-up selection keeps the top quarter
    assert res["best_full"] == min(full, key=lambda r: r["best_eval_loss"])["job"]
    assert res["same_best"] == (res["best_full"] == res["best_early"])
    assert res["time_to_best_early_s"] == next(r["time_s"] for r in early if r["job"] == res["best_early"])


def test_peer_mlora_config_describes_the_engine_jobs(tmp_path):
    """The mLoRA side of the peer benchmark: K adapters with the engine jobs' ranks, alpha and dropout, every task
    one epoch over batch x steps records of the same data (mLoRA itself runs on the GPU machine, from its own
    checkout: no download here)."""
    import yaml

    from bench.train.bench_engine import make_data
    from bench.train.peer_mlora import DROPOUT, LR, TARGETS, main as peer_main, mlora_config

    data = make_data(tmp_path / "task.jsonl", 50)
    cfg = yaml.safe_load(mlora_config(tmp_path, data, [16, 32], 3, 4, 5, 256).read_text())
    assert cfg["dispatcher"]["concurrency_num"] == 3  # all jobs in one batch: mLoRA's BatchLoRA
    assert [(a["r"], a["alpha"], a["dropout"], a["lr"]) for a in cfg["adapters"]] == \
        [(16, 32, DROPOUT, LR), (32, 64, DROPOUT, LR), (16, 32, DROPOUT, LR)]
    assert all(set(a["target_modules"]) == set(TARGETS) and all(a["target_modules"].values())
               for a in cfg["adapters"])
    assert all((t["batch_size"], t["mini_batch_size"], t["num_epochs"], t["cutoff_len"]) == (4, 4, 1, 256)
               for t in cfg["tasks"])
    records = json.loads((tmp_path / "data.json").read_text())
    source = [json.loads(line) for line in data.read_text().splitlines()][:20]
    assert [(r["instruction"], r["input"], r["chosen"]) for r in records] == \
        [(s["instruction"], s["input"], s["output"]) for s in source]
    with pytest.raises(SystemExit) as e:  # a folder that is not an mLoRA checkout: named, no traceback
        peer_main(["--mlora-src", str(tmp_path), "--out", str(tmp_path / "r.json"), "--cpu-smoke"])
    assert e.value.code == 2


def test_peer_mlora_records_the_checkouts_own_commit(tmp_path):
    """The peer's commit in the results: its own repository's HEAD, or a copy's COMMIT file; a copy without either
    inside another repository (this one) records None, not the enclosing repository's commit."""
    import subprocess

    from bench.train.peer_mlora import _commit

    outer = tmp_path / "outer"
    (outer / "peer").mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q", str(outer)], check=True)
    subprocess.run([*git, "-C", str(outer), "commit", "-q", "--allow-empty", "-m", "outer"], check=True)
    assert _commit(outer / "peer") is None
    (outer / "peer" / "COMMIT").write_text("4abf120c10e9d96269383e27ac8cafd41f997216\n")
    assert _commit(outer / "peer") == "4abf120c10e9d96269383e27ac8cafd41f997216"
    head = subprocess.run(["git", "-C", str(outer), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert _commit(outer) == head


def test_random_checkpoint_is_written_shard_by_shard_and_loads(tmp_path):
    """pipeline_vs_fsdp's base for shapes no GPU holds: several shards with an index, loadable by transformers with
    every weight present (norms ones, the rest N(0, init_std))."""
    from transformers import AutoModelForCausalLM

    from bench.train.pipeline_vs_fsdp import SHAPES, write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "m", SHAPES["tiny"], dtype="float32", shard_bytes=2**20, init_std=0.05)
    shards = sorted(path.glob("model-*.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    sd = model.state_dict()
    assert set(index["weight_map"]) == set(sd)
    assert torch.equal(sd["model.norm.weight"], torch.ones(256))
    assert abs(sd["model.layers.1.mlp.down_proj.weight"].std().item() - 0.05) < 0.005
    assert write_random_checkpoint(path, SHAPES["tiny"]) == path  # written once


def test_random_checkpoint_overflows_to_a_second_folder(tmp_path):
    """--overflow-dir: shards that would leave too little free on the checkpoint's disk are written to the second
    folder and linked, and the checkpoint loads the same (here every shard overflows: keep_free_bytes is huge)."""
    from transformers import AutoModelForCausalLM

    from bench.train.pipeline_vs_fsdp import SHAPES, remove_checkpoint, write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "m", SHAPES["tiny"], dtype="float32", shard_bytes=2**20,
                                   overflow_dir=tmp_path / "shm", keep_free_bytes=2**62)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 2 and all(p.is_symlink() and p.resolve().parent == (tmp_path / "shm").resolve()
                                   for p in shards)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    remove_checkpoint(path)  # what the script does after its launches succeeded
    assert not path.exists() and list((tmp_path / "shm").iterdir()) == []


@pytest.mark.slow
def test_pipeline_vs_fsdp_cpu_smoke(tmp_path):
    """The pipeline side end to end on 2 CPU processes (FSDP2 needs GPUs): tokens and times from the run's results."""
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "train" / "pipeline_vs_fsdp.py"), "--cpu-smoke", "--ks",
                        "2", "--workdir", str(tmp_path / "w"), "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=400, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (row,) = json.loads(out.read_text())["runs"]
    pipe = row["pipeline"]
    assert row["k"] == 2 and "fsdp" not in row and pipe["rc"] == 0
    assert not (tmp_path / "w" / "model-tiny").exists()  # removed once every launch succeeded (--keep-checkpoint)
    assert pipe["tokens"] > 0 and 0 < pipe["train_s"] < pipe["wall_s"]
    assert pipe["tokens_per_s_train"] > pipe["tokens_per_s_wall"] > 0
    # the same command again (a later device call): the finished launch is kept, not run again
    again = subprocess.run([sys.executable, str(ROOT / "bench" / "train" / "pipeline_vs_fsdp.py"), "--cpu-smoke",
                            "--ks", "2", "--workdir", str(tmp_path / "w"), "--out", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=400,
                           env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    assert again.returncode == 0 and json.loads(out.read_text())["runs"][0]["pipeline"] == pipe


def test_fsdp_side_runs_each_job_once_over_several_calls(tmp_path, monkeypatch):
    """run_fsdp over consecutive device calls: a job that failed is run again in the next call, a finished one is
    not, and the totals add every job once (FSDP2 itself needs GPUs: the launch is replaced by one that writes the
    metrics a job logs)."""
    from types import SimpleNamespace

    import yaml

    import bench.train.pipeline_vs_fsdp as pvf

    launched, failing = [], {"j1"}

    def fake_launch(cmd, log, env, timeout_s):
        cfg = yaml.safe_load(Path(cmd[cmd.index("--config") + 1]).read_text())
        name = Path(cfg["output_dir"]).name.split("-")[1]  # fsdp-<job>-r<r>-s<seed>
        launched.append(name)
        if name in failing:
            return 1, 5.0, [1.0, 1.0]
        (Path(cfg["output_dir"]) / "adapter").mkdir(parents=True)
        (Path(cfg["output_dir"]) / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "time": 2.0 * s, "tokens_seen": 100 * s}) + "\n" for s in (1, 2, 3)))
        return 0, 10.0, [3.0, 4.0]

    monkeypatch.setattr(pvf, "launch", fake_launch)
    a = SimpleNamespace(ranks=[16, 32], nblocks=2, precision="fp32", batch=4, steps=3, gpus=2, run_timeout=60,
                        grad_ckpt_every=0)
    first = pvf.run_fsdp(a, 2, tmp_path / "m", tmp_path / "d.jsonl", tmp_path, {})
    assert first["rc"] == 1 and "job j1 exited 1" in first["error"] and launched == ["j0", "j1"]
    failing.clear()
    second = pvf.run_fsdp(a, 2, tmp_path / "m", tmp_path / "d.jsonl", tmp_path, {})
    assert launched == ["j0", "j1", "j1"]  # j0 finished in the first call
    assert second["rc"] == 0 and [j["job"] for j in second["jobs"]] == ["j0", "j1"]
    assert second["tokens"] == 600 and second["wall_s"] == 20.0 and second["train_s"] == 8.0
    assert second["peak_gib_per_gpu"] == [3.0, 4.0]
    # a measured job's adapter is deleted (K 70B adapters beside the base filled a 128 GiB disk), its metrics kept
    assert [p.name for p in (tmp_path / "fsdp-j0-r16-s0").iterdir()] == ["metrics.jsonl"]
    # K = 3 runs only the job K = 2 did not have (the same jobs by index at every K)
    third = pvf.run_fsdp(a, 3, tmp_path / "m", tmp_path / "d.jsonl", tmp_path, {})
    assert launched == ["j0", "j1", "j1", "j2"] and third["rc"] == 0 and third["tokens"] == 900
    # --grad-ckpt-every: its own launches (the records without checkpointing do not stand in), the keys in the jobs
    a.grad_ckpt_every = 2
    assert pvf.run_fsdp(a, 2, tmp_path / "m", tmp_path / "d.jsonl", tmp_path, {})["rc"] == 0
    assert launched[4:] == ["j0", "j1"]
    cfg = yaml.safe_load((tmp_path / "fsdp-j0-r16-s0-gc2.yaml").read_text())
    assert cfg["gradient_checkpointing"] is True and cfg["gradient_checkpointing_every_n_layers"] == 2


def test_pipeline_side_that_trained_nothing_is_a_failure(tmp_path, monkeypatch):
    """A pipeline run whose jobs were all refused (the memory model's admission) exits 0 with no tokens: recorded as
    a failure naming the reason and the way out, never as a finished launch of 0 tok/s."""
    from types import SimpleNamespace

    import yaml

    import bench.train.pipeline_vs_fsdp as pvf

    def fake_launch(cmd, log, env, timeout_s):
        cfg = yaml.safe_load(Path(cmd[cmd.index("--config") + 1]).read_text())
        Path(cfg["output_dir"]).mkdir(parents=True)
        (Path(cfg["output_dir"]) / "results.json").write_text(json.dumps({"jobs": [
            {"name": j["name"], "tokens": 0, "stop_reason": "refused: needs ~370 GiB alone"} for j in cfg["jobs"]]}))
        return 0, 30.0, [60.0, 60.0]

    monkeypatch.setattr(pvf, "launch", fake_launch)
    a = SimpleNamespace(ranks=[16, 32], nblocks=2, precision="fp32", batch=4, steps=3, gpus=2, run_timeout=60,
                        grad_ckpt_every=0, budget=4096, memory_budget_gb=None, cpu_smoke=False)
    rec = pvf.run_pipeline(a, 2, tmp_path / "m", tmp_path / "d.jsonl", tmp_path, {})
    assert rec["rc"] == 1 and "refused: needs ~370 GiB alone" in rec["error"] and "--memory-budget-gb" in rec["error"]
    assert not (tmp_path / "pipeline-k2.done.json").exists()


@pytest.mark.slow
def test_bench_trainer_profile_on_cpu(tmp_path):
    """bench_trainer --profile: the trainer side profiled over K steps after the warm-up (host seconds per step in
    the JSON line, the op tables beside --out), one run per --lora-backends entry with its modifiers (+synced:
    transformers' per-step token count; +walks: the Trainer's own module walks); CPU, tiny shape."""
    out = tmp_path / "bt.jsonl"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "train" / "bench_trainer.py"), "--shape", "tiny",
                        "--side", "trainer", "--steps", "3", "--warmup", "1", "--profile", "2", "--out", str(out),
                        "--lora-backends", "auto,auto+cudnn+pad64+packing+synced+walks", "--workdir", str(tmp_path / "w")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["side"] for r in recs] == ["bdlora trainer (lora_backend auto)",
                                         "bdlora trainer (lora_backend auto, packing, cuDNN attention, pad_multiple 64, "
                                         "synchronised every step, the Trainer's own module walks)"]
    assert [r["module_walks_listed"] for r in recs] == [True, False]
    for rec in recs:
        assert "error" not in rec and rec["profile_steps"] == 2 and rec["tok_per_s"] > 0
        prof = rec["profile"]
        assert prof["steps"] == 2 and prof["host_s_per_step"] > 0 and Path(prof["tables"]).is_file()
        assert "aten::mm" in Path(prof["tables"]).read_text()
    assert len({r["profile"]["tables"] for r in recs}) == 2  # each run's op table its own file
    configs = sorted((tmp_path / "w").glob("trainer-run-auto*/train_config.yaml"))
    assert [(c["cudnn_attention"], c["pad_multiple"], c["packing"],
             c["training_args"].get("include_num_input_tokens_seen"))
            for c in map(yaml.safe_load, map(Path.read_text, configs))] == [(False, None, False, None),
                                                                            (True, 64, True, "non_padding")]


def test_compile_startup_compares_whole_and_regional_compilation(tmp_path):
    """compile_startup.py: one record per mode (whole model, regional), the regional run tracing fewer ops and
    training the same adapter (AOTAutograd: bit for bit); CPU, 3 layers."""
    out = tmp_path / "s.jsonl"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "train" / "compile_startup.py"), "--layers", "3",
                        "--backend", "aot_eager", "--steps", "2", "--out", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    whole, regional = [json.loads(line) for line in out.read_text().splitlines()]
    assert (whole["regional"], regional["regional"]) == (False, True)
    assert regional["calls_captured"] < whole["calls_captured"] and regional["max_adapter_diff"] == 0.0


def test_bench_trainer_pairs_each_repeat_with_its_own_loop_run():
    """bench_trainer --repeats: a trainer run's ratio is to the loop of the same repeat; a repeat whose loop failed
    gives no ratio."""
    from bench.train.bench_trainer import paired_over_loop

    loop, tr = "plain PEFT loop", "bdlora trainer (lora_backend auto)"
    records = [{"side": loop, "repeat": 0, "tok_per_s": 100.0}, {"side": tr, "repeat": 0, "tok_per_s": 130.0},
               {"side": loop, "repeat": 1, "tok_per_s": 200.0}, {"side": tr, "repeat": 1, "tok_per_s": 220.0},
               {"side": loop, "repeat": 2, "error": "OOM"}, {"side": tr, "repeat": 2, "tok_per_s": 150.0}]
    paired = paired_over_loop(records)
    assert list(paired) == [tr] and paired[tr]["n"] == 2
    assert paired[tr]["min"] == pytest.approx(1.1) and paired[tr]["max"] == pytest.approx(1.3)
    assert paired[tr]["median"] == pytest.approx(1.2)


def test_bench_trainer_log_every_times_steps_between_logs(tmp_path):
    """bench_trainer --log-every N: the trainer logs every N steps and the per-step times are the intervals between
    logs over N; --warmup and --steps not multiples of N are refused; --sync-debug keeps the run's stderr."""
    out = tmp_path / "bt.jsonl"
    cmd = [sys.executable, str(ROOT / "bench" / "train" / "bench_trainer.py"), "--shape", "tiny", "--side",
           "trainer", "--out", str(out), "--workdir", str(tmp_path / "w")]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    bad = subprocess.run(cmd + ["--warmup", "3", "--steps", "4", "--log-every", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "multiples of --log-every" in bad.stderr and not out.exists()
    p = subprocess.run(cmd + ["--warmup", "2", "--steps", "4", "--log-every", "2", "--sync-debug"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert "error" not in rec and rec["log_every"] == 2 and rec["tok_per_s"] > 0
    assert len(rec["step_s"]) == 2 and rec["step_s_median"] in rec["step_s"]
    assert Path(rec["sync_debug"]).is_file()
    logs = map(json.loads, (tmp_path / "w" / "trainer-run-auto" / "metrics.jsonl").read_text().splitlines())
    assert [r["step"] for r in logs if "train_loss" in r] == [2, 4, 6]


def test_profiled_calls_covers_the_steady_calls_only():
    """The benches' profile window (bench_trainer.profiled_calls, bench_engine's --profile too): calls skip+1 ..
    skip+count of the method, the method restored after; a run that ends early still closes the profiler."""
    from bench.train.bench_trainer import profiled_calls

    events = []

    class Prof:
        def __enter__(self):
            events.append(("enter", len(calls)))

        def __exit__(self, *exc):
            events.append(("exit", len(calls)))

    class Loop:
        def step(self):
            calls.append(1)

    calls = []
    original = Loop.step
    with profiled_calls(Prof(), Loop, "step", skip=2, count=3) as done:
        for _ in range(7):
            Loop().step()
    assert events == [("enter", 2), ("exit", 5)] and done == [3] and Loop.step is original
    calls.clear(), events.clear()
    with profiled_calls(Prof(), Loop, "step", skip=1, count=5) as done:
        for _ in range(3):
            Loop().step()
    assert events == [("enter", 1), ("exit", 3)] and done == [2] and Loop.step is original


def test_gpu_idle_names_the_host_op_over_each_gap():
    """The profile summary's idle report: GPU activity merged across overlaps, each gap of >= 0.2 ms charged to the
    innermost host op spanning most of it, per step; short gaps ignored."""
    from types import SimpleNamespace as N

    from torch.autograd import DeviceType

    from bench.train.peft_bf16_loop import gpu_idle

    def ev(name, s, e, dev=DeviceType.CPU):
        return N(name=name, time_range=N(start=s, end=e), device_type=dev)

    kernels = [ev("k", s, e, DeviceType.CUDA) for s, e in [(0, 1000), (500, 2000), (2100, 5000), (8000, 10000)]]
    host = [ev("step", 0, 10000), ev("Optimizer.step", 5000, 8000), ev("aten::item", 5200, 7900)]
    r = gpu_idle(host + kernels, steps=2)
    assert r["wall_s_per_step"] == 0.005 and r["gpu_busy_share"] == 0.69  # 2,000 + 2,900 + 2,000 of 10,000 us
    assert r["idle_ms_per_step_by_host_op"] == {"aten::item": 1.5}  # the 100 us gap is below the threshold
    assert gpu_idle(host, steps=1) == {}


@pytest.mark.slow
def test_bench_engine_profile_cpu_smoke(tmp_path):
    """bench_engine --profile K: the engine's rounds and the trainer's steps after the first two, each side's per-step
    summary in the JSON and its op tables beside it."""
    out = tmp_path / "p.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "train" / "bench_engine.py"), "--cpu-smoke", "--profile",
                        "2", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path)))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    prof = json.loads(out.read_text())["profile"]
    assert [e["what"] for e in prof] == ["engine, K=2 jobs together", "single-job trainer (bdlora train), job 0"]
    for e in prof:
        assert e["steps"] >= 1 and e["host_s_per_step"] > 0 and Path(e["tables"]).is_file()
    assert "## engine, K=2 jobs together: steps 3-" in out.with_suffix(".profile.txt").read_text()
