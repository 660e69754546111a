#!/usr/bin/env python3
"""The engine's pipeline stages where they are meant to win, against FSDP2: K jobs on a base one GPU cannot hold.

    python bench/train/pipeline_vs_fsdp.py --shape llama70b --gpus 4 --ks 4,8 --out R.json   # 4 GPUs
    python bench/train/pipeline_vs_fsdp.py --shape llama70b --gpus 2 --ks 4 --overflow-dir /dev/shm/pvf ...  # 2
    python bench/train/pipeline_vs_fsdp.py --cpu-smoke --out R.json                          # CPU: the script only

1. The base: a random-weight checkpoint of the shape (bf16), written shard by shard under ``--workdir`` once: a 70B
   shape is 140 GB, which no GPU holds, so each shard's tensors are drawn on a GPU, saved and freed.
2. The pipeline: ``bdlora sweep`` with ``pipeline_stages: G``, one process per GPU, each loading only its layers;
   K BD-LoRA jobs (N = ``--nblocks``, ranks cycling through ``--ranks``) of ``--steps`` steps of ``--batch`` examples
   (bench_engine's synthetic instructions), all in one run.
3. FSDP2: the same K jobs one after another, each ``accelerate launch --config_file
   examples/accelerate/fsdp2_1node.yaml --num_processes G -m bdlora.train`` with the same global batch. Not on CPU
   (accelerate's FSDP needs GPUs).

Per K: each side's real tokens over its wall time from launch to exit (loading included: the pipeline loads the base
once for K jobs, FSDP2 once per job) and over its training time alone (the pipeline's rounds; FSDP2's logged steps
after the first), and each GPU's peak memory as ``nvidia-smi`` saw it. ``--out`` (JSON) is rewritten after every
run. Each finished launch is kept under ``--workdir`` and not run again (an FSDP2 job is the same launch at every K:
K = 8 adds four jobs to K = 4's), so the same command in consecutive device calls on a warm machine (each stopped at
the call's limit) completes the comparison; ``--fresh`` starts over.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from bench_engine import make_data, save_json  # noqa: E402  (bench/train is on sys.path above)
from bench_trainer import SHAPES  # noqa: E402


def write_random_checkpoint(path: Path, shape: dict, dtype: str = "bfloat16", device: str = "cpu",
                            shard_bytes: int = 5 * 2**30, init_std: float = 0.02, overflow_dir: Path | None = None,
                            keep_free_bytes: int = 24 * 2**30) -> Path:
    """A random-weight Llama checkpoint (sharded safetensors + index, config, tokenizer), built without ever holding
    the whole model: names and shapes come from a meta-device model, each shard's tensors are drawn on ``device``.
    Norm weights are ones, every other tensor N(0, init_std). Written once (atomically); returns ``path``.
    ``overflow_dir``: a shard that would leave less than ``keep_free_bytes`` free on ``path``'s disk is written there
    instead, linked from ``path`` (a 70B shape, 128 GiB, on a 2-GPU machine's 128 GiB disk: the rest in /dev/shm);
    the space kept free holds one job's outputs (a 70B adapter of rank 128 with its optimizer states: ~11 GB)."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from bdlora.adapter import atomic_output_dir
    from bdlora.models import build_tokenizer, random_llama_config

    if (path / "config.json").is_file():
        return path
    config = random_llama_config(**shape, max_position_embeddings=4096, dtype=dtype, init_std=init_std)
    with torch.device("meta"):
        names = [(n, tuple(t.shape)) for n, t in LlamaForCausalLM(config).state_dict().items()]
    tdtype = getattr(torch, dtype)
    item = torch.tensor([], dtype=tdtype).element_size()
    shards, cur, size = [], [], 0
    for n, shp in names:
        nbytes = item * int(torch.Size(shp).numel())
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((n, shp))
        size += nbytes
    shards.append(cur)
    gen = torch.Generator(device=device).manual_seed(0)
    weight_map, total = {}, 0
    with atomic_output_dir(path) as tmp:
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for n, shp in shard:
                if n.endswith("norm.weight"):
                    t = torch.ones(shp, dtype=tdtype)
                else:
                    t = (torch.randn(shp, generator=gen, device=device) * init_std).to(tdtype).cpu()
                tensors[n] = t
                weight_map[n] = fname
                total += t.numel() * item
            nbytes = sum(t.numel() for t in tensors.values()) * item
            if overflow_dir is not None and shutil.disk_usage(tmp).free - nbytes < keep_free_bytes:
                overflow_dir.mkdir(parents=True, exist_ok=True)
                save_file(tensors, str(overflow_dir / fname), metadata={"format": "pt"})
                os.symlink(overflow_dir.resolve() / fname, tmp / fname)
            else:
                save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            del tensors
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        config.save_pretrained(str(tmp))
        build_tokenizer(tmp, vocab_size=shape["vocab_size"])
    return path


class GpuMemorySampler:
    """Each GPU's largest ``memory.used`` (MiB) while running, sampled by ``nvidia-smi`` every ``period_ms``; nothing
    on a machine without it."""

    def __init__(self, period_ms: int = 500):
        self.peak: dict[int, int] = {}
        self._proc = None
        self._thread = None
        self.period_ms = period_ms

    def __enter__(self):
        try:
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                           "-lms", str(self.period_ms)], stdout=subprocess.PIPE, text=True)
        except OSError:
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            try:
                idx, used = (int(x) for x in line.split(","))
            except ValueError:
                continue
            self.peak[idx] = max(self.peak.get(idx, 0), used)

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
        if self._thread is not None:
            self._thread.join(5)

    def gib(self) -> list[float]:
        return [round(self.peak[i] / 1024, 2) for i in sorted(self.peak)]


