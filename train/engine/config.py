"""The run file of the multi-LoRA engine (``bdlora sweep --config run.yaml``), in the one vocabulary of
:mod:`bdlora.train.config`.

* Top level: any :class:`~bdlora.train.config.TrainConfig` key (``model``, ``r``, ``lora_alpha``, ``nblocks``, ``lr``,
  ``scheduler``, ``max_steps``, ``max_length``, ``train_file``, ``eval_file``, ``data_format``, ``eval_fraction``,
  ``precision``, ``seed``, ``output_dir``, ``eval_every``, ...) is the default of every job, with TrainConfig's own
  defaults (nblocks 2, linear schedule with a 5% warm-up, batch_size 8, ...). Engine keys (:class:`EngineKeys`:
  ``token_budget``, ``pad_multiple``, ``max_active_jobs``, ``memory_budget_gb``, ``memory_model``, ``lora_backend``,
  ``pipeline_stages``, ``max_rounds``, ``save_plots``, ``device``, ``early_exit``) set the run.
* ``jobs:`` is a list of jobs: the same keys plus ``name``, ``group`` (warm-up selection ranks the jobs of one
  group) and ``priority`` (admitted first; ties keep file order). ``search:`` entries expand into jobs: ``name``
  (a prefix), ``type`` (grid | random), ``space`` (key -> list of values; random also ``{low, high, log?, int?}``),
  ``base`` (keys shared by its jobs), ``num_samples`` and ``seed`` (random).
* Run-level keys are shared by all jobs (one base model, one output folder, one checkpoint cadence): ``model``,
  ``precision``, ``attn_implementation``, ``cudnn_attention``, ``use_liger_kernel`` (Liger Kernel's RMSNorm,
  SwiGLU and RoPE on the shared base; unset: where it can run, as in ``bdlora train``),
  ``gradient_checkpointing`` and ``gradient_checkpointing_every_n_layers`` (the shared base's decoder layers
  recompute their activations in the backward pass), ``load_in_4bit`` with its ``bnb_4bit_*`` keys (the shared base
  quantized once by bitsandbytes, QLoRA-style: every job trains its adapter on the same 4-bit base), ``output_dir``,
  ``save_every``
  and ``log_every`` (in rounds) and ``resume``; they are refused inside ``jobs:``/``search:``.
* A file with neither ``jobs:`` nor ``search:`` -- a ``bdlora train`` job file -- runs unchanged as a one-job sweep;
  the job is named after ``output_dir``'s last component (or ``job``) and its adapter is
  ``<output_dir>/adapters/<name>/``.

Every job is validated as a TrainConfig (same checks and messages: ``max_steps: 0``, ``lr: 0``, negative warm-up
are refused; ``target_modules: q_proj`` is one name) and its paths follow TrainConfig's rule (relative to the
working directory). Its data goes through :func:`bdlora.train.data.load_datasets` (every source and format of
``bdlora train``). The held-out ``eval_fraction`` split is drawn from the run's ``seed`` (the top-level one; for a
one-job file the job's, as in ``bdlora train``), not from each job's, so every job of a sweep is validated on the
same examples and their losses compare (early exit's warm-up selection); a job's own ``seed`` sets its adapter
init, data order and dropout.

Keys of TrainConfig the engine honours its own way: ``packing`` (the engine always packs: ``packing: false`` is
refused), ``progress`` (a progress bar over the run's optimizer steps), ``report_to`` (``tensorboard``: one event
folder per job under ``<output_dir>/runs/<job>``; other trackers are refused) and ``eval_batch_size`` (evaluation is
packed under ``token_budget``). Refused, with the reason: ``training_args`` (the engine runs its own loop),
``precision: fp16`` (no loss scaling: use bf16), ``record_samples``, ``save_total_limit`` (one resumable
``engine_state.pt``), ``push_to_hub`` / ``hub_model_id`` (push one adapter with ``bdlora push``) and
``overwrite_output_dir``. ``resume``: unset starts fresh, ``auto`` continues from ``<output_dir>/engine_state.pt``
when it exists (a checkpoint folder is the trainer's and is refused).

Names other tools use for bdlora's keys are refused naming bdlora's key, as in ``bdlora train``.

``lora_dropout`` (per job, in [0, 1)) follows PEFT: while training, the job's LoRA input is dropped out (inverted
dropout) before its A factor, the base path unaffected; evaluation runs without dropout. Masks are drawn from torch's
RNG seeded per micro-batch from the run seed (the top-level ``seed``) and the dropout jobs' seeds and steps
(reproducible, exact resume). The saved PEFT folder records the job's ``lora_dropout`` in ``adapter_config.json``.

Example::

    model: smollm2
    output_dir: runs/sweep1
    train_file: data/alpaca.jsonl
    nblocks: 3
    r: 12
    max_steps: 200
    jobs:
      - {name: r6, r: 6}
    search:
      - name: lr-grid
        type: grid
        space: {lr: [1.0e-4, 3.0e-4], r: [12, 24]}
    early_exit: {enabled: true}    # ALTO defaults: w=2, p=2, tau_slope=0.001, tau_gap=0.1, 5% warm-up, keep 25%
"""

