"""Multi-LoRA engine benchmark (GPU): BatchLoRA throughput vs sequential single-job runs, an early-exit sweep, and
(2 GPUs) the LoRAPP pipeline vs data parallel.

    python bench/train/bench_engine.py --random-smollm2-shape --out R.json           # H100/H200, SmolLM2-135M shape
    python bench/train/bench_engine.py --shape llama8b --out R8.json                  # H200, Llama-3.1-8B shape
    python bench/train/bench_engine.py --pipeline-vs-dp --out P.json                  # 2 GPUs (NCCL), spawns 2 ranks
    python bench/train/bench_engine.py --shape llama8b --load-in-4bit --out Q.json    # jobs on one 4-bit base
    python bench/train/bench_engine.py --cpu-smoke [--shape llama8b | --pipeline-vs-dp] --out /tmp/x.json   # CPU
    bash bench/train/gpu_run.sh                                                        # the device-call wrapper

0. Warm-up, untimed: the engine runs every rank alone and all ranks together for 2 steps (the grouped kernel's
   compile-time tile sizes follow the largest active rank), and the single-job trainer runs 3 steps.
1. Throughput: K = 1, 4, 8, 16 jobs (mixed ranks, BD N=3, SmolLM2's TP degree) trained together by the engine
   (one base GEMM per layer over all jobs' tokens, grouped BD-LoRA kernel) vs the same K jobs run one after another
   with the single-job PEFT trainer (``bdlora.train.run_training``, a TrainConfig made from each job: same model,
   r, nblocks, lora_alpha, init, lr, scheduler, batch size, max_length, max_steps, seed and data file). Tokens/s counts
   the jobs' real (unpadded) input tokens over training time only: the engine's rounds after the first (each
   round's training part, which ends on a host sync; evaluation excluded), the trainer's optimizer steps after the
   first, timed by its per-step metrics records (model load, tokenization, final evaluation and adapter save
   excluded; ``sequential_trainer_wall_s`` has the whole calls). Job i is the same in every K, so each sequential
   job runs once and the baseline of K is the first K jobs: their tokens over their step seconds (cut by the
   time limit, the jobs that ran, when they cover every rank; ``sequential_trainer_jobs_run``). Extra column:
   the engine itself with one active job at a time (``max_active_jobs=1``), for the first ``--engine-seq-jobs``
   jobs. Known differences that are the trainer's design: it keeps an fp32 base and autocasts to bf16 (the engine
   stores the base in bf16), pads each batch to its longest example, computes logits at every position, and
   splits train/validation with the job's seed (the engine with the dataset's seed 0), so jobs with seed != 0
   see a slightly different training subset (token counts of both sides are exact, measured per step).
2. Sweep: 16 configurations (4 learning rates x 4 ranks) on one task, with ALTO early exit (w=2, p=2,
   tau_slope=0.001, tau_gap=0.1, 5% warm-up, keep 25%) vs without: wall time, tokens trained, best val loss.

Everything runs in one process. Measured 453 s on an H200 with 80 sweep steps and the engine-at-one-job baseline
for all 16 jobs; now (60 sweep steps, trainer baseline for the 16 jobs, engine-at-one-job for 4, the longer
warm-up) estimated 5-7 min on an H100/H200, not yet measured. ``--time-limit`` (420 s) skips an experiment whose
estimated end is past it and lists it under ``skipped`` in the JSON. ``--random-smollm2-shape`` uses random weights
in SmolLM2's shape (same cost) where the SmolLM2 package is missing. Data: a synthetic instruction task (reverse /
sort / count words), written to a temp dir.

``--shape llama8b``: sections 0-1 only (no sweep), K = 1, 4, 8, on Llama-3.1-8B layer shapes (hidden 4096,
intermediate 14336, 32 heads / 8 KV heads; vocabulary 32000 like the serving benchmark's llama8b shape, the
tokenizer is the small locally trained one), BD N=4 (a TP=4 serving layout), ranks 16/32/64/128, the engine's own
token budget (``token_budget: auto``, recorded per run; ``--token-budget T``: T, the engine refusing jobs its memory
model does not admit at it), random weights. No
checkpoint is written: the folder holds config.json + tokenizer only and ``AutoModelForCausalLM.from_pretrained``
of that folder is patched, for the engine and the trainer alike, to build the random model directly on the GPU in
the dtype asked (bf16 engine, fp32 trainer base), seeded, so model "loads" cost about a second. ``--num-layers``
(default 32, the full model) reduces the decoder depth to save time; with fewer layers the tokens/s numbers and
their ratios are comparisons at Llama-8B *layer* shapes (the embedding / LM head share is larger than in the
real model), not of the whole 8B model. Estimated (not measured): ~2.5-3 min on one H200 at 32 layers, inside
the 240 s default ``--time-limit``. The JSON records the shape, the layer count and every setting.

``--pipeline-vs-dp``: the same K jobs (default K = 1, 2, 4, 8; SmolLM2-135M shape, random weights, bf16, BD N=3,
ranks 12-96, batch 8, 12 steps, token budget 2048) trained on 2 processes (2 GPUs with NCCL, or 2 CPU processes with
gloo under ``--cpu-smoke``) two ways, started by this one command (torch.multiprocessing):

* ``dp``: the engine's data parallel mode (``pipeline_stages: 1``, WORLD_SIZE 2): each round's packed micro-batches
  are dealt round-robin to the ranks and every job's LoRA gradients all-reduced, one all-reduce per factor tensor as
  the engine does it (with few micro-batches per round the second GPU idles: K=1 has one micro-batch per round);
* ``pipeline``: LoRAPP (``bdlora.train.engine.pipeline``, 2 stages of 15 layers; single-job micro-batches
  interleaved over the jobs).

Per K and mode: tokens/s (all jobs' real tokens over the training loop: dp = the rounds' training parts, pipeline =
its schedule loop; an untimed warm-up of both modes runs first), the pipeline's measured bubble (1 - busy/wall per
stage, averaged), the unit-slot schedule bubble and mLoRA's formula max((D-L)/D, 0) with D = 2 stages, L = K jobs,
per-job final train / validation losses of both modes and their largest relative difference (same data, same
init: they agree up to bf16 summation order on GPU and to ~1e-5 in fp32 on CPU), and the peak memory of each GPU
(dp: the largest round's peak, full model + activations; pipeline: the engine's per-stage peak after the stage
split, i.e. its stage's layers + activations). The processes start their group with the engine's
``init_distributed`` (each bound to its own GPU); the pipeline's messages use the engine's two point-to-point groups,
one per direction (``pipeline.p2p_groups``, created here right after the start with the script's hang timeout).
Estimated (not measured) ~2 min on 2 H200s; ``--time-limit`` 200 s.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

WORDS = ("the a one two three four five six seven eight nine ten red blue green cat dog bird fish tree house river "
         "moon sun star run jump swim read write sing small big fast slow happy sad old new left right").split()


def make_data(path: Path, n: int, seed: int = 0, min_words: int = 8, max_words: int = 80) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ws = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
            task = rng.choice(["reverse", "sort", "count"])
            if task == "reverse":
                out = " ".join(ws[::-1])
            elif task == "sort":
                out = " ".join(sorted(ws))
            else:
                out = f"{len(ws)} words"
            f.write(json.dumps({"instruction": f"{task} the words", "input": " ".join(ws), "output": out}) + "\n")
    return path


def trainer_data(path: Path, model_folder: Path, n: int, min_len: int, max_len: int) -> Path:
    """``n`` plain-text records of ``min_len``..``max_len`` tokens: bench_trainer.py's data, so that a table's
    trainer and engine rows count the tokens of the same kind of examples."""
    try:
        from bench.train.bench_trainer import build_data
    except ImportError:  # run as a script: bench/train is on sys.path, the repository root may not be
        from bench_trainer import build_data
    return build_data(path, model_folder, n, min_len, max_len)


PRECISION_OF = {"float32": "fp32", "bfloat16": "bf16"}  # this script's --dtype names -> the config's precision
LORA_BACKEND = "auto"  # the engine's lora_backend in every run of this process (--lora-backend)
KERNEL_TUNING: dict = {}  # KernelOptions fields every engine of this process gets (--dropout-route, --dsdb)
PAD_MULTIPLE = None  # the engine's pad_multiple in every run of this process (--pad-multiple; None = its auto)
USE_LIGER = None  # use_liger_kernel of every engine and trainer run of this process (--use-liger-kernel; None = auto)
CUDNN_ATTENTION = False  # cudnn_attention of every engine and trainer run of this process (--cudnn-attention)
GRAD_CKPT_EVERY = 0  # gradient checkpointing of every engine and trainer run: every n-th layer, 0 off (--grad-ckpt-every)
LOAD_IN_4BIT = False  # every engine and trainer run on a bitsandbytes 4-bit base (--load-in-4bit)
ATTN_IMPLEMENTATION = None  # attn_implementation of every engine and trainer run (--masked-attention: sdpa)
MEMORY_BUDGET_GB = None  # memory_budget_gb of every engine run (--memory-budget-gb; None = 90% of the GPU)


def engine_run_config(model_path, data, out, jobs, *, dtype, budget, early_exit=None, max_active=64,
                      eval_every=10**9, max_seq_len=256, val_fraction=0.02, **extra):
    """A parsed RunConfig (the run file's keys, bdlora.train.config's vocabulary); ``dtype`` float32 | bfloat16,
    the base's; ``extra``: further top-level keys (device, pipeline_stages, ...). Jobs default to nblocks 1 and a
    constant schedule without warm-up unless they say otherwise (the settings these benchmarks were defined with)."""
    from bdlora.train.engine import parse_run

    return parse_run({
        "lora_backend": LORA_BACKEND, "pad_multiple": PAD_MULTIPLE, "use_liger_kernel": USE_LIGER,
        "cudnn_attention": CUDNN_ATTENTION, "attn_implementation": ATTN_IMPLEMENTATION, "nblocks": 1,
        **({"memory_budget_gb": MEMORY_BUDGET_GB} if MEMORY_BUDGET_GB else {}),
        **({"gradient_checkpointing": True, "gradient_checkpointing_every_n_layers": GRAD_CKPT_EVERY}
           if GRAD_CKPT_EVERY else {}),
        **({"load_in_4bit": True} if LOAD_IN_4BIT else {}),
        "scheduler": "constant",
        "warmup_ratio": 0.0,
        **extra,
        "model": str(model_path), "output_dir": str(out), "precision": PRECISION_OF[dtype], "token_budget": budget,
        "max_active_jobs": max_active, "eval_every": eval_every, "log_every": 10**9, "save_plots": False,
        "save_every": 0, "train_file": str(data), "eval_fraction": val_fraction, "max_length": max_seq_len,
        "jobs": jobs, "early_exit": early_exit or {"enabled": False},
    })


def run_engine(model_path, data, out, jobs, **kw):
    from bdlora.train.engine.engine import Engine

    free_memory()
    eng = Engine(engine_run_config(model_path, data, out, jobs, **kw))
    eng.ctx.kernel_tuning = dict(KERNEL_TUNING)
    t0 = time.perf_counter()
    rows = eng.run()
    wall = time.perf_counter() - t0
    return eng, rows, wall


def free_memory() -> None:
    """Drop earlier runs' models (engines hold reference cycles) before the next one loads its own. Peak memory is
    the engine's own (data parallel resets its counter every round, the pipeline after its stage split)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_peak_gib(eng):
    """Peak GPU memory of an engine run: the engine resets the peak counter every round and records each round's
    peak for its memory model, so the run's peak is the largest of those and of the counter now (final eval)."""
    if eng.device.type != "cuda":
        return None
    return max([p[3] for p in eng.memory.points] + [torch.cuda.max_memory_allocated(eng.device)]) / 2**30