def jobs_for(k: int, ranks: list[int]) -> list[dict]:
    return [{"name": f"j{i}", "r": ranks[i % len(ranks)], "seed": i} for i in range(k)]


def common_keys(a, model: Path, data: Path) -> dict:
    """The job keys both sides share (bdlora train's vocabulary)."""
    return {"model": str(model), "train_file": str(data), "eval_fraction": 0.0, "nblocks": a.nblocks, "lora_alpha": 16,
            "precision": a.precision, "batch_size": a.batch, "max_steps": a.steps, "lr": 1e-4,
            "scheduler": "constant", "warmup_steps": 0, "max_length": 258, "progress": False, "report_to": [],
            "log_every": 1,
            **({"gradient_checkpointing": True, "gradient_checkpointing_every_n_layers": a.grad_ckpt_every}
               if a.grad_ckpt_every else {})}


def gc_tag(a) -> str:
    """The file-name suffix of a run with gradient checkpointing (its records never stand in for one without)."""
    return f"-gc{a.grad_ckpt_every}" if a.grad_ckpt_every else ""


def launch(cmd: list[str], log: Path, env: dict, timeout_s: float) -> tuple[int, float, list[float]]:
    """Runs ``cmd`` (its output to ``log``); returns (exit status, wall seconds, per-GPU peak GiB)."""
    t0 = time.monotonic()
    with open(log, "ab") as f, GpuMemorySampler() as mem:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - t0, mem.gib()


