"""The run file of the multi-LoRA engine: base model, datasets, jobs and search spaces (YAML).

Example::

    base_model: smollm2            # a folder, or "smollm2" (bdlora.models.smollm2_path())
    output_dir: runs/sweep1
    token_budget: 4096             # tokens per packed micro-batch (all jobs together)
    max_active_jobs: 8
    datasets:
      alpaca: {path: data/alpaca.jsonl, format: alpaca, val_fraction: 0.1}
    defaults: {rank: 16, alpha: 16, nblocks: 2, lr: 2.0e-4, batch_size: 8, steps: 200, dataset: alpaca}
    jobs:
      - {name: r8-n1, rank: 8, nblocks: 1}
    search:
      - name: lr-grid
        type: grid                 # or random (with num_samples)
        space: {lr: [1.0e-4, 3.0e-4], rank: [8, 16]}
    early_exit: {enabled: true}    # ALTO defaults: w=2, p=2, tau_slope=0.001, tau_gap=0.1, 5% warm-up, keep 25%

Key aliases: ``r`` -> ``rank``, ``lora_alpha`` -> ``alpha``, ``N`` -> ``nblocks``.

``lora_dropout`` (per job, in [0, 1)) follows PEFT: while training, the job's LoRA input is dropped out (inverted
dropout) before its A factor, the base path unaffected; evaluation runs without dropout. Masks are drawn from torch's
RNG seeded per micro-batch from the run seed and the dropout jobs' seeds and steps (reproducible, exact resume).
The saved PEFT folder records the job's ``lora_dropout`` in ``adapter_config.json``.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import yaml

from bdlora.spec import BDLoraError, BDLoraSpec

_ALIASES = {"r": "rank", "lora_alpha": "alpha", "N": "nblocks", "n": "nblocks", "learning_rate": "lr",
            "lr_scheduler": "schedule", "gradient_accumulation_steps": "grad_accum", "max_steps": "steps"}


LORA_BACKENDS = ("auto", "cublas", "triton", "torch", "engine")  # how MultiLoraLinear runs the jobs' LoRA


class ConfigError(BDLoraError):
    """A bad run file; the message names the field."""


@dataclass
class EarlyExitConfig:
    enabled: bool = False
    window: int = 2  # w: points in the loss-slope regression
    patience: int = 2  # p: consecutive evaluations a rule must hold
    tau_slope: float = 0.001
    tau_gap: float = 0.1
    ema_alpha: float = 0.3  # EMA weight of the newest train loss
    warmup_ratio: float = 0.05  # warm-up = this fraction of a job's total steps
    keep_ratio: float = 0.25  # share of a group's jobs kept after warm-up (top-k by val loss)
    warmup_select: bool = True


@dataclass
class DatasetConfig:
    name: str
    path: str
    format: str = "auto"  # alpaca | chat | auto
    val_path: Optional[str] = None
    val_fraction: float = 0.1
    max_samples: Optional[int] = None
    seed: int = 0


@dataclass
class JobConfig:
    name: str
    dataset: str
    rank: int = 8
    alpha: float = 16.0
    nblocks: int = 1
    target_modules: Optional[list[str]] = None  # None: every column/row projection of the model's preset
    lr: float = 2e-4
    schedule: str = "constant"  # any transformers.get_scheduler name: constant, linear, cosine, ...
    warmup_steps: int = 0  # LR warm-up
    batch_size: int = 4  # samples per micro-step
    grad_accum: int = 1  # an optimizer step consumes batch_size * grad_accum samples
    steps: Optional[int] = None
    epochs: Optional[float] = None
    max_seq_len: int = 512
    weight_decay: float = 0.0
    max_grad_norm: Optional[float] = 1.0
    lora_dropout: float = 0.0  # PEFT semantics: dropout on this job's LoRA input while training, none at eval
    a_init: str = "lora"  # lora | peft (see bdlora.train.config.TrainConfig.a_init)
    adam_betas: tuple = (0.9, 0.999)
    adam_eps: float = 1e-8
    seed: int = 0
    eval_every: Optional[int] = None  # None: the run's eval_every
    group: str = "default"  # warm-up top-k selection ranks the jobs of one group
    priority: int = 0  # higher is admitted first; ties keep file order

    @property
    def step_samples(self) -> int:
        return self.batch_size * self.grad_accum

    def total_steps(self, n_train: int) -> int:
        if self.steps is not None:
            return int(self.steps)
        per_epoch = math.ceil(n_train / self.step_samples)
        return max(1, int(math.ceil((self.epochs or 1.0) * per_epoch)))

    def spec(self, model_type: str = "llama") -> BDLoraSpec:
        return BDLoraSpec.from_preset(model_type, nblocks=int(self.nblocks), r=int(self.rank),
                                      lora_alpha=float(self.alpha), target_modules=self.target_modules,
                                      lora_dropout=float(self.lora_dropout))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["adam_betas"] = list(self.adam_betas)
        return d


@dataclass
class RunConfig:
    base_model: str
    output_dir: str
    datasets: dict[str, DatasetConfig]
    jobs: list[JobConfig]
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"
    token_budget: int = 2048
    # each job's segment in a micro-batch is padded to a multiple of this; None = auto: 64 on GPU (the grouped
    # kernel's row tile, and few distinct shapes: on an H200 ragged rows made round times vary up to 10x from
    # per-shape set-up costs, bench/results/train/*_2026-11-22*), 1 on CPU
    pad_multiple: Optional[int] = None
    max_active_jobs: int = 16
    memory_budget_gb: Optional[float] = None  # None: 90% of the GPU (unlimited on CPU)
    memory_model: str = "auto"  # auto (fit measured peaks on GPU) | analytic
    eval_every: int = 10
    checkpoint_every: int = 10
    log_every: int = 1
    # auto (per call: cublas or triton on GPU, torch on CPU) | cublas | triton | torch | engine (multilora.py);
    # cublas runs its products in the base's dtype (fp32 factors beside a bf16 base: bf16 GEMMs, fp32 gradients)
    lora_backend: str = "auto"
    pipeline_stages: int = 1
    resume: bool = True
    save_plots: bool = True
    max_rounds: Optional[int] = None  # stop (resumably) after this many rounds: tests, time-boxed runs
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)

    def resolve_base_model(self) -> str:
        if self.base_model in ("smollm2", "SmolLM2-135M-Instruct"):
            from bdlora.models import smollm2_path

            return str(smollm2_path())
        return self.base_model

    def to_dict(self) -> dict:
        return {
            **{f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("datasets", "jobs", "early_exit")},
            "datasets": {k: asdict(v) for k, v in self.datasets.items()},
            "jobs": [j.to_dict() for j in self.jobs],
            "early_exit": asdict(self.early_exit),
        }


def _canon(d: dict, where: str) -> dict:
    out = {}
    for k, v in (d or {}).items():
        k2 = _ALIASES.get(k, k)
        if k2 in out:
            raise ConfigError(f"{where}: {k!r} given twice (alias of {k2!r})")
        out[k2] = v
    return out


_JOB_FIELDS = {f.name for f in fields(JobConfig)}


def _make_job(d: dict, where: str) -> JobConfig:
    unknown = sorted(set(d) - _JOB_FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown job fields {unknown}; known: {sorted(_JOB_FIELDS)}")
    if "name" not in d:
        raise ConfigError(f"{where}: a job needs a name")
    if "dataset" not in d:
        raise ConfigError(f"{where}: job {d['name']!r} has no dataset")
    d = dict(d)
    for k in ("lr", "alpha", "weight_decay", "adam_eps", "lora_dropout"):
        if k in d and d[k] is not None:
            d[k] = float(d[k])
    if d.get("max_grad_norm") is not None:
        d["max_grad_norm"] = float(d["max_grad_norm"])
    if "adam_betas" in d:
        d["adam_betas"] = tuple(float(b) for b in d["adam_betas"])
    job = JobConfig(**d)
    if job.steps is None and job.epochs is None:
        job.epochs = 1.0
    for k in ("rank", "nblocks", "batch_size", "grad_accum", "max_seq_len"):
        if int(getattr(job, k)) < 1:
            raise ConfigError(f"{where}: job {job.name!r}: {k} must be >= 1")
    if not 0.0 <= job.lora_dropout < 1.0:
        raise ConfigError(f"{where}: job {job.name!r}: lora_dropout must be in [0, 1), got {job.lora_dropout}")
    if job.a_init not in ("lora", "peft"):
        raise ConfigError(f"{where}: job {job.name!r}: a_init must be 'lora' or 'peft'")
    if job.rank % job.nblocks:
        raise ConfigError(f"{where}: job {job.name!r}: rank={job.rank} is not divisible by nblocks={job.nblocks}")
    return job


def _sample_value(spec: Any, rng: random.Random):
    if isinstance(spec, list):
        return rng.choice(spec)
    if isinstance(spec, dict) and "low" in spec and "high" in spec:
        lo, hi = float(spec["low"]), float(spec["high"])
        if spec.get("log"):
            v = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        else:
            v = rng.uniform(lo, hi)
        return int(round(v)) if spec.get("int") else v
    return spec


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return "+".join(str(x) for x in v)
    return str(v)


def expand_search(search: dict, defaults: dict, where: str) -> list[dict]:
    """Jobs of one search-space entry: the grid's cartesian product or ``num_samples`` random draws."""
    search = dict(search)
    kind = search.pop("type", "grid")
    prefix = search.pop("name", "search")
    space = _canon(search.pop("space", {}), where)
    base = {**defaults, **_canon(search.pop("base", {}), where)}
    num = int(search.pop("num_samples", 0) or 0)
    seed = int(search.pop("seed", 0))
    if search:
        raise ConfigError(f"{where}: unknown search fields {sorted(search)} (type, name, space, base, num_samples, "
                          "seed)")
    if not space:
        raise ConfigError(f"{where}: empty search space")
    keys = list(space)
    combos: list[dict] = []
    if kind == "grid":
        lists = []
        for k in keys:
            v = space[k]
            if not isinstance(v, list):
                raise ConfigError(f"{where}: grid values of {k!r} must be a list, got {v!r}")
            lists.append(v)
        combos = [dict(zip(keys, vals)) for vals in itertools.product(*lists)]
    elif kind == "random":
        if num < 1:
            raise ConfigError(f"{where}: random search needs num_samples >= 1")
        rng = random.Random(seed)
        combos = [{k: _sample_value(space[k], rng) for k in keys} for _ in range(num)]
    else:
        raise ConfigError(f"{where}: search type must be grid or random, got {kind!r}")
    jobs = []
    for i, c in enumerate(combos):
        name = f"{prefix}-{i:03d}-" + "-".join(f"{k}{_fmt(v)}" for k, v in c.items())
        jobs.append({**base, "group": base.get("group", prefix), **c, "name": name})
    return jobs