from __future__ import annotations

import itertools
import math
import os
import random
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Union

from bdlora.train.config import (ConfigError, TrainConfig, apply_overrides, describe_keys, read_yaml,
                                 unknown_keys_message)

LORA_BACKENDS = ("auto", "cublas", "triton", "torch", "engine")  # how MultiLoraLinear runs the jobs' LoRA
MEMORY_MODELS = ("auto", "analytic")
#: TrainConfig keys that are one value for the whole run (one base, one output folder, one checkpoint cadence)
RUN_LEVEL_KEYS = ("model", "precision", "attn_implementation", "cudnn_attention", "use_liger_kernel", "output_dir",
                  "save_every", "log_every", "resume", "gradient_checkpointing",
                  "gradient_checkpointing_every_n_layers", "load_in_4bit", "bnb_4bit_quant_type",
                  "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype")
_NAME_RE = re.compile(r"[A-Za-z0-9_+=@,-][A-Za-z0-9._+=@,-]*")


def _help(text: str, **kw) -> dict:
    return {"metadata": {"help": " ".join(text.split())}, **kw}


@dataclass
class EarlyExitConfig:
    """ALTO early exit (paper defaults)."""

    enabled: bool = False
    window: int = 2  # w: points in the loss-slope regression
    patience: int = 2  # p: consecutive evaluations a rule must hold
    tau_slope: float = 0.001
    tau_gap: float = 0.1
    ema_alpha: float = 0.3  # EMA weight of the newest train loss
    warmup_ratio: float = 0.05  # warm-up = this fraction of a job's total steps
    keep_ratio: float = 0.25  # share of a group's jobs kept after warm-up (top-k by val loss)
    warmup_select: bool = True

    #: (kind, check, what) per field: kind int/float/bool; check on the coerced value
    _CHECKS = {"enabled": ("bool", None, ""), "warmup_select": ("bool", None, ""),
               "window": ("int", lambda v: v >= 2, ">= 2"), "patience": ("int", lambda v: v >= 1, ">= 1"),
               "tau_slope": ("float", None, ""), "tau_gap": ("float", None, ""),  # a negative one disables its rule
               "ema_alpha": ("float", lambda v: 0 < v <= 1, "in (0, 1]"),
               "warmup_ratio": ("float", lambda v: 0 <= v < 1, "in [0, 1)"),
               "keep_ratio": ("float", lambda v: 0 < v <= 1, "in (0, 1]")}

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> "EarlyExitConfig":
        if raw is None:
            raw = {}
        if isinstance(raw, bool):
            raw = {"enabled": raw}
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: early_exit: expected a mapping (e.g. {{enabled: true}}), got {raw!r}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in raw if k not in valid)
        if unknown:
            raise ConfigError(f"{source}: early_exit: {unknown_keys_message(unknown, valid).split('; valid')[0]}; "
                              f"valid keys are: {', '.join(valid)}")
        out = {}
        for k, v in raw.items():
            kind, ok, what = cls._CHECKS[k]
            out[k] = _coerce_engine(v, kind, f"{source}: early_exit.{k}")
            if ok is not None and not ok(out[k]):
                raise ConfigError(f"{source}: early_exit.{k}: must be {what}, got {v!r}")
        return cls(**out)