def fresh(path: Path) -> Path:
    """This script's own scratch output folder, emptied (a run of it is never resumed)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    return path


def drop_outputs(out: Path) -> None:
    """A measured launch's adapters and checkpoints, deleted once its record is written: K jobs' outputs on a 70B
    shape (GBs each) beside the checkpoint would fill a small disk (this script's own scratch; results.json kept)."""
    import shutil

    for p in out.iterdir() if out.is_dir() else ():
        if p.name not in ("results.json", "metrics.jsonl"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def finished(record: Path) -> dict | None:
    """A run this script finished in an earlier call on the same machine (kept under --workdir), else None."""
    return json.loads(record.read_text()) if record.is_file() else None


def run_pipeline(a, k: int, model: Path, data: Path, work: Path, env: dict) -> dict:
    name = f"pipeline-k{k}{gc_tag(a)}"
    record = work / f"{name}.done.json"
    if (done := finished(record)) is not None:
        return done
    out = fresh(work / name)
    run = {**common_keys(a, model, data), "output_dir": str(out), "pipeline_stages": a.gpus, "token_budget": a.budget,
           "save_every": 0, "save_plots": False, "eval_every": 10**9,
           "early_exit": {"enabled": False}, "jobs": jobs_for(k, a.ranks)}
    if a.memory_budget_gb is not None:
        run["memory_budget_gb"] = a.memory_budget_gb
    if a.cpu_smoke:
        run["device"] = "cpu"
    cfg = work / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(run))
    rc, wall, peaks = launch([sys.executable, "-m", "bdlora.train.engine", "--config", str(cfg)],
                             work / f"{name}.log", env, a.run_timeout)
    rec = {"rc": rc, "wall_s": wall, "peak_gib_per_gpu": peaks}
    res = out / "results.json"
    if rc == 0 and res.is_file():
        r = json.loads(res.read_text())
        tokens = sum(j.get("tokens", 0) for j in r["jobs"])
        if not tokens:  # every job refused (the memory model's admission) or stopped before a step: no result
            reasons = sorted({str(j.get("stop_reason")) for j in r["jobs"]})
            return {**rec, "rc": 1, "error": f"the pipeline trained no tokens: {'; '.join(reasons)} (see "
                    f"{name}.log; --budget lowers the token budget, --memory-budget-gb the admission limit)"}
        train_s = sum(x.get("train_s", 0.0) for x in r.get("rounds", []))
        rec.update(tokens=tokens, tokens_per_s_wall=tokens / wall, train_s=train_s,
                   tokens_per_s_train=tokens / train_s if train_s else None)
        save_json(rec, record)
        drop_outputs(out)
    return rec


def run_fsdp(a, k: int, model: Path, data: Path, work: Path, env: dict) -> dict:
    jobs, tokens, wall, train_s, peaks = [], 0, 0.0, 0.0, []
    for job in jobs_for(k, a.ranks):
        # a job is the same launch at every K (jobs_for: name, rank and seed by index), so it runs once for all Ks
        # and over several device calls: K = 8 adds j4-j7 to K = 4's four
        tag = f"fsdp-{job['name']}-r{job['r']}-s{job['seed']}{gc_tag(a)}"
        record = work / f"{tag}.done.json"
        done = finished(record)
        if done is None:
            out = fresh(work / tag)
            cfg = work / f"{tag}.yaml"
            keys = {**common_keys(a, model, data), "r": job["r"], "seed": job["seed"], "output_dir": str(out),
                    "batch_size": a.batch // a.gpus}
            cfg.write_text(yaml.safe_dump(keys))
            rc, w, p = launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                               str(ROOT / "examples/accelerate/fsdp2_1node.yaml"), "--num_processes", str(a.gpus),
                               "-m", "bdlora.train", "--config", str(cfg)], work / "fsdp.log", env,
                              a.run_timeout)
            recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()] if rc == 0 else []
            recs = [r for r in recs if "tokens_seen" in r and "time" in r]
            ran = {"job": job["name"], "rc": rc, "wall_s": w}
            if rc != 0 or len(recs) < 2:
                return {"rc": rc, "jobs": jobs + [ran], "error": f"job {job['name']} exited {rc} (see fsdp.log)"}
            # train_s: the steps after the first (its tokens counted too: the same bias on both sides)
            done = {"job": ran, "tokens": recs[-1]["tokens_seen"], "train_s": recs[-1]["time"] - recs[0]["time"],
                    "peaks": p}
            save_json(done, record)
            drop_outputs(out)
        jobs.append(done["job"])
        tokens, wall, train_s = tokens + done["tokens"], wall + done["job"]["wall_s"], train_s + done["train_s"]
        peaks = [max(x, y) for x, y in zip(peaks, done["peaks"])] if peaks else done["peaks"]
    return {"rc": 0, "jobs": jobs, "tokens": tokens, "wall_s": wall, "tokens_per_s_wall": tokens / wall,
            "train_s": train_s, "tokens_per_s_train": tokens / train_s if train_s else None, "peak_gib_per_gpu": peaks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama70b", choices=sorted(SHAPES))
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--ks", default="4,8")
    ap.add_argument("--ranks", default="16,32,64,128")
    ap.add_argument("--nblocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--budget", type=int, default=4096, help="the pipeline's token budget per micro-batch")
    ap.add_argument("--sides", default="pipeline,fsdp")
    ap.add_argument("--grad-ckpt-every", type=int, default=0, metavar="N",
                    help="gradient checkpointing on both sides, every N-th decoder layer (1: every one); 0: off")
    ap.add_argument("--workdir", default="/tmp/bdlora-pipeline-vs-fsdp")
    ap.add_argument("--overflow-dir", default=None,
                    help="checkpoint shards that would fill the workdir's disk go here (e.g. /dev/shm/pvf on a 2-GPU "
                         "machine, whose disk cannot hold a 70B shape)")
    ap.add_argument("--memory-budget-gb", type=float, default=None,
                    help="the pipeline's admission limit (the engine's memory_budget_gb; default 90%% of a GPU)")
    ap.add_argument("--run-timeout", type=float, default=3600.0, help="seconds for one launch before it is stopped")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape, 2 CPU processes (gloo), pipeline only")
    ap.add_argument("--fresh", action="store_true", help="run every launch again (not the checkpoint)")
    ap.add_argument("--keep-checkpoint", action="store_true",
                    help="keep the random checkpoint (and its --overflow-dir shards) after every launch succeeded; by "
                         "default it is removed then, so that a 70B shape does not fill the disk for what runs next")
    ap.add_argument("--out", default="pipeline_vs_fsdp.json")
    a = ap.parse_args(argv)
    a.ranks = [int(r) for r in a.ranks.split(",")]
    sides = a.sides.split(",")
    if a.cpu_smoke:
        a.shape, a.gpus, a.nblocks, a.batch, a.steps, a.ranks, a.precision = "tiny", 2, 2, 4, 3, [4, 8], "fp32"
        sides = [s for s in sides if s != "fsdp"]
    else:
        import torch

        a.precision = "bf16"
        if torch.cuda.device_count() < a.gpus:
            ap.error(f"--gpus {a.gpus}, but this machine has {torch.cuda.device_count()} GPUs (--cpu-smoke on CPU)")
    if a.batch % a.gpus:
        ap.error(f"--batch {a.batch} must divide over --gpus {a.gpus} (FSDP2's per-GPU batch)")
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if a.fresh:
        for record in work.glob("*.done.json"):
            record.unlink()
    t0 = time.monotonic()
    model = write_random_checkpoint(work / f"model-{a.shape}", SHAPES[a.shape],
                                    dtype="float32" if a.cpu_smoke else "bfloat16",
                                    device="cpu" if a.cpu_smoke else "cuda",
                                    overflow_dir=Path(a.overflow_dir) if a.overflow_dir else None)
    data = make_data(work / "task.jsonl", 2000)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = {"shape": {"name": a.shape, **SHAPES[a.shape]}, "gpus": a.gpus, "settings": {
        k: getattr(a, k) for k in ("ks", "ranks", "nblocks", "batch", "steps", "budget", "memory_budget_gb",
                                  "precision", "cpu_smoke", "grad_ckpt_every")},
        "checkpoint_s": time.monotonic() - t0, "date": time.strftime("%Y-%m-%d"), "runs": []}
    out = Path(a.out)
    for k in (int(x) for x in a.ks.split(",")):
        row = {"k": k}
        for side in sides:
            fn = run_pipeline if side == "pipeline" else run_fsdp
            row[side] = fn(a, k, model, data, work, env)
            print(f"[pipeline-vs-fsdp] K={k} {side}: {json.dumps(row[side])[:400]}", flush=True)
        if row.get("pipeline", {}).get("tokens_per_s_wall") and row.get("fsdp", {}).get("tokens_per_s_wall"):
            row["pipeline_over_fsdp_wall"] = row["pipeline"]["tokens_per_s_wall"] / row["fsdp"]["tokens_per_s_wall"]
            if row["pipeline"].get("tokens_per_s_train") and row["fsdp"].get("tokens_per_s_train"):
                row["pipeline_over_fsdp_train"] = (row["pipeline"]["tokens_per_s_train"]
                                                   / row["fsdp"]["tokens_per_s_train"])
        result["runs"].append(row)
        save_json(result, out)
    failed = [s for r in result["runs"] for s in sides if r[s].get("rc")]
    if not failed and not a.keep_checkpoint:
        remove_checkpoint(model)
    return 1 if failed else 0


def remove_checkpoint(path: Path) -> None:
    """Deletes a checkpoint :func:`write_random_checkpoint` wrote, its shards in the overflow folder included."""
    import shutil

    for f in path.iterdir():
        if f.is_symlink():
            f.resolve().unlink(missing_ok=True)
    shutil.rmtree(path)


if __name__ == "__main__":
    sys.exit(main())