def save_json(result: dict, path: Path) -> None:
    """Atomic write (a reader, or a timeout killing the run, never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, path)


def steady_tokens_per_s(round_log, skip_first: int) -> float:
    """Tokens over training seconds of the rounds after the first ``skip_first``. A round's ``train_s`` covers the
    packing, forward/backward and optimizer steps only (it ends on a host sync), never the evaluation after it."""
    rounds = round_log[skip_first:] or round_log[-1:]
    tok = sum(r["tokens"] for r in rounds)
    sec = sum(r["train_s"] for r in rounds)
    return tok / sec if sec else float("nan")


def engine_one_job_stats(round_log, n_jobs: int, steps: int) -> list[dict]:
    """Per-job (tokens, seconds) of an engine run with ``max_active_jobs=1``: job i holds rounds
    [i*steps, (i+1)*steps); each job's first round is left out, like the trainer's first step."""
    if len(round_log) != n_jobs * steps or any(r["active"] != 1 for r in round_log):
        raise RuntimeError(f"engine at one job: expected {n_jobs}x{steps} one-job rounds, got {len(round_log)}")
    out = []
    for i in range(n_jobs):
        rounds = round_log[i * steps + 1:(i + 1) * steps] or round_log[i * steps:(i + 1) * steps]
        out.append({"tokens": sum(r["tokens"] for r in rounds), "seconds": sum(r["train_s"] for r in rounds)})
    return out


class TokenLengths:
    """Token count of every record of a data file, encoded exactly as the trainer encodes it (chat template,
    truncation to max_length): the trainer's non-pad tokens of a batch are the sum over its records."""

    def __init__(self, model_path, data, max_len: int):
        from bdlora.train.data import encode_record, read_records
        from bdlora.train.trainer import load_tokenizer

        tok = load_tokenizer(Path(model_path))
        self.lengths = {}
        for i, rec in enumerate(read_records(data)):
            ex = encode_record(tok, rec, "auto", max_len, index=i)
            if ex is not None:
                self.lengths[i] = len(ex.input_ids)


def trainer_config(job, *, model_path, data, out, dtype, val_fraction, steps=None):
    """The single-job trainer's TrainConfig of an engine job (a parsed JobConfig): same model, rank, nblocks,
    alpha, init, optimizer, schedule, batch, sequence limit, steps, seed and data file."""
    from bdlora.train.config import TrainConfig

    sched = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear",
             "cosine": "cosine"}.get(job.scheduler)
    if sched is None or tuple(job.adam_betas) != (0.9, 0.999) or job.adam_eps != 1e-8:
        raise ValueError(f"job {job.name}: scheduler {job.scheduler!r} / AdamW betas {job.adam_betas} eps "
                         f"{job.adam_eps} have no single-job trainer equivalent")
    n_steps = int(steps or job.max_steps)
    # the job's own keys, with the run's data and output and one metrics record per step
    keys = {f: getattr(job, f) for f in TrainConfig.valid_keys()}
    keys.update(model=str(model_path), train_file=str(data), eval_file=None, eval_fraction=val_fraction,
                scheduler=sched, warmup_steps=job.warmup_for(n_steps), max_steps=n_steps,
                # both load the base in bf16 (no fp32 copy) and keep the adapter and AdamW states in fp32
                precision=PRECISION_OF[dtype], eval_every=0, save_every=0, log_every=1, output_dir=str(out),
                resume=None, report_to=["none"], progress=False, record_samples=True, training_args={})
    return TrainConfig.from_dict(keys, source=f"trainer config of job {job.name}")