@dataclass
class EngineKeys:
    """The engine's own keys (top level only); each field's ``help`` is its documentation (``--print-config``)."""

    token_budget: Union[int, str] = field(default="auto", **_help("""Tokens per packed micro-batch, all jobs
        together (rows padded to pad_multiple); at least every job's max_length, so any example fits. auto: on a GPU
        the largest of 16384, 8192, ... (down to the longest max_length) at which the memory model admits the first
        max_active_jobs jobs together, and no larger than their steps' tokens; on CPU 2048 unless memory_budget_gb
        is set. The choice is logged, kept in results.json and reused on resume; a round that runs out of GPU memory
        runs again from the same batches at the next smaller size (one process; with a number the run stops and
        says what to change)."""))
    pad_multiple: Optional[int] = field(default=None, **_help("""Each job's segment of a micro-batch is padded to a
        multiple of this. Unset: 64 on a GPU (the grouped kernel's row tile, and few distinct shapes: ragged rows
        made round times vary up to 10x on an H200), 1 on CPU."""))
    max_active_jobs: int = field(default=16, **_help("""Jobs trained at once; finished or exited jobs free their
        slot for the queue (by priority, then file order)."""))
    memory_budget_gb: Optional[float] = field(default=None, **_help("""Admission limit of the memory model in GiB.
        Unset: 90% of the GPU (unlimited on CPU)."""))
    memory_model: str = field(default="auto", **_help("""auto (the analytic model refitted from measured peaks on a
        GPU, as mLoRA/ALTO) or analytic."""))
    lora_backend: str = field(default="auto", **_help("""How the jobs' LoRA products run: auto (per call: cuBLAS or
        grouped Triton kernels on a GPU, torch on CPU), cublas (products in the base's dtype), triton, torch (fp32
        products) or engine (multilora.py's reference)."""))
    pipeline_stages: int = field(default=1, **_help("""LoRAPP: the base split into this many pipeline stages, one
        process each (spawned locally, or one per launched process under accelerate/torchrun); 1: no pipeline. For a
        base one GPU cannot hold (4 jobs on a 70B base over 2 GPUs: 6.6x the tokens/s of the jobs one after another
        under FSDP2); where it fits, data parallel over the same GPUs (launch N processes, pipeline_stages 1)
        trained 4 and 8 jobs faster (BENCHMARKS.md)."""))
    max_rounds: Optional[int] = field(default=None, **_help("""Stop (resumably) after this many rounds in this
        invocation: tests, time-boxed runs. Unset: run to the end."""))
    save_plots: bool = field(default=True, **_help("Write plots/<job>.png loss curves (needs matplotlib)."))
    device: str = field(default="auto", **_help("""auto (this process's GPU, else CPU), cpu, cuda or cuda:K."""))
    early_exit: dict = field(default_factory=lambda: asdict(EarlyExitConfig()), **_help("""ALTO early exit: enabled
        (false), window (2), patience (2), tau_slope (0.001), tau_gap (0.1), ema_alpha (0.3), warmup_ratio (0.05 of
        a job's steps), keep_ratio (0.25 of a group kept after warm-up), warmup_select (true). Needs eval_every >
        0."""))


ENGINE_KEYS = tuple(f.name for f in fields(EngineKeys))