def parse_run(raw: dict, base_dir: str | os.PathLike = ".") -> RunConfig:
    raw = copy.deepcopy(raw or {})
    base_dir = Path(base_dir)
    for key in ("base_model", "output_dir", "datasets"):
        if key not in raw:
            raise ConfigError(f"run file: missing {key!r}")

    def _path(p: Optional[str]) -> Optional[str]:
        if p is None:
            return None
        q = Path(os.path.expanduser(p))
        return str(q if q.is_absolute() else base_dir / q)

    datasets = {}
    for name, d in (raw.pop("datasets") or {}).items():
        if isinstance(d, str):
            d = {"path": d}
        d = dict(d)
        d["path"] = _path(d["path"])
        d["val_path"] = _path(d.get("val_path"))
        datasets[name] = DatasetConfig(name=name, **d)
    defaults = _canon(raw.pop("defaults", {}) or {}, "defaults")
    job_dicts = []
    for i, j in enumerate(raw.pop("jobs", []) or []):
        job_dicts.append({**defaults, **_canon(j, f"jobs[{i}]")})
    for i, s in enumerate(raw.pop("search", []) or []):
        job_dicts.extend(expand_search(s, defaults, f"search[{i}]"))
    if not job_dicts:
        raise ConfigError("run file: no jobs (give `jobs:` and/or `search:`)")
    if len(datasets) == 1:
        for j in job_dicts:
            j.setdefault("dataset", next(iter(datasets)))
    jobs = [_make_job(j, f"job {j.get('name', i)!r}") for i, j in enumerate(job_dicts)]
    names = [j.name for j in jobs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"run file: duplicate job names {dup}")
    for j in jobs:
        if j.dataset not in datasets:
            raise ConfigError(f"job {j.name!r}: dataset {j.dataset!r} is not defined (datasets: {sorted(datasets)})")
    ee = EarlyExitConfig(**(raw.pop("early_exit", {}) or {}))
    known = {f.name for f in fields(RunConfig)} - {"datasets", "jobs", "early_exit"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"run file: unknown fields {unknown}; known: {sorted(known)}")
    raw["output_dir"] = os.path.expanduser(str(raw["output_dir"]))  # relative to the working directory
    if raw["base_model"] not in ("smollm2", "SmolLM2-135M-Instruct"):
        raw["base_model"] = _path(raw["base_model"])
    run = RunConfig(datasets=datasets, jobs=jobs, early_exit=ee, **raw)
    if run.pad_multiple is not None and (type(run.pad_multiple) is not int or run.pad_multiple < 1):
        raise ConfigError(f"pad_multiple must be a positive integer (or omitted for auto), got {run.pad_multiple!r}")
    if run.lora_backend not in LORA_BACKENDS:
        raise ConfigError(f"lora_backend must be one of {', '.join(LORA_BACKENDS)}, got {run.lora_backend!r}")
    longest = max(j.max_seq_len for j in jobs)
    if run.token_budget < longest:
        raise ConfigError(f"token_budget={run.token_budget} is smaller than the longest max_seq_len={longest}: "
                          "a sample would not fit any micro-batch")
    return run


def load_run(path: str | os.PathLike) -> RunConfig:
    path = Path(path)
    with open(path) as f:
        raw = yaml.safe_load(f)
    return parse_run(raw, base_dir=path.parent)


__all__ = ["ConfigError", "DatasetConfig", "EarlyExitConfig", "JobConfig", "RunConfig", "expand_search",
           "load_run", "parse_run"]