def run_trainer(cfg, lengths: TokenLengths) -> dict:
    """One ``run_training`` call; tokens/s over its optimizer steps after the first (model load, tokenization,
    the final evaluation and the adapter save are outside), timed by the trainer's own per-step metrics records
    (``{"step", "time", "train_loss", "tokens_seen", ...}``, written after each step's loss reaches the host, so
    the device work of the step is done). Tokens: the records' ``tokens_seen`` (non-padding input tokens so far);
    where a record lacks it, the ``samples.rank0.jsonl`` lines (``{"rank", "records"}``, one per micro-batch in
    order, grad_accum of them per step) counted with ``lengths``."""
    from bdlora.train.trainer import run_training

    free_memory()
    t0 = time.perf_counter()
    res = run_training(cfg, validate_adapter=False)
    wall = time.perf_counter() - t0
    out = Path(cfg.output_dir)
    times, seen = {}, {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train_loss" in rec:
            times[rec["step"]] = rec["time"]
            if "tokens_seen" in rec:
                seen[rec["step"]] = rec["tokens_seen"]
    n = res.step
    if n < 2 or sorted(times) != list(range(1, n + 1)):
        raise RuntimeError(f"trainer run {out}: expected one metrics record per step 1..{n}")
    if sorted(seen) == list(range(1, n + 1)):
        tokens = seen[n] - seen[1]  # steps 2..n
    else:
        lines = [json.loads(line) for line in (out / "samples.rank0.jsonl").read_text().splitlines()]
        # the first n*grad_accum micro-batches are the training's (the data loader may fetch one more ahead, and the
        # final evaluation's follow)
        micro = [rec["records"] for rec in lines if "records" in rec]
        g = cfg.grad_accum
        if len(micro) < n * g:
            raise RuntimeError(f"trainer run {out}: {len(micro)} micro-batch sample records for {n} steps of {g}")
        tokens = sum(lengths.lengths[i] for recs in micro[g:n * g] for i in recs)
    del res
    free_memory()
    return {"tokens": tokens, "seconds": times[n] - times[1], "steps": n, "wall_s": wall}


def _fmt(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def paired_summary(entries: list[dict]) -> dict:
    """Per K over the repeats (each a K-jobs run and its baselines measured in one sequence): the engine's tok/s and
    its ratios to the engine at one job and to the trainer, each as median, min and max, with the repeats' count.
    The ratios are per repeat (paired), so drift of the machine between repeats cancels out of them."""
    try:
        from bench.train.bench_trainer import spread
    except ImportError:  # run as a script: bench/train is on sys.path, the repository root may not be
        from bench_trainer import spread

    out = {}
    for k in sorted({e["k"] for e in entries}):
        mine = [e for e in entries if e["k"] == k]
        row = {"repeats": len(mine)}
        for key in ("engine_tokens_per_s", "speedup_vs_engine_one_job", "speedup_vs_trainer"):
            vals = [e[key] for e in mine if e.get(key)]
            if vals:
                row[key] = spread(vals)
        out[str(k)] = row
    return out


def text_table(head: list[str], body: list[list[str]]) -> str:
    """Right-aligned columns under a header and a dashed rule, for the logs."""
    w = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(n) for c, n in zip(cells, w))  # noqa: E731
    return "\n".join([line(head), line(["-" * n for n in w])] + [line(b) for b in body])


def throughput_table(rows: list[dict]) -> str:
    f = _fmt
    head = ["K", "engine tok/s", "trainer seq tok/s", "vs trainer", "engine@1 tok/s", "vs engine@1", "engine s",
            "trainer s"]
    body = [[str(r["k"]) + (f" (repeat {r['repeat']})" if r.get("repeat") else ""),
             f(r["engine_tokens_per_s"], ",.0f"), f(r.get("sequential_trainer_tokens_per_s"), ",.0f"),
             f(r.get("speedup_vs_trainer"), ".2f"), f(r.get("engine_one_job_tokens_per_s"), ",.0f"),
             f(r.get("speedup_vs_engine_one_job"), ".2f"), f(r["engine_wall_s"], ".1f"),
             f(r.get("sequential_trainer_wall_s"), ".1f")] for r in rows]
    return text_table(head, body)


# -- model shapes and random weights built on the device ----------------------------------------------------------
SMOLLM2_SHAPE = dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                     vocab_size=49152)
# Llama-3.1-8B layer shapes; vocabulary 32000 like bench/serve/artifacts.py's "llama8b" shape
LLAMA8B_SHAPE = dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                     vocab_size=32000)
# --cpu-smoke --shape llama8b: the same code path (no checkpoint, GQA 4:1, intermediate 3.5x) at a CPU size
LLAMA8B_SMOKE_SHAPE = dict(hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=896,
                           vocab_size=512)


def write_config_folder(path: Path, shape: dict, seed: int = 0) -> Path:
    """A model folder with config.json + tokenizer and NO weights (see :class:`RandomWeights`)."""
    from transformers import LlamaConfig

    from bdlora.models import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    LlamaConfig(hidden_size=shape["hidden_size"], num_hidden_layers=shape["num_layers"],
                num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"],
                max_position_embeddings=2048, initializer_range=0.02, tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2, pad_token_id=0).save_pretrained(str(path))
    # the tokenizer of build_random_llama's SmolLM2-shape folder (the BPE saturates on the small corpus long before
    # 49152, so token counts of the data are the same as in the SmolLM2-shape run)
    build_tokenizer(path, vocab_size=min(shape["vocab_size"], 49152))
    (path / "RANDOM_WEIGHTS").write_text(json.dumps({"seed": seed, **shape}))
    return path