@dataclass
class JobConfig(TrainConfig):
    """One job of a sweep: a :class:`~bdlora.train.config.TrainConfig` plus its name, group and priority."""

    name: str = field(default="job", **_help("""The job's name (a folder name: adapters/<name>/); in jobs: entries.
        A one-job file's job is named after output_dir's last component."""))
    group: str = field(default="default", **_help("""Early exit's warm-up selection ranks the jobs of one group
        (a search entry's jobs default to its name)."""))
    priority: int = field(default=0, **_help("Higher is admitted first; ties keep file order."))

    def validate(self, source: str = "config") -> None:
        super().validate(source)
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ConfigError(f"{source}: name: {self.name!r} is not a usable folder name (letters, digits and "
                              "._+=@,- ; not starting with '.')")
        if not isinstance(self.group, str) or not self.group:
            raise ConfigError(f"{source}: group: must be a non-empty string, got {self.group!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ConfigError(f"{source}: priority: must be an integer, got {self.priority!r}")

    @property
    def step_samples(self) -> int:
        """Examples one optimizer step consumes."""
        return self.batch_size * self.grad_accum

    def data_key(self) -> tuple:
        """What decides the job's tokenized (train, eval) examples: jobs with equal keys share them."""
        return (self.train_file, self.eval_file, self.eval_fraction if self.eval_file is None else None,
                self.data_format, self.max_length)  # the split's seed is the run's, the same for every job


@dataclass
class RunConfig(EngineKeys):
    """A parsed run file: the engine keys, the run-level TrainConfig keys and the jobs."""

    jobs: list = field(default_factory=list)
    model: str = TrainConfig.model
    precision: str = TrainConfig.precision
    attn_implementation: Optional[str] = None
    cudnn_attention: bool = False  # sdpa may pick cuDNN attention (TrainConfig.cudnn_attention)
    use_liger_kernel: Optional[bool] = None  # Liger's RMSNorm, SwiGLU and RoPE on the shared base (None: auto)
    gradient_checkpointing: bool = False  # the shared base's decoder layers recompute in backward (TrainConfig's)
    gradient_checkpointing_every_n_layers: int = 1  # only every n-th layer recomputes (TrainConfig's)
    load_in_4bit: bool = False  # the shared base quantized to 4 bits by bitsandbytes (TrainConfig's bnb_4bit_* keys)
    output_dir: str = TrainConfig.output_dir
    seed: int = 0  # the run's seed (LoRA-dropout masks): the top-level seed
    save_every: int = 0  # rounds between run checkpoints (and whenever a job finishes); 0: at the end only
    log_every: int = 1  # rounds between progress lines; 0: none
    resume: bool = False  # continue from <output_dir>/engine_state.pt when it exists
    source: str = "run file"

    def __post_init__(self):
        if isinstance(self.early_exit, dict):
            self.early_exit = EarlyExitConfig.from_dict(self.early_exit, self.source)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("jobs", "early_exit", "source")}
        d["early_exit"] = asdict(self.early_exit)
        d["jobs"] = [j.to_dict() for j in self.jobs]
        return d


# ---------------------------------------------------------------------------------------------------- coercion
def _coerce_engine(v: Any, kind: str, where: str) -> Any:
    """A top-level engine value as ``kind`` (numeric strings accepted, as TrainConfig's)."""
    if kind == "bool":
        if not isinstance(v, bool):
            raise ConfigError(f"{where}: must be true or false, got {v!r}")
        return v
    if kind == "str":
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{where}: must be a non-empty string, got {v!r}")
        return v
    if kind == "int|auto":
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        if isinstance(v, str) and not re.fullmatch(r"\s*[0-9.eE+]+\s*", v):
            raise ConfigError(f"{where}: must be an integer or auto, got {v!r}")
        kind = "int"
    if isinstance(v, bool):
        raise ConfigError(f"{where}: must be a number, got {v!r}")
    x = v
    if isinstance(x, str):
        try:
            x = float(x.strip())
        except ValueError:
            raise ConfigError(f"{where}: must be a number, got {v!r}") from None
    if not isinstance(x, (int, float)):
        raise ConfigError(f"{where}: must be a number, got {v!r}")
    if not math.isfinite(x):
        raise ConfigError(f"{where}: must be a finite number, got {v!r}")
    if kind == "int":
        if not float(x).is_integer():
            raise ConfigError(f"{where}: must be an integer, got {v!r}")
        return int(x)
    return float(x)


def _check_engine_keys(raw: dict, source: str) -> dict:
    """The engine keys of ``raw`` coerced and range-checked; raises ConfigError naming the key."""
    out = {}
    spec = {  # key: (kind, optional, check, what)
        "token_budget": ("int|auto", False, lambda v: v == "auto" or v >= 1, ">= 1 or auto"),
        "pad_multiple": ("int", True, lambda v: v >= 1, ">= 1 (1: no padding)"),
        "max_active_jobs": ("int", False, lambda v: v >= 1, ">= 1"),
        "memory_budget_gb": ("float", True, lambda v: v > 0, "> 0 GiB"),
        "memory_model": ("str", False, lambda v: v in MEMORY_MODELS, f"one of {list(MEMORY_MODELS)}"),
        "lora_backend": ("str", False, lambda v: v in LORA_BACKENDS,
                         f"one of {list(LORA_BACKENDS)} (`peft`, PEFT's layer, is a `bdlora train` choice: the engine "
                         "computes every job's LoRA itself)"),
        "pipeline_stages": ("int", False, lambda v: v >= 1, ">= 1 (1: no pipeline)"),
        "max_rounds": ("int", True, lambda v: v >= 1, ">= 1 (unset: run to the end)"),
        "save_plots": ("bool", False, None, ""),
        "device": ("str", False, _valid_device, "auto, cpu, cuda or cuda:K"),
    }
    for k, (kind, optional, ok, what) in spec.items():
        if k not in raw:
            continue
        v = raw[k]
        if v is None and optional:
            out[k] = None
            continue
        out[k] = _coerce_engine(v, kind, f"{source}: {k}")
        if ok is not None and not ok(out[k]):
            raise ConfigError(f"{source}: {k}: must be {what}, got {v!r}")
    if "early_exit" in raw:
        out["early_exit"] = EarlyExitConfig.from_dict(raw["early_exit"], source)
    return out