def build_random_model(folder: Path, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """The folder's model with random weights (transformers' own init, initializer_range 0.02), allocated and
    initialised directly on ``device`` in ``dtype``; the global RNG state is left as it was."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    prev = torch.get_default_dtype()
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config)
        finally:
            torch.set_default_dtype(prev)
    if next(model.parameters()).dtype != dtype:  # a transformers version that applied config.dtype itself
        model = model.to(dtype)
    return model


class RandomWeights:
    """Context manager: ``AutoModelForCausalLM.from_pretrained(folder, dtype=...)`` of this one folder returns
    :func:`build_random_model` (on ``device``, in the dtype asked); every other path loads as usual. The engine's
    ``load_base`` and the trainer's ``build_peft_model`` both load through it."""

    def __init__(self, folder: Path, device: torch.device, seed: int = 0):
        self.folder, self.device, self.seed = Path(folder).resolve(), device, seed
        self.builds = 0

    def __enter__(self):
        from transformers import AutoModelForCausalLM

        cls = AutoModelForCausalLM
        self._own = "from_pretrained" in cls.__dict__
        self._saved = cls.__dict__.get("from_pretrained")
        original = cls.from_pretrained  # bound to the class
        outer = self

        def from_pretrained(klass, path, *args, **kw):
            if Path(str(path)).resolve() != outer.folder:
                return original(path, *args, **kw)
            dtype = kw.get("dtype", kw.get("torch_dtype")) or torch.float32
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
            outer.builds += 1
            return build_random_model(outer.folder, dtype, outer.device, outer.seed)

        cls.from_pretrained = classmethod(from_pretrained)
        return self

    def __exit__(self, *exc):
        from transformers import AutoModelForCausalLM

        if self._own:
            AutoModelForCausalLM.from_pretrained = self._saved
        else:
            del AutoModelForCausalLM.from_pretrained
        return False


# -- sections 0-2: engine vs sequential trainer, early-exit sweep -------------------------------------------------
def run_throughput(args) -> int:
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("bench_engine: no CUDA device. This benchmark is meant for a GPU (H100/H200); "
              "use --cpu-smoke for a tiny CPU run that only checks the script.", file=sys.stderr)
        return 2
    llama8b = args.shape == "llama8b"
    if args.seq and not llama8b:
        print("bench_engine: --seq needs --shape llama8b (its folder's tokenizer writes the records)", file=sys.stderr)
        return 2
    if llama8b and args.model:
        print("bench_engine: --shape llama8b builds its own random model; drop --model", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bdlora-bench-train-"))
    atexit.register(shutil.rmtree, tmp, True)  # the random model and data: this run's scratch only
    device = torch.device("cuda", torch.cuda.current_device()) if cuda and not args.cpu_smoke else torch.device("cpu")
    shape_info = None
    random_weights = None  # RandomWeights of a config-only folder (llama8b)
    time_limit = args.time_limit if args.time_limit is not None else (240.0 if llama8b else 420.0)
    user_ks = [int(k) for k in args.ks.split(",")] if args.ks else None
    user_ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    if args.cpu_smoke:
        from bdlora.models import build_random_llama

        torch.set_num_threads(max(1, os.cpu_count() or 1))
        if llama8b:
            shape = dict(LLAMA8B_SMOKE_SHAPE, num_layers=args.num_layers or LLAMA8B_SMOKE_SHAPE["num_layers"])
            model = write_config_folder(tmp / "llama8b-smoke", shape)
            random_weights = RandomWeights(model, device)
            shape_info = {"name": "llama8b (cpu-smoke: shrunk dims)", **shape}
        else:
            model = args.model or build_random_llama(tmp / "tiny", init_std=0.05)
        ks = user_ks or [1, 2]
        seq = args.seq + 8 if args.seq else 64
        steps, bs, budget, sweep_steps = 3, 2, max(512, seq), 8
        nblocks, ranks, dtype = args.nblocks or 2, user_ranks or [4, 8], "float32"
        data = (trainer_data(tmp / "task.jsonl", model, 200, args.seq, args.seq) if args.seq
                else trainer_data(tmp / "task.jsonl", model, 200, 10, 40) if args.trainer_data
                else make_data(tmp / "task.jsonl", 200, max_words=20))
        lrs, sweep_ranks = [1e-3, 1e-2], [4, 8]
    else:
        from bdlora.models import smollm2_path

        torch.backends.cuda.matmul.allow_tf32 = True
        steps, bs, sweep_steps = args.steps or 12, args.batch_size, args.sweep_steps
        dtype, seq = args.dtype, (args.seq + 8 if args.seq else 258 if args.trainer_data else 256)
        data = None if args.seq or args.trainer_data else make_data(tmp / "task.jsonl", 4000)
        lrs = [3e-5, 1e-4, 3e-4, 3e-3]
        if llama8b:
            shape = dict(LLAMA8B_SHAPE, num_layers=args.num_layers or LLAMA8B_SHAPE["num_layers"])
            if args.vocab_size:
                shape["vocab_size"] = args.vocab_size
            model = write_config_folder(tmp / "llama8b-shape", shape)
            random_weights = RandomWeights(model, device)
            ks = user_ks or [1, 4, 8]
            nblocks = args.nblocks or 4
            ranks = user_ranks or [16, 32, 64, 128]
            sweep_ranks = [16, 32, 64, 128]
            if args.seq:  # records of exactly --seq tokens, written with the folder's tokenizer: one epoch for
                # the largest K (tokenizing long records is the slow part; jobs reuse them past it)
                data = trainer_data(tmp / "task.jsonl", model, max(ks) * bs * (steps + 2), args.seq, args.seq)
            elif args.trainer_data:
                data = trainer_data(tmp / "task.jsonl", model, max(ks) * bs * (steps + 2), 30, 250)
            # --token-budget as given (the engine refuses jobs its memory model does not admit at it), else the
            # engine's own choice in each run (each row records it)
            budget = max(args.token_budget, seq) if args.token_budget else "auto"
            shape_info = {"name": "llama8b", **shape, "full_num_layers": LLAMA8B_SHAPE["num_layers"],
                          "layers_reduced": shape["num_layers"] < LLAMA8B_SHAPE["num_layers"],
                          "weights": "random (transformers init, std 0.02), built on the GPU per run, no checkpoint"}
        else:
            if args.random_smollm2_shape and not args.model:
                from bdlora.models import build_random_llama

                model = build_random_llama(tmp / "smollm2-shape", **SMOLLM2_SHAPE)
                shape_info = {"name": "smollm2 (random weights)", **SMOLLM2_SHAPE}
            else:
                model = args.model or smollm2_path()
            ks = user_ks or [1, 4, 8, 16]
            nblocks, ranks = args.nblocks or 3, user_ranks or [12, 24, 48, 96]
            sweep_ranks = [6, 12, 24, 48]
            budget = args.token_budget or 16384
    do_sweep = not (args.no_sweep or llama8b)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "model": str(model),
        "dtype": dtype, "shape": shape_info,
        "settings": {"ks": ks, "steps": steps, "batch_size": bs, "token_budget": budget, "nblocks": nblocks,
                     "ranks": ranks, "max_seq_len": seq, "sweep": do_sweep, "sweep_steps": sweep_steps, "lrs": lrs,
                     "sweep_ranks": sweep_ranks, "engine_seq_jobs": args.engine_seq_jobs,
                     "time_limit_s": time_limit, "cpu_smoke": bool(args.cpu_smoke),
                     "lora_backend": LORA_BACKEND, "pad_multiple": PAD_MULTIPLE,
                     "cudnn_attention": CUDNN_ATTENTION, "grad_ckpt_every": GRAD_CKPT_EVERY,
                     "load_in_4bit": LOAD_IN_4BIT, "attn_implementation": ATTN_IMPLEMENTATION,
                     "data": ("bench_trainer's plain text" if args.seq or args.trainer_data
                              else "instruction task (reverse / sort / count words)"),
                     "lora_dropout": args.lora_dropout, "dropout_route": args.dropout_route, "dsdb": args.dsdb,
                     "argv": sys.argv[1:]},
        "throughput": [], "sweep": {}, "skipped": [],
    }
    print(f"[bench] {json.dumps(result['settings'])}\n[bench] shape {json.dumps(shape_info)}", flush=True)
    out = Path(args.out)

    def save(partial: bool = True) -> None:
        result["partial"] = partial
        result["total_s"] = time.perf_counter() - t_start
        save_json(result, out)

    with random_weights if random_weights is not None else contextlib.nullcontext():
        _throughput_body(result, args, model=model, data=data, tmp=tmp, ks=ks, steps=steps, bs=bs, budget=budget,
                         sweep_steps=sweep_steps, nblocks=nblocks, ranks=ranks, dtype=dtype, seq=seq, lrs=lrs,
                         sweep_ranks=sweep_ranks, do_sweep=do_sweep, cuda=device.type == "cuda", t_start=t_start,
                         time_limit=time_limit, save=save)
    if random_weights is not None:
        result["random_model_builds"] = random_weights.builds
    save(partial=False)
    print(f"[bench] wrote {out} in {result['total_s']:.0f}s", flush=True)
    return 0


def _throughput_body(result, args, *, model, data, tmp, ks, steps, bs, budget, sweep_steps, nblocks, ranks, dtype,
                     seq, lrs, sweep_ranks, do_sweep, cuda, t_start, time_limit, save) -> None:
    """Sections 0-2 into ``result``; ``save()`` writes the JSON so far (marked partial) after each experiment."""
    def over_time(what: str, estimate: float = 0.0) -> bool:
        if time.perf_counter() - t_start + estimate > time_limit:
            result["skipped"].append(what)
            print(f"[bench] skipping {what}: time limit {time_limit}s", flush=True)
            return True
        return False

    val_fraction = 0.02

    def job(name, i, rank, n_steps):
        return {"name": name, "r": rank, "nblocks": nblocks, "lr": 1e-4, "batch_size": bs, "max_steps": n_steps,
                "seed": i, "lora_dropout": args.lora_dropout}

    def parsed(jobs, out):
        return engine_run_config(model, data, out, jobs, dtype=dtype, budget=budget, max_seq_len=seq).jobs

    # -- 0. warm-up, untimed: nothing measured pays for compilation or first-use costs ----------------------
    # The grouped kernel's compile-time tile sizes depend on the largest rank among the active jobs (all jobs
    # here share nblocks), so every rank is run ALONE once (one engine, one active job at a time) and all of
    # them together once. The 2026-11-21 run warmed only the smallest rank (6) alone and all ranks together, so
    # the K=1 engine run (rank 12 alone) most likely compiled inside its timed rounds, which would explain its
    # 883 vs 2402 tok/s against the identical one-job engine run right after it.
    all_ranks = sorted(set(ranks + (sweep_ranks if do_sweep else [])))
    warm = [job(f"warm-{r}", 0, r, args.warmup_steps) for r in all_ranks]
    t0 = time.perf_counter()
    run_engine(model, data, tmp / "warmup-each", warm, dtype=dtype, budget=budget, max_seq_len=seq, max_active=1)
    run_engine(model, data, tmp / "warmup-all", warm, dtype=dtype, budget=budget, max_seq_len=seq)
    # the single-job trainer (PEFT, eager): CUDA/cuBLAS/autocast first use, accelerate set-up
    run_training_warm = trainer_config(parsed([job("warm-trainer", 0, ranks[0], 3)], tmp / "w")[0],
                                       model_path=model, data=data, out=tmp / "warmup-trainer", dtype=dtype,
                                       val_fraction=val_fraction)
    lengths = TokenLengths(model, data, seq)
    run_trainer(run_training_warm, lengths)
    result["warmup_s"] = time.perf_counter() - t0
    save()
    print(f"[bench] warm-up {result['warmup_s']:.1f}s", flush=True)

    if args.profile:
        profile_runs(result, args.profile, out_txt=Path(args.out).with_suffix(".profile.txt"),
                     engine=lambda jobs: run_engine(model, data, tmp / "profile", jobs, dtype=dtype, budget=budget,
                                                    max_seq_len=seq),
                     trainer=lambda j: run_trainer(trainer_config(parsed([j], tmp / "pp")[0], model_path=model,
                                                                  data=data, out=tmp / "profile-trainer",
                                                                  dtype=dtype, val_fraction=val_fraction), lengths),
                     jobs=[job(f"p{i}", i, ranks[i % len(ranks)], steps) for i in range(args.profile)])
        save()
        return

    # -- 1. throughput: K jobs together vs the same jobs one after another --------------------------------
    # Job i is the same in every K (rank ranks[i % len], seed i), so the sequential baselines run each job once
    # and the baseline of K is the first K jobs back to back: sum of their tokens / sum of their step seconds.
    all_jobs = [job(f"j{i}", i, ranks[i % len(ranks)], steps) for i in range(max(ks))]
    trainer_jobs = parsed(all_jobs, tmp / "parsed")
    n_engine1 = min(args.engine_seq_jobs, max(ks))

    def agg(stats: dict, k: int):
        """Rate of the first k jobs back to back. Cut by the time limit, the jobs that ran stand for the rest when
        they cover every rank (job i has rank ranks[i % len(ranks)]; the entry records how many ran)."""
        done = [i for i in range(k) if i in stats]
        if len(done) < k and len(done) < len(ranks):
            return None
        tok = sum(stats[i]["tokens"] for i in done)
        sec = sum(stats[i]["seconds"] for i in done)
        return tok / sec if sec else None

    def ratio(a, b):
        return a / b if a and b else None

    repeats = max(1, args.repeats)
    for rep in range(repeats):  # each repeat measures K jobs and their baselines again, in the same order
        seq_trainer: dict[int, dict] = {}
        seq_engine1: dict[int, dict] = {}
        per_trainer_job = None
        suffix = f"-rep{rep}" if rep else ""
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for k in ks:
            jobs = [dict(j, name=f"k{k}-{j['name']}") for j in all_jobs[:k]]
            if over_time(f"throughput K={k}"):
                break
            eng, rows, wall = run_engine(model, data, tmp / f"tp-{k}{suffix}", jobs, dtype=dtype, budget=budget,
                                         max_seq_len=seq)
            together = steady_tokens_per_s(eng.round_log, skip_first=1)
            entry = {"k": k, "repeat": rep, "engine_tokens_per_s": together, "engine_wall_s": wall,
                     "microbatches_per_round": eng.round_log[-1]["microbatches"],
                     # all K jobs admitted together from the first round (the memory model could hold some back)
                     "active_jobs_first_round": eng.round_log[0]["active"],
                     "peak_mem_gib": engine_peak_gib(eng), "token_budget": eng.token_budget,
                     # per-round (tokens, training seconds): shows compile/first-use costs past the skipped round
                     "rounds": [[r["tokens"], round(r["train_s"], 4)] for r in eng.round_log]}
            del eng
            # the single-job PEFT trainer, job by job (the baseline)
            for i in range(0 if args.no_seq_trainer else k):
                if i in seq_trainer:
                    continue
                if over_time(f"trainer job {i} (K={k})", per_trainer_job or 0.0):
                    break
                seq_trainer[i] = run_trainer(trainer_config(trainer_jobs[i], model_path=model, data=data,
                                                            out=tmp / f"trainer-{i}{suffix}", dtype=dtype,
                                                            val_fraction=val_fraction), lengths)
                seq_trainer[i].update(job=i, rank=trainer_jobs[i].r)
                per_trainer_job = seq_trainer[i]["wall_s"]
            # the engine with one active job at a time (extra column; the first n_engine1 jobs only)
            todo = [i for i in range(min(k, n_engine1)) if i not in seq_engine1]
            if todo and not over_time(f"engine at one job, jobs {todo}", 1.5 * wall * len(todo) / k):
                eng1, _, _ = run_engine(model, data, tmp / f"engine1-{todo[0]}{suffix}", [all_jobs[i] for i in todo],
                                        dtype=dtype, budget=budget, max_seq_len=seq, max_active=1)
                for i, st in zip(todo, engine_one_job_stats(eng1.round_log, len(todo), steps)):
                    seq_engine1[i] = dict(st, job=i, rank=all_jobs[i]["r"], token_budget=eng1.token_budget)
                del eng1
            tr = agg(seq_trainer, k)
            e1 = agg(seq_engine1, k)
            entry.update(sequential_tokens_per_s=tr, speedup=ratio(together, tr),
                         sequential_trainer_tokens_per_s=tr, speedup_vs_trainer=ratio(together, tr),
                         sequential_trainer_jobs_run=sum(i in seq_trainer for i in range(k)),
                         sequential_trainer_wall_s=(sum(seq_trainer[i]["wall_s"] for i in range(k) if i in seq_trainer)
                                                    if tr else None),
                         engine_one_job_tokens_per_s=e1, speedup_vs_engine_one_job=ratio(together, e1))
            result["throughput"].append(entry)
            save()
            ran = entry["sequential_trainer_jobs_run"]
            print(f"[bench] K={k}: engine {together:,.0f} tok/s | trainer sequential {tr or float('nan'):,.0f} tok/s "
                  f"{'' if ran == k else f'(first {ran} of {k} jobs) '}"
                  f"({entry['speedup_vs_trainer'] or float('nan'):.2f}x) | engine at one job "
                  f"{e1 or float('nan'):,.0f} tok/s ({entry['speedup_vs_engine_one_job'] or float('nan'):.2f}x) | "
                  f"{time.perf_counter() - t_start:.0f}s", flush=True)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
        sequential = {name: [dict(st[i], tokens_per_s=st[i]["tokens"] / st[i]["seconds"]) for i in sorted(st)]
                      for name, st in (("trainer", seq_trainer), ("engine_one_job", seq_engine1))}
        if rep == 0:
            result["sequential_jobs"] = sequential
        else:
            result.setdefault("sequential_jobs_later_repeats", []).append(sequential)
        if result["skipped"]:  # the time limit: no further repeat
            break
    if repeats > 1:
        result["paired"] = paired_summary(result["throughput"])
        print(f"[bench] paired over repeats: {json.dumps(result['paired'])}", flush=True)
    print(throughput_table(result["throughput"]), flush=True)
    if not do_sweep:
        return
    k_max_round = None
    if result["throughput"]:
        last = result["throughput"][-1]
        k_max_round = last["engine_wall_s"] / steps * (len(set(sweep_ranks)) * len(lrs) / last["k"])

    # -- 2. sweep with vs without early exit ---------------------------------------------------------------
    grid = [{"name": f"lr{lr:g}-r{r}", "lr": lr, "r": r, "nblocks": nblocks, "batch_size": bs,
             "max_steps": sweep_steps, "group": "sweep", "seed": 0} for lr in lrs for r in sweep_ranks]
    ee = {"enabled": True}  # paper defaults
    for label, early in (("with_early_exit", ee), ("without_early_exit", None)):
        est = k_max_round * sweep_steps * (0.6 if early else 1.0) if k_max_round else 0.0
        if over_time(f"sweep {label}", est):
            continue
        eng, rows, wall = run_engine(model, data, tmp / f"sweep-{label}", grid, dtype=dtype, budget=budget,
                                     max_seq_len=seq,
                                     early_exit=early, eval_every=max(2, sweep_steps // 10), val_fraction=0.02)
        vals = [r["best_eval_loss"] for r in rows if r["best_eval_loss"] is not None]
        best = min(rows, key=lambda r: r["best_eval_loss"] if r["best_eval_loss"] is not None else 1e9)
        reasons = {}
        for r in rows:
            reasons[r["stop_reason"]] = reasons.get(r["stop_reason"], 0) + 1
        result["sweep"][label] = {
            "wall_s": wall, "tokens": sum(r["tokens"] for r in rows), "steps": sum(r["steps"] for r in rows),
            "best_eval_loss": min(vals) if vals else None, "best_job": best["job"], "stop_reasons": reasons,
            "jobs": rows,
        }
        save()
        print(f"[bench] sweep {label}: {wall:.1f}s, {result['sweep'][label]['steps']} job-steps, best "
              f"{result['sweep'][label]['best_eval_loss']} ({best['job']}), {reasons}", flush=True)
    sw = result["sweep"]
    if "with_early_exit" in sw and "without_early_exit" in sw:
        a, b = sw["with_early_exit"], sw["without_early_exit"]
        result["sweep"]["time_saved_fraction"] = 1 - a["wall_s"] / b["wall_s"]
        result["sweep"]["steps_saved_fraction"] = 1 - a["steps"] / b["steps"]
        result["sweep"]["best_loss_ratio_with_over_without"] = (a["best_eval_loss"] / b["best_eval_loss"]
                                                                if a["best_eval_loss"] and b["best_eval_loss"]
                                                                else None)


# -- 2 processes: LoRAPP pipeline vs data parallel ----------------------------------------------------------------
def _rel_diff(a, b):
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(b), 1e-12)


def _pvd_worker(rank: int, world: int, port: int, backend: str, plan: dict, part: str) -> None:
    import torch.distributed as dist

    from bdlora.train.engine.pipeline import init_distributed, p2p_groups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), TOKENIZERS_PARALLELISM="false")
    _quiet_loading()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if backend == "nccl":
        torch.backends.cuda.matmul.allow_tf32 = True
    # a hung message (NCCL) fails the run after pg_timeout_s instead of holding the GPUs until the call's limit;
    # the JSON written after each K stays. With NCCL, init_distributed selects this rank's GPU first (the engine's
    # device "auto" -> cuda:LOCAL_RANK, NCCL's communicators and the *_object collectives all use it)
    timeout = datetime.timedelta(seconds=plan["pg_timeout_s"])
    init_distributed(backend, rank, rank=rank, world_size=world, timeout=timeout)
    try:
        p2p_groups(timeout)  # the pipeline's message groups (collective), with the same timeout
        res = _pvd_experiments(dist, rank, world, plan)
        if rank == 0:
            Path(part).write_text(json.dumps(res, indent=2, default=str))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _pvd_experiments(dist, rank: int, world: int, plan: dict) -> dict:
    from bdlora.train.engine.engine import Engine
    from bdlora.train.engine.pipeline import run_pipeline_distributed, theory_bubble

    device = torch.device("cuda", rank) if plan["backend"] == "nccl" else torch.device("cpu")
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "experiments": [], "skipped": [], "timings": []}
    tmp = Path(plan["tmp"])
    last_wall: dict[str, tuple[int, float]] = {}

    def log(msg):
        if rank == 0:
            print(f"[pvd] {msg} | {time.time() - plan['t_start']:.0f}s", flush=True)

    def jobs_of(names_ranks, steps):
        return [{"name": n, "r": r, "nblocks": plan["nblocks"], "lr": plan["lr"], "batch_size": plan["batch_size"],
                 "max_steps": steps, "seed": i} for i, (n, r) in enumerate(names_ranks)]

    def go(what: str, mode: str, k: int) -> bool:
        """Rank 0 decides from the elapsed time and the last run of the same mode; every rank follows."""
        flag = [True]
        if rank == 0:
            est = 0.0
            if mode in last_wall:
                k0, w0 = last_wall[mode]
                est = w0 * max(1.0, k / max(k0, 1))
            if time.time() - plan["t_start"] + est > plan["time_limit"]:
                flag[0] = False
        dist.broadcast_object_list(flag, src=0)
        if not flag[0]:
            out["skipped"].append(what)
            log(f"skipping {what}: time limit {plan['time_limit']}s")
        return flag[0]

    def run_one(mode: str, jobs: list[dict], name: str, max_active: int = 64) -> Optional[dict]:
        cfg = engine_run_config(plan["model"], plan["data"], tmp / name, jobs, dtype=plan["dtype"],
                                budget=plan["token_budget"], max_seq_len=plan["max_seq_len"], max_active=max_active,
                                device="auto" if device.type == "cuda" else "cpu",
                                pipeline_stages=world if mode == "pipeline" else 1,
                                lora_backend=plan.get("lora_backend", "auto"))
        free_memory()
        dist.barrier()
        t0 = time.perf_counter()
        local: dict = {}
        if mode == "dp":
            eng = Engine(cfg)
            eng.ctx.kernel_tuning = dict(KERNEL_TUNING)
            rows = eng.run()
            local = {"rows": rows, "rounds": eng.round_log, "peak": engine_peak_gib(eng)}
            del eng
        else:
            res = run_pipeline_distributed(cfg)
            if res is not None:
                local = {"rows": res["jobs"], "pipeline": res["pipeline"], "train_losses": res["train_losses"]}
        wall = time.perf_counter() - t0
        # dp: the largest per-round peak (the engine resets the counter each round); pipeline: the stages' peaks
        # since the split, from the pipeline's statistics (rank 0)
        mine = {"rank": rank, "wall_s": wall, "peak_mem_gib": local.get("peak")}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        free_memory()
        out["timings"].append({"run": name, "wall_s": max(g["wall_s"] for g in gathered)})
        if rank != 0:
            return None
        rows = local["rows"]
        tokens = sum(r["tokens"] for r in rows)
        entry = {"wall_s": wall, "tokens": tokens,
                 "peak_mem_gib_per_rank": (local["pipeline"]["peak_mem_gib_per_stage"] if mode == "pipeline"
                                           else [g["peak_mem_gib"] for g in gathered]),
                 "losses": {r["job"]: {"final_train_loss": r["final_train_loss"],
                                       "final_eval_loss": r["final_eval_loss"]} for r in rows}}
        if mode == "dp":
            rounds = local["rounds"]
            train_s = sum(r["train_s"] for r in rounds)
            entry.update(train_s=train_s, tokens_per_s=tokens / train_s if train_s else None,
                         tokens_per_s_after_first_round=steady_tokens_per_s(rounds, 1),
                         rounds=len(rounds), microbatches_per_round=[r["microbatches"] for r in rounds],
                         active_jobs_first_round=rounds[0]["active"] if rounds else None)
            assert sum(r["tokens"] for r in rounds) == tokens, "dp: round tokens != job tokens"
        else:
            st = local["pipeline"]
            entry.update(train_s=st["wall_s"], tokens_per_s=tokens / st["wall_s"] if st["wall_s"] else None,
                         microbatches=st["microbatches"], bubble_measured=st["bubble_measured"],
                         bubble_measured_per_stage=st["bubble_measured_per_stage"],
                         bubble_schedule_unit_slots=st["bubble_schedule_unit_slots"],
                         bubble_formula_max_D_minus_L_over_D=theory_bubble(world, len(jobs)))
        return entry

    ranks = plan["ranks"]
    # -- warm-up, untimed: each rank alone (dp at one active job; the pipeline's micro-batches are single-job) and
    # all together (dp), so no timed run compiles kernels or pays first-use costs
    t0 = time.perf_counter()
    warm = jobs_of([(f"warm-{r}", r) for r in ranks], 2)
    for mode, name, max_active in (("dp", "warm-dp-each", 1), ("dp", "warm-dp-all", 64),
                                   ("pipeline", "warm-pipeline", 64)):
        run_one(mode, warm, name, max_active)
        log(f"warm-up {name} done")
    out["warmup_s"] = time.perf_counter() - t0

    for k in plan["ks"]:
        jobs = jobs_of([(f"j{i}", ranks[i % len(ranks)]) for i in range(k)], plan["steps"])
        entry = {"k": k, "stages": world}
        for mode in ("dp", "pipeline"):
            if not go(f"{mode} K={k}", mode, k):
                continue
            t1 = time.perf_counter()
            res = run_one(mode, jobs, f"{mode}-k{k}")
            last_wall[mode] = (k, time.perf_counter() - t1)
            if rank == 0:
                entry[mode] = res
                log(f"K={k} {mode}: {res['tokens_per_s']:,.0f} tok/s, peak/GPU "
                    f"{[round(p, 2) if p is not None else None for p in res['peak_mem_gib_per_rank']]} GiB"
                    + (f", bubble measured {res['bubble_measured']:.3f} schedule "
                       f"{res['bubble_schedule_unit_slots']:.3f} formula "
                       f"{res['bubble_formula_max_D_minus_L_over_D']:.3f}" if mode == "pipeline" else ""))
        if rank == 0 and "dp" in entry and "pipeline" in entry:
            dp, pp = entry["dp"], entry["pipeline"]
            entry["pipeline_over_dp_tokens_per_s"] = (pp["tokens_per_s"] / dp["tokens_per_s"]
                                                      if pp["tokens_per_s"] and dp["tokens_per_s"] else None)
            entry["same_tokens"] = pp["tokens"] == dp["tokens"]
            diffs = {}
            for j in dp["losses"]:
                a, b = pp["losses"].get(j, {}), dp["losses"][j]
                diffs[j] = {key: _rel_diff(a.get(key), b[key]) for key in ("final_train_loss", "final_eval_loss")}
            entry["loss_rel_diff_pipeline_vs_dp"] = diffs
            vals = [v for d in diffs.values() for v in d.values() if v is not None]
            entry["max_loss_rel_diff"] = max(vals) if vals else None
        if rank == 0 and len(entry) > 2:
            out["experiments"].append(entry)
        if rank == 0 and plan.get("partial_out"):
            save_json({"mode": "pipeline_vs_dp", "partial": True, "settings": plan, **out}, Path(plan["partial_out"]))
    return out