def _valid_device(v: str) -> bool:
    return bool(re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", v))


def _sample_value(spec: Any, rng: random.Random, where: str):
    if isinstance(spec, list):
        return rng.choice(spec)
    lo = _coerce_engine(spec["low"], "float", f"{where}.low")
    hi = _coerce_engine(spec["high"], "float", f"{where}.high")
    v = math.exp(rng.uniform(math.log(lo), math.log(hi))) if spec.get("log") else rng.uniform(lo, hi)
    return int(round(v)) if spec.get("int") else v


def _check_space_value(k: str, v: Any, kind: str, where: str) -> None:
    if isinstance(v, list):
        if not v:
            raise ConfigError(f"{where}: space.{k}: an empty list of values gives no jobs")
        return
    if kind == "random" and isinstance(v, dict):
        bad = sorted(set(v) - {"low", "high", "log", "int"})
        if bad or "low" not in v or "high" not in v:
            raise ConfigError(f"{where}: space.{k}: a range is {{low, high, log?, int?}}, got {v!r}")
        lo = _coerce_engine(v["low"], "float", f"{where}: space.{k}.low")
        hi = _coerce_engine(v["high"], "float", f"{where}: space.{k}.high")
        if lo > hi:
            raise ConfigError(f"{where}: space.{k}: low={lo:g} is above high={hi:g}")
        if v.get("log") and lo <= 0:
            raise ConfigError(f"{where}: space.{k}: a log range needs low > 0, got {lo:g}")
        return
    raise ConfigError(f"{where}: space.{k}: {'grid values' if kind == 'grid' else 'values'} must be a list"
                      + ("" if kind == "grid" else " or {low, high, log?, int?}") + f", got {v!r}")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return "+".join(str(x) for x in v)
    return str(v)


def expand_search(search: Any, defaults: dict, where: str) -> list[dict]:
    """Job dicts of one ``search:`` entry: the grid's cartesian product or ``num_samples`` random draws (keys in
    the one vocabulary; deprecated names accepted with a FutureWarning)."""
    if not isinstance(search, dict):
        raise ConfigError(f"{where}: expected a mapping {{name, type, space, ...}}, got {search!r}")
    search = dict(search)
    allowed = ("type", "name", "space", "base", "num_samples", "seed")
    unknown = sorted(str(k) for k in search if k not in allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown search key(s) {unknown}; valid: {list(allowed)}")
    kind = search.get("type", "grid")
    if kind not in ("grid", "random"):
        raise ConfigError(f"{where}: type: must be grid or random, got {kind!r}")
    prefix = search.get("name", "search")
    if not isinstance(prefix, str) or not _NAME_RE.fullmatch(prefix):
        raise ConfigError(f"{where}: name: {prefix!r} is not a usable job-name prefix")
    space = search.get("space")
    if not isinstance(space, dict) or not space:
        raise ConfigError(f"{where}: space: expected a non-empty mapping of job keys to lists of values, got "
                          f"{space!r}")
    space = dict(space)
    base = search.get("base") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{where}: base: expected a mapping of job keys, got {base!r}")
    base = {**defaults, **base}
    for k, v in space.items():
        _check_space_value(k, v, kind, where)
    keys = list(space)
    if kind == "grid":
        combos = [dict(zip(keys, vals)) for vals in itertools.product(*(space[k] for k in keys))]
    else:
        num = _coerce_engine(search.get("num_samples"), "int", f"{where}: num_samples") \
            if search.get("num_samples") is not None else 0
        if num < 1:
            raise ConfigError(f"{where}: num_samples: random search needs num_samples >= 1, got {num}")
        seed = _coerce_engine(search.get("seed", 0), "int", f"{where}: seed")
        rng = random.Random(seed)
        combos = [{k: _sample_value(space[k], rng, f"{where}: space.{k}") for k in keys} for _ in range(num)]
    jobs = []
    for i, c in enumerate(combos):
        name = f"{prefix}-{i:03d}-" + "-".join(f"{k}{_fmt(v)}" for k, v in c.items())
        jobs.append({**base, "group": base.get("group", prefix), **c, "name": name})
    return jobs


# ---------------------------------------------------------------------------------------------------- parsing
def _job_dict(d: Any, where: str) -> dict:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping of job keys, got {d!r}")
    return dict(d)


def _check_job_level(d: dict, where: str) -> None:
    for k in d:
        if k in RUN_LEVEL_KEYS:
            raise ConfigError(f"{where}: {k}: is shared by every job of a run (one base model, one output folder, "
                              f"one checkpoint cadence); set {k!r} at the top level")
        if k in ENGINE_KEYS:
            raise ConfigError(f"{where}: {k}: is an engine key; set it at the top level")


#: TrainConfig keys the engine cannot honour as `bdlora train` does: {key: (the values it accepts, why)}
NOT_HONOURED = {
    "record_samples": ((False,), "the engine records no per-example log"),
    "save_total_limit": (None, "the engine keeps one resumable engine_state.pt, not checkpoint folders"),
    "push_to_hub": ((False,), "push one adapter with `bdlora push OUTPUT_DIR/adapters/JOB REPO`"),
    "hub_model_id": (None, "push one adapter with `bdlora push OUTPUT_DIR/adapters/JOB REPO`"),
    "hub_private_repo": (None, "push one adapter with `bdlora push OUTPUT_DIR/adapters/JOB REPO --private`"),
    "overwrite_output_dir": ((False,), "choose a new output_dir, or remove the old one yourself"),
    "packing": ((True,), "the engine always packs a micro-batch's examples (padding-free)"),
    "load_in_8bit": ((False,), "the engine's quantized base is 4-bit (load_in_4bit: true); train on an 8-bit base "
                               "with `bdlora train`"),
    "kbit_upcast_fp32": ((False,), "the shared base stays in the run's precision; train with PEFT's fp32 upcast "
                                   "with `bdlora train`"),
}
#: trackers the engine writes itself (one event folder per job)
ENGINE_TRACKERS = ("tensorboard", "none")


def _check_honoured(keys: dict, where: str) -> None:
    """Keys given explicitly that the engine would otherwise ignore are refused, naming why."""
    for k, (accepted, why) in NOT_HONOURED.items():
        if k in keys and (accepted is None or keys[k] not in accepted):
            raise ConfigError(f"{where}: {k}: {keys[k]!r} is not supported by `bdlora sweep`: {why}")
    trackers = keys.get("report_to")
    if trackers is not None:
        names = [trackers] if isinstance(trackers, str) else list(trackers) if isinstance(trackers, list) else None
        bad = [t for t in (names or []) if t not in ENGINE_TRACKERS]
        if names is None or bad:
            raise ConfigError(f"{where}: report_to: `bdlora sweep` writes tensorboard event files per job "
                              f"(report_to: [tensorboard]) or none (report_to: []); {bad or trackers} is not "
                              "supported: log it with `bdlora train` one job at a time")


def parse_run(raw: Any, source: str = "run file", yaml_dir: Optional[str | os.PathLike] = None,
              check_paths: bool = True) -> RunConfig:
    """A :class:`RunConfig` from a run file's mapping; every error is a ConfigError naming the key (and ``source``).

    ``yaml_dir``: the run file's folder, only for the hint when a relative data path misses the working directory
    but exists there. ``check_paths``: whether data files must exist (TrainConfig.check_paths)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys to values at the top level, got "
                          f"{type(raw).__name__}")
    raw = dict(raw)
    jobs_raw = raw.pop("jobs", None)
    search_raw = raw.pop("search", None)
    single = jobs_raw is None and search_raw is None
    top_valid = [k for k in TrainConfig.valid_keys()] + list(ENGINE_KEYS) + ["jobs", "search"]
    unknown = sorted(str(k) for k in raw if k not in top_valid and k not in ("name", "group", "priority"))
    if unknown:
        raise ConfigError(f"{source}: {unknown_keys_message(unknown, top_valid)}")
    if not single and "name" in raw:
        raise ConfigError(f"{source}: name: is a key of one job: put it under jobs: (or leave jobs: out for a "
                          "one-job file)")
    engine = _check_engine_keys({k: raw.pop(k) for k in list(raw) if k in ENGINE_KEYS}, source)

    # run-level TrainConfig keys: validated with the defaults below (as a job's), then read off the first job
    resume = raw.get("resume")
    if resume is not None and resume != "auto":
        raise ConfigError(f"{source}: resume: the engine resumes from its own output_dir: 'auto' (continue from "
                          f"<output_dir>/engine_state.pt when it exists) or unset (start fresh), got {resume!r}")
    if raw.get("training_args"):
        raise ConfigError(f"{source}: training_args: the engine runs its own training loop (no transformers "
                          "Trainer); these apply to `bdlora train` only")
    _check_honoured(raw, source)
    if raw.get("precision") == "fp16":
        raise ConfigError(f"{source}: precision: fp16 is not supported by the engine (no loss scaling); use bf16 "
                          "or fp32")

    defaults = dict(raw)
    own_dicts: list[tuple[str, dict]] = []  # (where, the job's own keys): defaults and its dataset go under them
    if single:
        name = Path(str(defaults.get("output_dir", TrainConfig.output_dir))).name or "job"
        own_dicts.append((source, {"name": name if _NAME_RE.fullmatch(name) else "job"}))
    else:
        if jobs_raw is not None and not isinstance(jobs_raw, list):
            raise ConfigError(f"{source}: jobs: expected a list of jobs (- {{name: ..., r: ...}}), got "
                              f"{type(jobs_raw).__name__}")
        if search_raw is not None and not isinstance(search_raw, list):
            raise ConfigError(f"{source}: search: expected a list of search spaces (- {{name, type, space}}), got "
                              f"{type(search_raw).__name__}")
        for i, j in enumerate(jobs_raw or []):
            where = f"{source}: jobs[{i}]"
            j = _job_dict(j, where)
            _check_job_level(j, where)
            _check_honoured(j, where)
            if "name" not in j:
                raise ConfigError(f"{where}: name: every job needs a name (its adapter folder)")
            own_dicts.append((f"{where} ({j['name']})", j))
        for i, s in enumerate(search_raw or []):
            where = f"{source}: search[{i}]"
            if isinstance(s, dict):
                for part in ("space", "base"):
                    if isinstance(s.get(part), dict):
                        _check_job_level(s[part], f"{where}: {part}")
                        _check_honoured(s[part], f"{where}: {part}")
            for j in expand_search(s, {}, where):
                own_dicts.append((f"{where} ({j['name']})", j))
        if not own_dicts:
            raise ConfigError(f"{source}: jobs: no jobs (give jobs: and/or search:, or leave both out for a "
                              "one-job file)")
    jobs = []
    for where, own in own_dicts:
        job = JobConfig.from_dict({**defaults, **own}, source=where)
        if check_paths:
            job.check_paths(Path(yaml_dir) if yaml_dir is not None else None, where)
        jobs.append(job)
    names = [j.name for j in jobs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{source}: name: duplicate job names {dup}; every job needs its own (its adapter "
                          "folder)")
    first = jobs[0]  # run-level keys are only at the top level, so every job has the same
    run = RunConfig(**engine, jobs=jobs, model=first.model, precision=first.precision,
                    attn_implementation=first.attn_implementation, cudnn_attention=first.cudnn_attention,
                    use_liger_kernel=first.use_liger_kernel, output_dir=first.output_dir,
                    gradient_checkpointing=first.gradient_checkpointing,
                    gradient_checkpointing_every_n_layers=first.gradient_checkpointing_every_n_layers,
                    load_in_4bit=first.load_in_4bit,
                    seed=_coerce_engine(raw["seed"], "int", f"{source}: seed") if "seed" in raw else 0,
                    save_every=first.save_every, log_every=first.log_every, resume=first.resume == "auto",
                    source=source)
    longest = max(j.max_length for j in jobs)
    if run.token_budget != "auto" and run.token_budget < longest:
        raise ConfigError(f"{source}: token_budget: {run.token_budget} is smaller than the longest max_length "
                          f"({longest}): an example would fit no micro-batch; raise token_budget to >= {longest} "
                          "or lower max_length")
    if run.load_in_4bit and run.pipeline_stages > 1:
        raise ConfigError(f"{source}: load_in_4bit: pipeline stages load their layers from the checkpoint "
                          "unquantized; set pipeline_stages: 1 (a 4-bit 70B base fits one GPU) or drop load_in_4bit")
    if run.early_exit.enabled:
        none = [j.name for j in jobs if j.eval_every == 0]
        if none:
            raise ConfigError(f"{source}: eval_every: early_exit needs evaluations, but jobs {none[:5]} have "
                              "eval_every 0 (only at the end); set eval_every > 0")
    return run


def load_run(path: str | os.PathLike, overrides: Optional[dict[str, Any]] = None) -> RunConfig:
    """Reads and parses a run file (strict YAML: duplicate keys and syntax errors with line numbers); ``overrides``
    (``--set``) replace top-level keys."""
    raw = apply_overrides(read_yaml(path), overrides or {})
    return parse_run(raw, source=str(path), yaml_dir=Path(path).parent)


def describe_run_keys() -> str:
    """Every key of a run file with its default and help, as commented YAML (``bdlora sweep --print-config``)."""
    refused = set(NOT_HONOURED) - {"packing"} | {"training_args"} | set(ENGINE_KEYS)  # pad_multiple: listed once
    job = describe_keys(JobConfig, {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "train_file": "data/train.jsonl",
                                    "packing": True}, exclude=refused)
    engine = describe_keys(EngineKeys)
    return ("# ---- job keys: at the top level, the defaults of every job; under jobs:/search:, one job's (name,\n"
            "# group and priority only there). model, precision, attn_implementation, cudnn_attention,\n"
            "# use_liger_kernel, gradient_checkpointing(_every_n_layers), output_dir, save_every, log_every (in\n"
            "# rounds) and resume are the run's, top level only.\n" + job
            + "# ---- engine keys (top level only)\n" + engine
            + "# ---- jobs (optional; without jobs:/search: the file is one job)\n"
            + "# jobs:\n#   - {name: r8, r: 8}\n# search:\n#   - {name: lr-grid, type: grid, space: {lr: [1.0e-4, "
              "3.0e-4]}}\n")


__all__ = ["ConfigError", "EarlyExitConfig", "EngineKeys", "JobConfig", "RunConfig", "describe_run_keys",
           "expand_search", "load_run", "parse_run"]