def run_pipeline_vs_dp(args) -> int:
    import socket

    import torch.multiprocessing as mp

    from bdlora.models import build_random_llama

    t_start = time.time()
    world = 2
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if not args.cpu_smoke and not cuda:
        print(f"bench_engine --pipeline-vs-dp: needs {world} CUDA devices (found "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}); use --cpu-smoke for 2 CPU "
              "processes (gloo)", file=sys.stderr)
        return 2
    backend = "gloo" if args.cpu_smoke else "nccl"
    tmp = Path(tempfile.mkdtemp(prefix="bdlora-bench-pvd-"))
    atexit.register(shutil.rmtree, tmp, True)  # the random model and data: this run's scratch only
    if args.cpu_smoke:
        model = args.model or build_random_llama(tmp / "tiny", init_std=0.05)
        data = make_data(tmp / "task.jsonl", 120, max_words=12)
        plan = dict(ks=[int(k) for k in args.ks.split(",")] if args.ks else [1, 2], steps=args.steps or 3,
                    batch_size=2, token_budget=args.token_budget or 128, max_seq_len=64, nblocks=args.nblocks or 2,
                    ranks=[4, 8], dtype="float32", lr=1e-3)
    else:
        model = args.model or build_random_llama(tmp / "smollm2-shape", **SMOLLM2_SHAPE)
        data = make_data(tmp / "task.jsonl", 2000)
        plan = dict(ks=[int(k) for k in args.ks.split(",")] if args.ks else [1, 2, 4, 8], steps=args.steps or 12,
                    batch_size=args.batch_size, token_budget=args.token_budget or 2048, max_seq_len=256,
                    nblocks=args.nblocks or 3, ranks=[12, 24, 48, 96], dtype=args.dtype, lr=1e-4)
    if args.ranks:
        plan["ranks"] = [int(r) for r in args.ranks.split(",")]
    time_limit = args.time_limit if args.time_limit is not None else 200.0
    # the estimate per run is the previous run of the mode; keep a margin for the last run and the shutdown
    plan.update(model=str(model), data=str(data), tmp=str(tmp), backend=backend, lora_backend=LORA_BACKEND,
                t_start=t_start, time_limit=time_limit - 10.0, partial_out=str(Path(args.out).resolve()),
                pg_timeout_s=180)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    part = tmp / "pvd.json"
    print(f"[pvd] {backend}, {world} processes, plan {json.dumps({k: v for k, v in plan.items() if k != 't_start'})}",
          flush=True)
    mp.spawn(_pvd_worker, args=(world, port, backend, plan, str(part)), nprocs=world, join=True)
    res = json.loads(part.read_text())
    result = {"mode": "pipeline_vs_dp", "device": res.pop("device"), "backend": backend, "processes": world,
              "model": str(model), "shape": (None if args.cpu_smoke else {"name": "smollm2 (random weights)",
                                                                         **SMOLLM2_SHAPE}),
              "settings": {**{k: v for k, v in plan.items()
                              if k not in ("t_start", "tmp", "model", "data", "time_limit", "partial_out")},
                           "time_limit_s": time_limit, "cpu_smoke": bool(args.cpu_smoke), "argv": sys.argv[1:],
                           "p2p": "the engine's process group per direction (pipeline.p2p_groups)"},
              **res, "partial": False}
    result["total_s"] = time.time() - t_start
    print(pvd_table(result["experiments"]), flush=True)
    out = Path(args.out)
    save_json(result, out)
    print(f"[pvd] wrote {out} in {result['total_s']:.0f}s", flush=True)
    return 0


def pvd_table(rows: list[dict]) -> str:
    f = _fmt
    head = ["K", "dp tok/s", "pipeline tok/s", "pp/dp", "bubble meas", "bubble sched", "max((D-L)/D,0)",
            "max loss rel diff", "peak GiB dp", "peak GiB pp"]
    body = []
    for r in rows:
        dp, pp = r.get("dp") or {}, r.get("pipeline") or {}
        peaks = lambda e: "/".join(f(p, ".2f") for p in e.get("peak_mem_gib_per_rank", [])) or "-"  # noqa: E731
        body.append([str(r["k"]), f(dp.get("tokens_per_s"), ",.0f"), f(pp.get("tokens_per_s"), ",.0f"),
                     f(r.get("pipeline_over_dp_tokens_per_s"), ".2f"), f(pp.get("bubble_measured"), ".3f"),
                     f(pp.get("bubble_schedule_unit_slots"), ".3f"),
                     f(pp.get("bubble_formula_max_D_minus_L_over_D"), ".2f"), f(r.get("max_loss_rel_diff"), ".2e"),
                     peaks(dp), peaks(pp)])
    return text_table(head, body)


def profile_runs(result: dict, k: int, *, out_txt: Path, engine, trainer, jobs: list[dict]) -> None:
    """--profile K: the engine training K jobs together, then the single-job trainer on the first job, each under
    torch.profiler over its steady steps only (rounds / training steps after the first two, up to the last); per
    step, host and GPU seconds and kernel launches in the JSON, the top ops by device and by host time in
    ``out_txt``. Tells where each side's step goes, side by side on the same jobs."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import Trainer

    from bdlora.train.engine.engine import Engine

    try:
        from bench.train.bench_trainer import profiled_calls
        from bench.train.peft_bf16_loop import profile_summary
    except ImportError:  # run as a script: bench/train is on sys.path, the repository root may not be
        from bench_trainer import profiled_calls
        from peft_bf16_loop import profile_summary

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sort_dev = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    steps = jobs[0]["max_steps"]
    skip = min(2, steps - 1)
    parts = []
    for what, fn, cls, method in ((f"engine, K={k} jobs together", lambda: engine(jobs), Engine, "train_round"),
                                  ("single-job trainer (bdlora train), job 0", lambda: trainer(jobs[0]), Trainer,
                                   "training_step")):
        free_memory()
        prof = profile(activities=acts)
        with profiled_calls(prof, cls, method, skip, steps - skip) as done:
            fn()
        if not done[0]:
            raise RuntimeError(f"--profile: {what} ran no step after the first {skip}")
        ka = prof.key_averages()
        by_dev = ka.table(sort_by=sort_dev, row_limit=30, max_name_column_width=70)
        by_host = ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70)
        summary = profile_summary(prof, done[0], out_txt.with_suffix(f".{method}.txt"))
        parts.append(f"## {what}: steps {skip + 1}-{skip + done[0]} under the profiler, per step {summary}\n\n"
                     f"### by device time\n{by_dev}\n### by host time\n{by_host}\n")
        result.setdefault("profile", []).append({"what": what, **summary})
        print(f"[bench] profiled {what}: {summary}", flush=True)
    out_txt.parent.mkdir(parents=True, exist_ok=True)
    out_txt.write_text("\n".join(parts))
    print(f"[bench] profile tables in {out_txt}", flush=True)


def _quiet_loading() -> None:
    """No per-load progress bars of transformers in the logs (dozens of model loads per run)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - an older transformers without it
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="result JSON (default bench/results/train_engine[_llama8b|_pipeline_vs_dp].json)")
    ap.add_argument("--cpu-smoke", action="store_true", help="run a tiny version on CPU (correctness of the script)")
    ap.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct via bdlora.models.smollm2_path)")
    ap.add_argument("--random-smollm2-shape", action="store_true",
                    help="random weights in SmolLM2-135M's shape (same cost; for machines without the SmolLM2 package)")
    ap.add_argument("--shape", choices=["smollm2", "llama8b"], default="smollm2",
                    help="llama8b: Llama-3.1-8B layer shapes, random weights built on the GPU, no sweep")
    ap.add_argument("--num-layers", type=int, help="decoder layers of --shape llama8b (default 32; cpu-smoke 2)")
    ap.add_argument("--vocab-size", type=int, help="vocabulary of --shape llama8b (default 32000)")
    ap.add_argument("--nblocks", type=int, help="BD blocks N (default: 3 smollm2, 4 llama8b, 2 cpu-smoke)")
    ap.add_argument("--ranks", help="comma-separated job ranks (default: 12,24,48,96 smollm2; 16,32,64,128 llama8b)")
    ap.add_argument("--ks", help="comma-separated job counts (default 1,4,8,16; llama8b 1,4,8; pipeline-vs-dp "
                                 "1,2,4,8)")
    ap.add_argument("--steps", type=int, help="optimizer steps per job in the throughput runs (default 12)")
    ap.add_argument("--warmup-steps", type=int, default=2,
                    help="steps of each warm-up job (every rank alone, then all together): batches of varying "
                         "length bring new kernel specializations (Triton compiles) for many steps")
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure every K and its baselines this many times in turn; the JSON's 'paired' gives per K "
                         "the median / min / max of each repeat's ratios (the spread of one run is 10-25%%)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq", type=int, help="--shape llama8b: every example exactly this many tokens (plain text "
                                             "records; default: instructions of ~30-250 tokens)")
    ap.add_argument("--token-budget", type=int,
                    help="micro-batch token budget (default 16384 smollm2; llama8b: the engine's auto; 2048 "
                         "pipeline-vs-dp)")
    ap.add_argument("--sweep-steps", type=int, default=60)
    ap.add_argument("--no-sweep", action="store_true", help="skip the early-exit sweep (always skipped for llama8b)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-seq-trainer", action="store_true",
                    help="skip the sequential `bdlora train` runs of each job (a table whose trainer row comes from "
                         "bench_trainer.py)")
    ap.add_argument("--engine-seq-jobs", type=int, default=4,
                    help="the engine-at-one-job column covers the first this many jobs (K <= this)")
    ap.add_argument("--time-limit", type=float,
                    help="seconds (default 420; llama8b 240; pipeline-vs-dp 200); an experiment whose estimated "
                         "end is past it is skipped")
    ap.add_argument("--pipeline-vs-dp", action="store_true",
                    help="2 processes: the engine's LoRAPP pipeline vs its data parallel mode (NCCL on 2 GPUs, gloo "
                         "on CPU with --cpu-smoke)")
    ap.add_argument("--lora-backend", default="auto", choices=["auto", "cublas", "triton", "torch"],
                    help="the engine's LoRA path (lora_backend): auto (cublas on GPU), cublas (base + LoRA as cuBLAS "
                         "GEMMs in one op), triton (grouped Triton kernels), or torch (per-job loop)")
    ap.add_argument("--lora-dropout", type=float, default=0.0, help="every job's lora_dropout (and the trainer's)")
    ap.add_argument("--dropout-route", default="auto", choices=["auto", "mask"],
                    help="the cuBLAS path's dropout: auto (drawn inside its Triton kernels on GPU) or mask "
                         "(materialized bool mask and masked copies, the route before those kernels)")
    ap.add_argument("--dsdb", default="auto", choices=["auto", "off"],
                    help="the cuBLAS path's dS/dB: auto (one Triton kernel reading dY once on GPU, ranks <= 64) or "
                         "off (two GEMMs)")
    ap.add_argument("--profile", type=int, metavar="K",
                    help="instead of the throughput runs: profile the engine with K jobs and the trainer with one "
                         "over their steps after the first two (per step host and GPU seconds and launches in the "
                         "JSON, torch.profiler tables in OUT.profile.txt)")
    ap.add_argument("--pad-multiple", type=int,
                    help="the engine's pad_multiple (rows padded to a multiple: fewer distinct shapes per run); "
                         "default: the engine's auto (64 on GPU, 1 on CPU)")
    ap.add_argument("--use-liger-kernel", default="auto", choices=["auto", "true", "false"],
                    help="use_liger_kernel of the engine's runs (Liger's RMSNorm, SwiGLU and RoPE on the base) and "
                         "of the sequential trainer; auto: where it runs")
    ap.add_argument("--cudnn-attention", action="store_true",
                    help="cudnn_attention: true for the engine's runs and the sequential trainer (sdpa may pick "
                         "cuDNN attention; off by default, as in the product)")
    ap.add_argument("--trainer-data", action="store_true",
                    help="--shape llama8b: bench_trainer.py's plain-text records of 30-250 tokens instead of the "
                         "instruction task (~90 tokens a sample), so the engine's rows and bench_trainer's count "
                         "the same examples")
    ap.add_argument("--grad-ckpt-every", type=int, default=0, metavar="N",
                    help="gradient_checkpointing of the engine's runs and the sequential trainer, recomputing every "
                         "N-th decoder layer (1: every layer); 0 (default): off")
    ap.add_argument("--masked-attention", action="store_true",
                    help="attn_implementation: sdpa for the engine's runs and the sequential trainer: packed rows "
                         "under transformers' block-causal mask, not torch's varlen flash attention (the default on "
                         "a GPU)")
    ap.add_argument("--load-in-4bit", action="store_true",
                    help="the engine's runs on one bitsandbytes 4-bit base (load_in_4bit) and the sequential trainer "
                         "on a 4-bit base too (needs bitsandbytes)")
    ap.add_argument("--memory-budget-gb", type=float, metavar="GIB",
                    help="memory_budget_gb of the engine's runs: the memory model's admission limit (default: 90%% "
                         "of the GPU), e.g. to run a --token-budget the model's estimate would refuse")
    args = ap.parse_args(argv)
    if args.profile is not None and args.profile < 1:
        ap.error(f"--profile K needs K >= 1 jobs, got {args.profile}")
    global LORA_BACKEND, PAD_MULTIPLE, USE_LIGER, CUDNN_ATTENTION, GRAD_CKPT_EVERY, LOAD_IN_4BIT, ATTN_IMPLEMENTATION
    global MEMORY_BUDGET_GB
    MEMORY_BUDGET_GB = args.memory_budget_gb
    LORA_BACKEND, PAD_MULTIPLE, CUDNN_ATTENTION = args.lora_backend, args.pad_multiple, args.cudnn_attention
    LOAD_IN_4BIT = args.load_in_4bit
    ATTN_IMPLEMENTATION = "sdpa" if args.masked_attention else None
    GRAD_CKPT_EVERY = max(0, args.grad_ckpt_every)
    USE_LIGER = {"auto": None, "true": True, "false": False}[args.use_liger_kernel]
    if args.dropout_route == "mask":  # the engines' KernelOptions beside lora_backend (BatchContext.kernel_tuning)
        KERNEL_TUNING["fused_dropout"] = False
    if args.dsdb == "off":
        KERNEL_TUNING["fused_dsdb"] = False
    _quiet_loading()
    if args.out is None:
        suffix = "_pipeline_vs_dp" if args.pipeline_vs_dp else ("_llama8b" if args.shape == "llama8b" else "")
        args.out = f"bench/results/train_engine{suffix}.json"
    if args.pipeline_vs_dp:
        return run_pipeline_vs_dp(args)
    return run_throughput(args)


if __name__ == "__main__":
    sys.exit(main())
