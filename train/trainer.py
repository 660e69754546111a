"""Fine-tune one BD-LoRA adapter: transformers' ``Trainer`` + PEFT, with bdlora adding only what is BD-specific.

    python -m bdlora.train --config job.yaml [--set key=value ...]
    accelerate launch -m bdlora.train --config job.yaml          (GPUs: data parallel, FSDP/DeepSpeed configs)
    accelerate launch --multi_gpu --num_processes K -m bdlora.train --config job.yaml   (K CPU processes, gloo)
    bdlora train --config job.yaml

The loop, optimizer, schedule, mixed precision, gradient accumulation and checkpointing, data parallelism, trackers
(``report_to``) and progress bars are transformers' ``Trainer`` (any other ``TrainingArguments`` field is reachable
through the config's ``training_args``). bdlora contributes:

* the adapter: PEFT's ``use_bdlora`` LoRA from :meth:`bdlora.BDLoraSpec.to_peft_config` (rsLoRA with
  ``lora_alpha * sqrt(N)``, so each of the N blocks is an independent rank ``r/N`` rsLoRA adapter of one weight
  shard; ``tests/test_train_equivalence.py`` checks exactly that), exact module-name validation and the per-shard
  A initialisation;
* the data: :mod:`bdlora.train.data` (every record format, response-only labels for any prefix-consistent chat
  template, tokenised once per run);
* atomic checkpoints (written to a staging folder, renamed when complete) and a resume that skips an unreadable
  newest checkpoint, naming it; a run killed at any moment resumes to a bit-identical adapter;
* the final PEFT folder ``adapter/``: refused if any weight is non-finite, checked by bdlora's strict reader, written
  atomically with a model card (what the adapter is, how to serve it).

Output folder::

    output_dir/
      adapter/               final PEFT LoRA folder + README.md model card
      checkpoint-N/          resumable Trainer checkpoints (PEFT folder, optimizer, scheduler, RNG, trainer state)
      metrics.jsonl          one JSON object per log/eval event (deduplicated across resumes)
      loss.png               train/eval loss curves (when matplotlib is installed)
      runs/                  tensorboard (the default tracker, when installed)
      train_config.yaml      the resolved job
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from bdlora.adapter import atomic_output_dir
from bdlora.peft_model import check_bd_structure, init_block_a_like_lora, use_bdlora_kernels
from bdlora.spec import BDLoraError, BDLoraSpec

from .attention import packed_attention, packed_attention_fits, packed_attention_supported, sdpa_backends
from .checkpointing import every_n_layers_kwarg
from .config import ConfigError, TrainConfig, parse_override
from .liger import folder_model_type, liger_decision
from .data import examples_to_dataset, load_datasets
from .module_walks import CachedModuleWalks

log = logging.getLogger("bdlora.train")

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STAGING_PREFIX = ".staging-"
CONFIG_NAME = "train_config.yaml"
#: a checkpoint's expert factors (BD-LoRA on fused MoE expert tensors): PEFT's checkpoint holds the dense layers only
EXPERTS_CHECKPOINT_NAME = "bd_experts.safetensors"


class TrainingError(BDLoraError):
    """Training cannot go on or its result cannot be saved (e.g. non-finite weights); the message says why."""


# ---------------------------------------------------------------------------------------------------- model
def resolve_model_path(name: str) -> Path:
    """A model folder for ``name`` (see :func:`bdlora.models.resolve_model`)."""
    return resolve_model_and_id(name)[0]


def resolve_model_and_id(name: str) -> tuple[Path, str]:
    """(folder, the id the adapter records as its base); a ConfigError naming the model when it cannot be found."""
    from bdlora.models import ModelNotFound, resolve_model

    try:
        return resolve_model(name)
    except ModelNotFound as e:
        raise ConfigError(f"model: {e}") from None


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_base_model(cfg: TrainConfig, model_dir: Path, device_type: Optional[str] = None):
    """The frozen base for ``cfg``: loaded in the precision's dtype (bf16/fp16 without an fp32 copy); with
    load_in_4bit / load_in_8bit quantized by bitsandbytes at load (:func:`load_kbit_base_model`)."""
    from bdlora.models import ModelNotFound, load_causal_lm, torch_dtype_of

    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.quantized:
        return load_kbit_base_model(cfg, model_dir, device_type)
    try:
        return load_causal_lm(model_dir, torch_dtype_of(cfg.precision, device_type), cfg.attn_implementation)
    except ModelNotFound as e:
        raise ConfigError(f"attn_implementation: {e}") from None


def kbit_quantization_config(cfg: TrainConfig, device_type: str):
    """transformers' ``BitsAndBytesConfig`` for a k-bit ``cfg`` (None when the base is not quantized)."""
    if not cfg.quantized:
        return None
    from transformers import BitsAndBytesConfig

    from bdlora.models import torch_dtype_of

    if cfg.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = torch_dtype_of(cfg.bnb_4bit_compute_dtype or cfg.precision, device_type)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=cfg.bnb_4bit_quant_type or "nf4",
        bnb_4bit_use_double_quant=True if cfg.bnb_4bit_use_double_quant is None else cfg.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=compute)


def load_kbit_base_model(cfg: TrainConfig, model_dir: Path, device_type: str, device_index: Optional[int] = None):
    """The frozen base quantized by bitsandbytes at load (4-bit or 8-bit), on this process's device (on a GPU: GPU
    ``device_index``, by default this process's local rank).

    Non-quantized weights (embeddings, norms, lm_head) stay in the precision's dtype unless ``kbit_upcast_fp32``,
    which runs PEFT's ``prepare_model_for_kbit_training`` (fp32 upcast of those, QLoRA's recipe). Gradient
    checkpointing is the Trainer's (``gradient_checkpointing``, non-reentrant: no input-grad hook needed). On CPU,
    bitsandbytes' inference repacking of 4-bit weights is switched off (it breaks training after an evaluation:
    :func:`bdlora.quant.disable_cpu_inference_packing`)."""
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM

    from bdlora.models import missing_attention_package, torch_dtype_of
    from bdlora.quant import bnb_problem, disable_cpu_inference_packing

    key = "load_in_4bit" if cfg.load_in_4bit else "load_in_8bit"
    problem = bnb_problem()
    if problem is not None:
        raise ConfigError(f"{key}: {problem}")
    attn = cfg.attn_implementation
    if missing_attention_package(attn):
        raise ConfigError(f"attn_implementation: {missing_attention_package(attn)}")
    kwargs: dict[str, Any] = {"dtype": torch_dtype_of(cfg.precision, device_type),
                              "quantization_config": kbit_quantization_config(cfg, device_type)}
    if attn:
        kwargs["attn_implementation"] = attn
    if device_type == "cuda":  # bitsandbytes weights cannot be moved later: load on this process's GPU
        kwargs["device_map"] = {"": PartialState().local_process_index if device_index is None else device_index}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    except (ImportError, RuntimeError, ValueError) as e:
        raise ConfigError(f"{key}: transformers/bitsandbytes could not load {model_dir} quantized: "
                          f"{type(e).__name__}: {e}") from None
    model.config.use_cache = False
    if device_type == "cpu":
        disable_cpu_inference_packing(model)
    if cfg.kbit_upcast_fp32:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def build_peft_model(cfg: TrainConfig, model_dir: Path):
    """(peft_model, spec). Validates names and shapes exactly before PEFT touches the model. On a k-bit base,
    PEFT's bitsandbytes LoRA layers are made to build BD-LoRA (:func:`bdlora.quant.enable_bdlora_on_kbit`) and the
    result is checked layer by layer (:func:`bdlora.quant.check_kbit_bd`): never PEFT's silent dense fallback."""
    from peft import get_peft_model

    base = load_base_model(cfg, model_dir)
    spec = cfg.spec(getattr(base.config, "model_type", None))
    expected = spec.matching_modules(base)
    if cfg.quantized:
        from bdlora.quant import enable_bdlora_on_kbit

        enable_bdlora_on_kbit()
    model = get_peft_model(base, spec.to_peft_config(task_type="CAUSAL_LM"))
    check_bd_structure(model, spec, expected)
    if cfg.quantized:
        from bdlora.quant import check_kbit_bd

        check_kbit_bd(model, spec.nblocks)
    if cfg.a_init == "lora":
        init_block_a_like_lora(model)
    use_bdlora_kernels(model, cfg.lora_backend)
    adapt_experts(cfg, model)
    return model, spec


def adapt_experts(cfg: TrainConfig, model) -> dict:
    """BD-LoRA on the fused expert tensors of a MoE model per ``cfg.target_parameters`` (unset: wherever the model
    has fused experts); the wrapped modules by name (:func:`bd_experts`)."""
    from bdlora.moe import fused_experts, wrap_experts

    if cfg.target_parameters == []:
        return {}
    if not fused_experts(model):
        if cfg.target_parameters:
            raise ConfigError(f"target_parameters: {cfg.target_parameters} but {cfg.model} has no fused experts "
                              "modules (3-D gate_up_proj (E, 2I, H) and down_proj (E, H, I), as transformers stores "
                              "Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE experts); drop the key")
        return {}
    if cfg.quantized:
        raise ConfigError("target_parameters: BD-LoRA on MoE experts is not supported on a k-bit base (bitsandbytes "
                          "quantizes linear layers, not fused expert tensors); set target_parameters: [] or drop "
                          "load_in_4bit/load_in_8bit")
    try:
        return wrap_experts(model, cfg.nblocks, cfg.r, cfg.lora_alpha)
    except BDLoraError as e:
        raise ConfigError(f"target_parameters: {e}") from None


def bd_experts(model) -> dict:
    """{module name: BDLoraExperts} of ``model`` (empty for a dense model)."""
    from bdlora.moe import BDLoraExperts

    return {n: m for n, m in model.named_modules() if isinstance(m, BDLoraExperts)}


def expert_param_names(model) -> set[str]:
    """The parameter names of ``model``'s expert factors (empty for a dense model)."""
    return {f"{path}.{p}" for path, m in bd_experts(model).items() for p, _ in m.named_parameters(recurse=False)}


def expert_state(model) -> dict[str, torch.Tensor]:
    """The expert factors of ``model`` as whole tensors by parameter name (gathered under FSDP2: every process must
    call it); nothing is gathered or copied for a dense model."""
    names = expert_param_names(model)
    return full_trainable_state(model, names) if names else {}


def load_expert_state(model, ckpt: Path) -> None:
    """Restores the expert factors saved with checkpoint ``ckpt`` (the Trainer restores the rest)."""
    from safetensors.torch import load_file

    f = ckpt / EXPERTS_CHECKPOINT_NAME
    if not f.is_file():
        raise ConfigError(f"cannot resume from {ckpt}: it has no {EXPERTS_CHECKPOINT_NAME} (the expert adapters' "
                          "state), so it was not written by this MoE job; start a new output_dir instead")
    saved = load_file(str(f))
    params = dict(model.named_parameters())
    missing = sorted(expert_param_names(model) ^ set(saved))
    if missing:
        raise ConfigError(f"cannot resume from {ckpt}: {f.name} does not match this job's expert adapters "
                          f"({missing[0]} and {len(missing) - 1} more differ)")
    with torch.no_grad():
        for n, t in saved.items():
            params[n].copy_(t)


def warn_unservable_nblocks(spec: BDLoraSpec, model_config) -> Optional[str]:
    """A warning when vLLM cannot serve the model at tensor-parallel size ``nblocks`` (the adapter could not be
    served the way it is blocked); None when it can or when N = 1."""
    from bdlora.spec import servable_tp_degrees, vllm_can_serve_tp

    n = spec.nblocks
    kv_lora = any(m in spec.column_modules for m in ("k_proj", "v_proj"))
    why = vllm_can_serve_tp(model_config, n, n, kv_lora) if n > 1 else None
    if why is None:
        return None
    ok = servable_tp_degrees(model_config, n, kv_lora=kv_lora)
    return (f"nblocks={n}: vLLM cannot serve this model at tensor-parallel size {n} ({why}); this adapter serves at "
            f"TP {ok or 'none'} (M | {n} or {n} | M that the model allows); for TP={n} serving choose nblocks from "
            f"the model's servable sizes {servable_tp_degrees(model_config)}")


def _distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def full_trainable_state(model, names: Optional[set] = None) -> dict[str, torch.Tensor]:
    """The adapter's weights (those in ``names`` when given) as whole tensors, by parameter name. Under FSDP2 the
    parameters are DTensor shards and this gathers them (a collective: every process must call it); only the adapter
    is gathered, never the base."""
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad and (names is None or n in names):
            t = p.detach()
            out[n] = t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
    return out


def params_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for n in sorted(state):
        h.update(n.encode())
        h.update(state[n].detach().cpu().contiguous().float().numpy().tobytes())
    return h.hexdigest()


def nonfinite_parameters(model) -> list[str]:
    """Names of adapter parameters holding NaN/Inf. Sharded (FSDP2) parameters are checked shard by shard and the
    answer is combined over the processes (a collective when sharded)."""
    sharded = any(hasattr(p, "to_local") for p in model.parameters() if p.requires_grad)
    bad = [n for n, p in model.named_parameters()
           if p.requires_grad and not torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()]
    if sharded and _distributed():
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, bad)
        bad = sorted({n for names in everyone for n in names})
    return bad


# ---------------------------------------------------------------------------------------------------- checkpoints
def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders in ``output_dir`` (oldest first); staging folders of interrupted saves are not
    checkpoints."""
    d = Path(output_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def checkpoint_problem(path: Path) -> Optional[str]:
    """None if ``path`` is a readable Trainer checkpoint, else what is wrong with it (naming the file)."""
    state = path / "trainer_state.json"
    try:
        json.loads(state.read_text())
    except (OSError, ValueError) as e:
        return f"{state}: {type(e).__name__}: {e}"
    sharded = (path / "optimizer_0").is_dir() or (path / "optimizer.bin").is_file()  # FSDP's optimizer layouts
    for name in ("scheduler.pt",) if sharded else ("optimizer.pt", "scheduler.pt"):
        f = path / name
        try:
            torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated / garbage: torch raises many kinds
            return f"{f}: unreadable ({type(e).__name__}: {str(e)[:120]})"
    for f in sorted(path.glob("rng_state*.pth")):
        try:
            torch.load(f, map_location="cpu", weights_only=False)
        except Exception as e:
            return f"{f}: unreadable ({type(e).__name__}: {str(e)[:120]})"
    weights = path / "adapter_model.safetensors"
    if sharded and not weights.is_file() and any(path.glob("pytorch_model_fsdp_*")):
        weights = None  # FSDP sharded model state: read by the Trainer on resume
    try:
        if weights is None:
            raise StopIteration
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as fh:
            for k in fh.keys():
                fh.get_tensor(k)
    except StopIteration:
        pass
    except Exception as e:
        return f"{weights}: unreadable ({type(e).__name__}: {str(e)[:120]})"
    experts = path / EXPERTS_CHECKPOINT_NAME
    if experts.exists():
        from safetensors.torch import load_file

        try:
            load_file(str(experts))
        except Exception as e:
            return f"{experts}: unreadable ({type(e).__name__}: {str(e)[:120]})"
    if not (path / CONFIG_NAME).is_file():
        return f"{path / CONFIG_NAME}: missing"
    return None


def resume_checkpoint(cfg: TrainConfig) -> Optional[Path]:
    """The checkpoint to resume from: ``resume: auto`` takes the newest readable one (an unreadable one is skipped
    with a warning naming the file), a folder must be readable, unset starts fresh."""
    if cfg.resume in (None, ""):
        return None
    if cfg.resume == "auto":
        for ckpt in reversed(list_checkpoints(cfg.output_dir)):
            problem = checkpoint_problem(ckpt)
            if problem is None:
                return ckpt
            log.warning("resume: skipping checkpoint %s: %s; trying the previous one", ckpt, problem)
            print(f"bdlora train: warning: skipping unreadable checkpoint {ckpt} ({problem})", file=sys.stderr)
        return None
    p = Path(cfg.resume).expanduser()
    if not p.is_dir():
        raise ConfigError(f"resume: {p} is not a checkpoint folder; use 'auto' or an "
                          f"{Path(cfg.output_dir) / 'checkpoint-N'} folder")
    problem = checkpoint_problem(p)
    if problem is not None:
        raise ConfigError(f"resume: {p} is not a usable checkpoint: {problem}")
    return p


def check_resume_compatible(ckpt: Path, cfg: TrainConfig, world_size: int) -> None:
    import yaml

    old = yaml.safe_load((ckpt / CONFIG_NAME).read_text()) or {}
    defaults = TrainConfig.field_defaults()
    diffs = [k for k in TrainConfig.RESUME_INVARIANT if old.get(k, defaults.get(k)) != getattr(cfg, k)]
    if diffs:
        detail = ", ".join(f"{k}: {old.get(k, defaults.get(k))!r} -> {getattr(cfg, k)!r}" for k in diffs)
        raise ConfigError(f"cannot resume from {ckpt}: the job changed ({detail}); these keys must match the "
                          "checkpoint for an exact resume (start a new output_dir instead)")
    n_rng = len(list(ckpt.glob("rng_state_*.pth"))) or 1
    if n_rng != world_size:
        raise ConfigError(f"cannot resume from {ckpt}: it was written by {n_rng} process(es), this run has "
                          f"{world_size}; the data order depends on the process count")


# ---------------------------------------------------------------------------------------------------- results
@dataclass
class TrainResult:
    adapter_dir: Optional[Path]
    step: int
    total_steps: int
    train_loss: Optional[float]
    eval: dict = field(default_factory=dict)
    wall_s: float = 0.0
    model: Any = None  # the unwrapped PeftModel (in memory, eval mode)
    tokenizer: Any = None
    spec: Optional[BDLoraSpec] = None
    tokens_per_s: Optional[float] = None
    peak_memory_gb: Optional[float] = None


def _default_report_to() -> list[str]:
    import importlib.util

    return ["tensorboard"] if (importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")) \
        else []


def _use_cpu() -> bool:
    forced = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return forced or not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()))


#: what runs a BD layer inside a compiled model, per lora_backend (the start line says it)
COMPILED_LAYER = {"auto": "PEFT's layer", "peft": "PEFT's layer",
                  "cublas": "bdlora's kernels as a custom op in the graph"}


def compiles_model(training_args: dict) -> bool:
    """Whether the Trainer will compile the model: transformers' ``torch_compile`` (which ``torch_compile_backend``
    or ``torch_compile_mode`` also turn on), or accelerate's ``ACCELERATE_DYNAMO_BACKEND`` (``accelerate launch
    --dynamo_backend``), which the Trainer's dynamo plugin reads when no backend is given."""
    if any(training_args.get(k) for k in ("torch_compile", "torch_compile_backend", "torch_compile_mode")):
        return True
    return os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower() not in ("no", "")


def liger_choice(cfg: TrainConfig, model_type: Optional[str]) -> tuple[bool, str]:
    """Whether the run uses Liger Kernel (``use_liger_kernel``) and why; ``true`` where it cannot run is a
    ConfigError naming what is missing."""
    unsupported = None
    if cfg.quantized:
        unsupported = "a k-bit base (not measured with Liger's kernels)"
    elif cfg.lora_backend == "cublas" and compiles_model(cfg.training_args):
        # the one 8B-shape run of this combination on an H200 stopped with an illegal memory access; each alone
        # under torch_compile trains correctly
        unsupported = ("training_args.torch_compile with lora_backend: cublas (Liger's kernels and bdlora's in one "
                       "compiled graph failed on a GPU)")
    return liger_decision(cfg.use_liger_kernel, model_type, on_gpu=not _use_cpu() and torch.cuda.is_available(),
                          unsupported=unsupported)


def liger_kernel_config(experts: bool, sharded: bool) -> dict:
    """The Liger kernels a run leaves out (transformers' ``liger_kernel_config``; empty: all of them). BD-LoRA
    experts: Liger's SwiGLU patch would replace the expert forward that carries them. ``sharded`` parameters (FSDP,
    DeepSpeed ZeRO-3, :func:`shards_parameters`): Liger's fused linear cross-entropy reads ``lm_head.weight`` outside
    the head's forward, where FSDP2 still holds it as a DTensor beside PEFT's plain hidden states (a mixed-tensor
    error) and ZeRO-3 as an empty partition (a size mismatch), at the first step; the head then runs as a module and
    the loss is transformers' own."""
    config = {}
    if experts:
        config["swiglu"] = False
    if sharded:
        config["fused_linear_cross_entropy"] = False
    return config


def shards_parameters(cfg: TrainConfig) -> bool:
    """Whether the run's parameters are sharded across processes: FSDP (accelerate's FSDP configs set
    ACCELERATE_USE_FSDP; or ``training_args.fsdp``) or DeepSpeed ZeRO stage 3 (accelerate's DeepSpeed configs set
    ACCELERATE_DEEPSPEED_ZERO_STAGE; or ``training_args.deepspeed``, a config dict or JSON file)."""
    if _env_flag("ACCELERATE_USE_FSDP") or cfg.training_args.get("fsdp"):
        return True
    if _env_flag("ACCELERATE_USE_DEEPSPEED") and os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "").strip() == "3":
        return True
    ds = cfg.training_args.get("deepspeed")
    if isinstance(ds, (str, os.PathLike)):
        try:
            ds = json.loads(Path(ds).read_text())
        except (OSError, ValueError):
            return False  # transformers reads it next and names the problem
    return isinstance(ds, dict) and str((ds.get("zero_optimization") or {}).get("stage")) == "3"


def uses_deepspeed(cfg: TrainConfig) -> bool:
    """Whether DeepSpeed runs the job (accelerate's DeepSpeed configs, or ``training_args.deepspeed``)."""
    return _env_flag("ACCELERATE_USE_DEEPSPEED") or bool(cfg.training_args.get("deepspeed"))


def training_arguments(cfg: TrainConfig, total_steps: int, has_eval: bool, liger: bool = False,
                       experts: bool = False):
    """transformers ``TrainingArguments`` for ``cfg`` (bdlora's keys mapped to theirs, ``training_args`` on top);
    ``liger``: :func:`liger_choice`'s decision; ``experts``: the model has BD-LoRA experts, whose forward Liger's
    SwiGLU patch would replace (so it is left out)."""
    from transformers import TrainingArguments

    from bdlora.models import torch_dtype_of

    dtype = torch_dtype_of(cfg.precision, "cpu" if _use_cpu() else "cuda")
    report_to = cfg.report_to if cfg.report_to is not None else _default_report_to()
    eval_on = has_eval and cfg.eval_every > 0
    kwargs = dict(
        output_dir=cfg.output_dir, per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.eval_batch_size or cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum, learning_rate=cfg.lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_betas[0], adam_beta2=cfg.adam_betas[1], adam_epsilon=cfg.adam_eps,
        max_grad_norm=cfg.max_grad_norm, lr_scheduler_type=cfg.scheduler, warmup_steps=cfg.warmup_for(total_steps),
        max_steps=total_steps, seed=cfg.seed, data_seed=cfg.seed,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, use_cpu=_use_cpu(),
        logging_steps=cfg.log_every, logging_first_step=False,
        eval_strategy="steps" if eval_on else "no", eval_steps=cfg.eval_every if eval_on else None,
        save_strategy="steps" if cfg.save_every else "no", save_steps=cfg.save_every or 500,
        save_total_limit=cfg.save_total_limit, report_to=report_to or "none", disable_tqdm=not cfg.progress,
        # batches (pinned: dataloader_pin_memory's default) copied without waiting for the GPU: the next batch's
        # copy is queued behind the running step
        **({} if _use_cpu() else {"accelerator_config": {"non_blocking": True}}),
        remove_unused_columns=False, ddp_find_unused_parameters=False,
        # BDLoraTrainer counts the tokens itself without a host sync per step (transformers' count reads it back
        # right after the backward is queued, leaving the GPU idle while the host clips, steps and loads the batch)
        include_num_input_tokens_seen="no", use_liger_kernel=liger,
        # a non-finite step loss is logged as such, not replaced by the running mean, so that MetricsLog stops a
        # diverged run at its next log (with the filter a NaN run logs finite losses to its end)
        logging_nan_inf_filter=False,
    )
    # transformers >= 5.24 calls it activation checkpointing (gradient_checkpointing* are deprecated aliases there)
    ckpt = ("activation_checkpointing" if "activation_checkpointing" in
            {f.name for f in dataclasses.fields(TrainingArguments)} else "gradient_checkpointing")
    kwargs[ckpt] = cfg.gradient_checkpointing
    every_n = every_n_layers_kwarg(cfg.gradient_checkpointing_every_n_layers)
    kwargs[f"{ckpt}_kwargs"] = {"use_reentrant": False, **every_n} if cfg.gradient_checkpointing else None
    liger_config = liger_kernel_config(experts, sharded=shards_parameters(cfg)) if liger else None
    if liger_config:
        kwargs["liger_kernel_config"] = liger_config
    kwargs.update(cfg.training_args)
    try:
        return TrainingArguments(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"training_args: transformers refused the arguments: {e}") from None


class _Collator:
    """Our collate (padded, or padding-free when ``packing``); with ``record_samples`` each batch also carries its
    example indices (``sample_index``), recorded by the trainer when the micro-batch is trained on (the dataloader
    prefetches batches ahead, so the collator cannot know which are used)."""

    def __init__(self, pad_id: int, packing: bool, record: bool, attn_implementation: Optional[str] = None,
                 pad_multiple: int = 1, packed_attention: bool = False):
        from .data import make_collator
        from .engine.packing import MIN_ROW_TOKENS

        # transformers reads packed examples from the position ids in every row for sdpa / eager / flex, but only
        # in a single row for flash-attention; attention example by example (packed_attention) needs no row cap
        one_row = packed_attention or "flash" in (attn_implementation or "")
        self.inner = make_collator(pad_id, packing, None if one_row else MIN_ROW_TOKENS, pad_multiple)
        self.record = record

    def __call__(self, rows: list[dict]) -> dict:
        batch = self.inner(rows)  # make_collator's collators take the dataset's rows as they are
        if self.record:
            batch["sample_index"] = torch.tensor([int(r["index"]) for r in rows])
        return batch


def _make_trainer_class():
    from transformers import Trainer, TrainerCallback

    class BDLoraTrainer(Trainer):
        """transformers' Trainer whose checkpoints appear atomically and never hold non-finite weights; with
        ``record_path`` set, each trained micro-batch's example indices are appended there; FLOPs counted without
        walking the model every step."""

        record_path: Optional[Path] = None
        #: tokens_seen counted here (``include_num_input_tokens_seen`` left "no"): non-padding tokens summed on the
        #: device each step and read back only when logging or saving, where the Trainer reads them every step
        count_tokens: bool = False
        _tokens_on_device: Optional[torch.Tensor] = None
        _tokens_on_host: int = 0
        _tokens_at_start: Optional[int] = None

        def training_step(self, model, inputs, *args, **kwargs):
            if self.count_tokens:
                if self._tokens_at_start is None:  # the state of a resumed run is loaded by the first step
                    self._tokens_at_start = self.state.num_input_tokens_seen
                mask = inputs.get("attention_mask")  # packed batches: their mask counts tokens (data.pack_rows)
                if mask is None:
                    self._tokens_on_host += inputs["input_ids"].numel()
                else:
                    n = mask.sum(dtype=torch.int64)
                    self._tokens_on_device = n if self._tokens_on_device is None else self._tokens_on_device + n
            return super().training_step(model, inputs, *args, **kwargs)

        def _read_token_count(self) -> None:
            """Adds the tokens counted since the last read, over every process, to the state (a collective: called
            where every process is, at a log or a checkpoint)."""
            if not self.count_tokens:
                return
            n = torch.tensor(self._tokens_on_host, dtype=torch.int64, device=self.args.device)
            if self._tokens_on_device is not None:
                n = n + self._tokens_on_device
            self.state.num_input_tokens_seen += int(self.accelerator.gather(n).sum().item())
            self._tokens_on_device, self._tokens_on_host = None, 0

        def log(self, logs, start_time=None, *args, **kwargs):
            if self.count_tokens:
                from transformers.trainer_utils import speed_metrics

                self._read_token_count()
                logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
                if start_time is not None and self._tokens_at_start is not None:
                    logs.update(speed_metrics("train", start_time,
                                              num_tokens=self.state.num_input_tokens_seen - self._tokens_at_start))
            super().log(logs, start_time, *args, **kwargs)

        def compute_loss(self, model, inputs, *args, **kwargs):
            idx = inputs.pop("sample_index", None)
            if idx is not None and self.record_path is not None and model.training:
                with open(self.record_path, "a") as f:
                    f.write(json.dumps({"rank": self.args.process_index, "step": self.state.global_step,
                                        "records": idx.tolist()}) + "\n")
            if "position_ids" in inputs:  # a packed batch: its mask only counted tokens (data.pack_rows)
                inputs.pop("attention_mask", None)
            return super().compute_loss(model, inputs, *args, **kwargs)

        def floating_point_ops(self, inputs) -> int:
            """transformers' estimate (6 x tokens x non-embedding parameters) with the parameter count taken once:
            counting walks every module (~20 ms a step for a 32-layer PEFT model on a CPU core), host time that a
            short-batch GPU step is bound by."""
            if getattr(self, "_flop_params", None) is None:
                if not hasattr(self.model, "num_parameters"):
                    return 0
                self._flop_params = self.model.num_parameters(exclude_embeddings=True)
            main_input = getattr(self.model, "main_input_name", "input_ids")
            return 6 * inputs[main_input].numel() * self._flop_params if main_input in inputs else 0

        def _save_checkpoint(self, model, trial):
            self._read_token_count()  # the saved state's tokens_seen is exact
            bad = nonfinite_parameters(self.accelerator.unwrap_model(self.model))
            if bad:
                raise TrainingError(f"step {self.state.global_step}: the adapter has non-finite values ({bad[0]} "
                                    f"and {len(bad) - 1} more); not saving it. Lower lr or enable max_grad_norm.")
            run_dir = self.args.output_dir
            name = f"checkpoint-{self.state.global_step}"
            staging = os.path.join(run_dir, f"{STAGING_PREFIX}{name}")
            if self.args.should_save:
                shutil.rmtree(staging, ignore_errors=True)
            self.accelerator.wait_for_everyone()
            self.args.output_dir = staging
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self.args.output_dir = run_dir
            experts = expert_state(self.accelerator.unwrap_model(self.model))  # every process: FSDP gathers
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                src, dest = Path(staging) / name, Path(run_dir) / name
                shutil.copy2(Path(run_dir) / CONFIG_NAME, src / CONFIG_NAME)
                if experts:
                    from safetensors.torch import save_file

                    save_file({n: t.cpu().contiguous() for n, t in experts.items()},
                              str(src / EXPERTS_CHECKPOINT_NAME))
                _fsync_tree(src)
                if dest.exists():  # a re-save of the same step (resumed run): replace our own checkpoint
                    shutil.rmtree(dest)
                os.replace(src, dest)
                shutil.rmtree(staging, ignore_errors=True)
                for old in list_checkpoints(run_dir)[:-self.args.save_total_limit]:
                    shutil.rmtree(old, ignore_errors=True)
            self.accelerator.wait_for_everyone()

    class StopAfter(TrainerCallback):
        """Stops after ``step`` (saving a checkpoint first), as a crash would right after one."""

        def __init__(self, step: int):
            self.step = step

        def on_step_end(self, args, state, control, **kw):
            if state.global_step >= self.step:
                control.should_save = True
                control.should_training_stop = True

    class MetricsLog(TrainerCallback):
        """metrics.jsonl on the main process (bdlora's names: train_loss, eval_loss, eval_ppl, lr, grad_norm), no
        step twice after a resume; a non-finite train loss or gradient norm stops the run with a clear error."""

        def __init__(self, path: Path):
            self.path = path

        def on_train_begin(self, args, state, control, **kw):
            if not state.is_world_process_zero or not self.path.exists():
                return
            # A resumed run redoes the steps after its checkpoint: drop their old records (atomic rewrite).
            keep = [l for l in self.path.read_text().splitlines()
                    if l.strip() and json.loads(l).get("step", 0) <= state.global_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(l + "\n" for l in keep))
            os.replace(tmp, self.path)

        def on_log(self, args, state, control, logs=None, **kw):
            logs = dict(logs or {})
            if state.is_world_process_zero:
                rec: dict[str, Any] = {"step": state.global_step, "time": round(time.time(), 3)}
                names = {"loss": "train_loss", "learning_rate": "lr", "grad_norm": "grad_norm",
                         "eval_loss": "eval_loss", "num_input_tokens_seen": "tokens_seen",
                         "train_tokens_per_second": "tokens_per_s"}
                for k, v in logs.items():
                    if k in names:
                        rec[names[k]] = v
                if "eval_loss" in rec:
                    rec["eval_ppl"] = math.exp(min(rec["eval_loss"], 50.0))
                if len(rec) > 2:
                    with open(self.path, "a") as f:
                        f.write(json.dumps(rec) + "\n")
            # fp16's loss scaling skips steps with an infinite gradient norm: not a divergence there
            seen = [("train loss", logs.get("loss")), ("gradient norm", None if args.fp16 else logs.get("grad_norm"))]
            bad = next(((what, v) for what, v in seen if v is not None and not math.isfinite(v)), None)
            if bad:  # after its record: metrics.jsonl shows the step that diverged
                raise TrainingError(f"step {state.global_step}: the {bad[0]} is {bad[1]}; training diverged. Lower "
                                    "lr (or enable max_grad_norm) and start again; no adapter was saved.")

    class ExpertsIntact(TrainerCallback):
        """Stops a run whose BD-LoRA experts no longer run their own forward (a kernel patch rebound it): it would
        train and save an adapter the model never used."""

        def __init__(self, modules: dict):
            self.modules = modules

        def on_train_begin(self, args, state, control, **kw):
            from bdlora.moe import check_experts_intact

            problem = check_experts_intact(self.modules)
            if problem:
                raise TrainingError(f"{problem}; the expert adapters would not train. Set use_liger_kernel: false "
                                    "(or leave liger_kernel_config's swiglu off)")

    return BDLoraTrainer, StopAfter, MetricsLog, ExpertsIntact


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def _launched_distributed() -> bool:
    """True under accelerate launch / torchrun with more than one process, or with FSDP or DeepSpeed configured."""
    return (int(os.environ.get("WORLD_SIZE", "1")) > 1
            or _env_flag("ACCELERATE_USE_FSDP") or _env_flag("ACCELERATE_USE_DEEPSPEED"))


def _env_flag(name: str) -> bool:
    """An accelerate launcher flag in the environment ("1" / "true") is set."""
    return os.environ.get(name, "").lower() in ("1", "true")


def use_one_gpu_unless_launched() -> Optional[str]:
    """A run that was not launched data parallel trains on one GPU: transformers' Trainer would otherwise wrap the
    model in ``torch.nn.DataParallel`` over every visible GPU, multiplying the job's batch (and changing its steps
    and result) behind the user's back. Narrows ``CUDA_VISIBLE_DEVICES`` to its first GPU before CUDA starts (what
    torch documents for choosing devices) and returns a note saying so; None when nothing was changed."""
    if _launched_distributed() or _use_cpu() or not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if count <= 1:
        return None
    how = (f"to train on all {count} GPUs, launch data parallel: accelerate launch --num_processes {count} "
           "-m bdlora.train --config JOB.yaml (or an FSDP config, examples/accelerate/)")
    if torch.cuda.is_initialized():
        raise ConfigError(f"{count} GPUs are visible to one training process whose CUDA is already started; "
                          f"bdlora trains one process on one GPU: set CUDA_VISIBLE_DEVICES to one GPU, or {how}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = visible.split(",")[0].strip() if visible else "0"
    os.environ["CUDA_VISIBLE_DEVICES"] = first
    return f"{count} GPUs visible; this one process trains on GPU {first}; {how}"


def _world() -> tuple[int, int]:
    from accelerate import PartialState

    st = PartialState(cpu=_use_cpu())
    return st.num_processes, st.process_index


# ---------------------------------------------------------------------------------------------------- training
def run_training(cfg: TrainConfig, *, stop_after_steps: Optional[int] = None, validate_adapter: bool = True
                 ) -> TrainResult:
    """Runs one job. ``stop_after_steps`` interrupts the run after that step (checkpointing it first), as a crash
    would after a checkpoint; the job's schedule still spans all its steps. Returns a :class:`TrainResult`."""
    import yaml
    from accelerate import PartialState
    from transformers import set_seed

    t0 = time.time()
    cfg.validate()
    out = Path(cfg.output_dir)
    gpu_note = use_one_gpu_unless_launched()
    world, rank = _world()
    state = PartialState()
    main = state.is_main_process
    if main:
        _prepare_output_dir(out)
        claim_output_dir(out, cfg)
    with state.main_process_first():
        model_dir, base_id = resolve_model_and_id(cfg.model)
        # decided before the base loads: `use_liger_kernel: true` where it cannot run fails in seconds
        liger, liger_note = liger_choice(cfg, folder_model_type(model_dir))
        tokenizer = load_tokenizer(model_dir)
        train_ex, eval_ex = load_datasets(cfg, tokenizer)
    if cfg.batch_size > len(train_ex):
        raise ConfigError(f"batch_size: {cfg.batch_size} is larger than the training set ({len(train_ex)} examples "
                          f"in {cfg.train_file}); lower batch_size or add data")
    total_steps = cfg.total_steps(len(train_ex), world)
    ckpt = resume_checkpoint(cfg)
    if ckpt is not None:
        check_resume_compatible(ckpt, cfg, world)

    set_seed(cfg.seed)  # same adapter init on every process
    model, spec = build_peft_model(cfg, model_dir)
    model.peft_config["default"].base_model_name_or_path = base_id  # the id the user gave, not a cache path
    if main:
        if gpu_note:
            print(f"bdlora train: {gpu_note}", file=sys.stderr)
        warning = warn_unservable_nblocks(spec, model.config)
        if warning:
            print(f"bdlora train: warning: {warning}", file=sys.stderr)
        (out / CONFIG_NAME).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    experts = bd_experts(model)
    args = training_arguments(cfg, total_steps, bool(eval_ex), liger, experts=bool(experts))
    BDLoraTrainer, StopAfter, MetricsLog, ExpertsIntact = _make_trainer_class()
    callbacks = [MetricsLog(out / "metrics.jsonl")] + ([ExpertsIntact(experts)] if experts else [])
    # the Trainer's per-step walks of the model from lists; not where FSDP or DeepSpeed replace or own the parameters
    callbacks.append(CachedModuleWalks(enabled=not shards_parameters(cfg) and not uses_deepspeed(cfg)))
    if stop_after_steps is not None:
        callbacks.append(StopAfter(stop_after_steps))
    record = out / f"samples.rank{rank}.jsonl" if cfg.record_samples else None
    # packed batches attend example by example through torch's varlen flash attention, unless the job names an
    # attention implementation (`sdpa`: transformers' block-causal mask)
    packed = (cfg.packing and cfg.attn_implementation is None and packed_attention_supported(args.device)
              and packed_attention_fits(model))
    trainer = BDLoraTrainer(model=model, args=args, train_dataset=examples_to_dataset(train_ex),
                            eval_dataset=examples_to_dataset(eval_ex) if eval_ex else None,
                            data_collator=_Collator(tokenizer.pad_token_id, cfg.packing, record is not None,
                                                    cfg.attn_implementation, cfg.pad_multiple or 1, packed),
                            processing_class=tokenizer, callbacks=callbacks)
    trainer.record_path = record
    # the user's own include_num_input_tokens_seen: transformers counts (or nothing does, for "no")
    trainer.count_tokens = "include_num_input_tokens_seen" not in cfg.training_args
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if main:
        msg = (f"bdlora train: {cfg.model} | N={spec.nblocks} r={spec.r} (r/N={spec.block_rank}) "
               f"scale={spec.scale:.4g} | {len(spec.column_modules)} column + {len(spec.row_modules)} row module "
               f"names" + (f" + the experts of {len(experts)} MoE layers" if experts else "")
               + f", {n_train:,} trainable params | {len(train_ex)} train / {len(eval_ex)} eval examples | "
               f"{total_steps} steps x {cfg.batch_size * cfg.grad_accum * world} examples ({world} process(es)) on "
               f"{args.device} in {next(model.parameters()).dtype}, lora_backend {cfg.lora_backend}"
               + (f" ({COMPILED_LAYER[cfg.lora_backend]} under torch_compile)"
                  if compiles_model(cfg.training_args) else "")
               + f", Liger kernels {liger_note}"
               + (" without its fused linear cross-entropy" if args.use_liger_kernel and (
                   args.liger_kernel_config or {}).get("fused_linear_cross_entropy") is False else "")
               + (", packed attention (varlen flash)" if packed else "")
               + (f" | FSDP{getattr(trainer.accelerator.state.fsdp_plugin, 'fsdp_version', '')}"
                  if trainer.is_fsdp_enabled else ""))
        if ckpt is not None:
            msg += f" | resuming from {ckpt}"
        print(msg, flush=True)
    if ckpt is not None and experts:
        load_expert_state(model, ckpt)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    done = ckpt is not None and json.loads((ckpt / "trainer_state.json").read_text())["global_step"] >= total_steps
    if done:  # a finished run's last checkpoint: nothing to train (Trainer would run one step more)
        from transformers import TrainerState

        trainer._load_from_checkpoint(str(ckpt))
        trainer.state = TrainerState.load_from_json(str(ckpt / "trainer_state.json"))
        tokens_per_s = None
    else:
        with sdpa_backends(cfg.cudnn_attention), packed_attention(model, packed):
            train_out = trainer.train(resume_from_checkpoint=str(ckpt) if ckpt is not None else None)
        tokens_per_s = next((h["train_tokens_per_second"] for h in reversed(trainer.state.log_history)
                             if "train_tokens_per_second" in h), None)
    step = trainer.state.global_step
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    last_loss = losses[-1] if losses else None
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    peaks = [peak]
    if peak is not None and world > 1 and _distributed():  # every process's peak: what FSDP sharding saves
        peaks = [None] * world
        torch.distributed.all_gather_object(peaks, peak)

    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    adapter_dir, last_eval = None, {}
    if step >= total_steps:
        if eval_ex:
            with sdpa_backends(cfg.cudnn_attention), packed_attention(model, packed):
                metrics = trainer.evaluate()
            last_eval = {"eval_loss": metrics["eval_loss"], "eval_ppl": math.exp(min(metrics["eval_loss"], 50.0))}
        final_state = full_trainable_state(unwrapped)  # every process: FSDP gathers the adapter's shards
        bad = [n for n, t in final_state.items() if not torch.isfinite(t).all()]
        if bad:
            raise TrainingError(f"the trained adapter has non-finite values ({bad[0]} and {len(bad) - 1} more); not "
                                "saving it. Lower lr (or enable max_grad_norm) and start again.")
        adapter_dir = out / "adapter"
        if main:
            with atomic_output_dir(adapter_dir) as tmp:
                # PEFT picks the adapter's tensors out of this (whole) state dict, sharded or not
                unwrapped.save_pretrained(str(tmp), state_dict={n: t.cpu() for n, t in final_state.items()})
                if experts:  # the expert factors join PEFT's folder in PEFT's expert-LoRA format
                    from bdlora.adapter import add_experts, load_adapter, write_adapter_files
                    from bdlora.moe import trained_expert_factors

                    write_adapter_files(add_experts(load_adapter(tmp), trained_expert_factors(
                        final_state, bd_experts(unwrapped))), tmp)
                write_model_card(tmp, spec, cfg, base_id, tokens_per_s=tokens_per_s, eval_metrics=last_eval, steps=step,
                                 moe_layers=len(experts))
            if validate_adapter:
                _validate_saved(adapter_dir, spec, moe_layers=len(experts))
            _plot_losses(trainer.state.log_history, out / "loss.png")
            if cfg.push_to_hub:
                from bdlora.hub import HubError, push_adapter

                try:
                    url = push_adapter(adapter_dir, cfg.hub_model_id, private=cfg.hub_private_repo)
                except HubError as e:
                    raise TrainingError(f"the adapter is saved in {adapter_dir}, but {e}; push it later with "
                                        f"`bdlora push {adapter_dir} {cfg.hub_model_id}`") from None
                print(f"bdlora train: pushed {adapter_dir} to {url}", flush=True)
        trainer.accelerator.wait_for_everyone()
    if record is not None:
        digest = params_digest(full_trainable_state(unwrapped))
        with open(record, "a") as f:
            f.write(json.dumps({"final_step": step, "rank": rank, "params_sha256": digest}) + "\n")
    wall = time.time() - t0
    if main:
        if adapter_dir is not None:
            ev = (f"; eval loss {last_eval['eval_loss']:.4f} (ppl {last_eval['eval_ppl']:.3f})" if last_eval else "")
            print(f"bdlora train: done in {wall:.1f}s, step {step}/{total_steps}, train loss "
                  f"{last_loss if last_loss is None else round(last_loss, 4)}{ev}; adapter saved to {adapter_dir}"
                  + (f"; peak GPU memory {', '.join(f'{x:.2f}' for x in peaks)} GiB" if peak is not None else "")
                  + (f"; {tokens_per_s:,.0f} tokens/s" if tokens_per_s else ""), flush=True)
        else:
            print(f"bdlora train: stopped at step {step}/{total_steps} after {wall:.1f}s (checkpoints in {out})",
                  flush=True)
    unwrapped.eval()
    return TrainResult(adapter_dir=adapter_dir, step=step, total_steps=total_steps, train_loss=last_loss,
                       eval=last_eval, wall_s=wall, model=unwrapped, tokenizer=tokenizer, spec=spec,
                       tokens_per_s=tokens_per_s, peak_memory_gb=peak)


def _prepare_output_dir(out: Path) -> None:
    """Create ``out`` (a clear error when it cannot be written) and drop staging folders of interrupted saves."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"output_dir: cannot write to {out} ({e.strerror or e}); choose a writable folder") from None
    if not out.is_dir():
        raise ConfigError(f"output_dir: {out} is not a folder")
    for stale in out.glob(f"{STAGING_PREFIX}checkpoint-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _job_differences(previous: dict, cfg: TrainConfig) -> list[str]:
    """The keys that make ``cfg`` a different job from the one whose train_config.yaml is ``previous``."""
    defaults, now = TrainConfig.field_defaults(), cfg.to_dict()
    return [k for k in TrainConfig.RESUME_INVARIANT if previous.get(k, defaults.get(k)) != now[k]]


def claim_output_dir(out: Path, cfg: TrainConfig) -> None:
    """A job's output_dir may hold only its own work: another job's trained adapter or checkpoints are never
    replaced unless ``overwrite_output_dir`` (then they are removed now), and this job's own are continued with
    ``resume`` or replaced with ``overwrite_output_dir``; a ConfigError says which and what to do."""
    import yaml

    adapter = out / "adapter"
    has_adapter = (adapter / "adapter_config.json").is_file()
    checkpoints = list_checkpoints(out)
    if not has_adapter and not checkpoints:
        return
    if cfg.overwrite_output_dir:
        for old in checkpoints + ([adapter] if adapter.exists() else []):
            shutil.rmtree(old)
        return
    if cfg.resume is not None and checkpoints:
        return  # a resume: check_resume_compatible compares the job with its checkpoint's, key by key
    held = "a trained adapter (adapter/)" if has_adapter else f"checkpoints ({checkpoints[-1].name})"
    try:
        previous = yaml.safe_load((out / CONFIG_NAME).read_text()) or {}
    except (OSError, yaml.YAMLError):
        previous = None
    differs = _job_differences(previous, cfg) if isinstance(previous, dict) else ["train_config.yaml unreadable"]
    if differs:
        raise ConfigError(f"output_dir: {out} holds {held} of another job (it differs in {', '.join(differs[:6])}); "
                          "bdlora never replaces a trained adapter unasked: choose another output_dir, or set "
                          "overwrite_output_dir: true to replace it")
    if cfg.resume is None:
        raise ConfigError(f"output_dir: {out} holds {held} of this same job; set resume: auto to continue it (a "
                          "finished job is not trained again), overwrite_output_dir: true to train it again from "
                          "the start, or choose another output_dir")


def _validate_saved(adapter_dir: Path, spec: BDLoraSpec, moe_layers: int = 0) -> None:
    """The saved folder must load with bdlora's strict reader, reproduce the training scale and hold both expert
    tensors' factors of every adapted MoE layer."""
    from bdlora.adapter import load_adapter

    ad = load_adapter(adapter_dir)
    cfg = ad.config
    if not cfg.is_bd or cfg.nblocks != spec.nblocks or cfg.r != spec.r:
        raise BDLoraError(f"{adapter_dir}: saved adapter is not the trained BD-LoRA (nblocks={cfg.nblocks}, "
                          f"r={cfg.r})")
    if not math.isclose(cfg.scale, spec.scale, rel_tol=1e-9):
        raise BDLoraError(f"{adapter_dir}: saved adapter scale {cfg.scale} != training scale {spec.scale}")
    if len(ad.experts) != 2 * moe_layers:
        raise BDLoraError(f"{adapter_dir}: saved adapter has {len(ad.experts)} expert tensors' factors, the model "
                          f"trained {2 * moe_layers}")


def write_model_card(folder: Path, spec: BDLoraSpec, cfg: TrainConfig, base: str, **facts) -> None:
    """README.md of the adapter folder: what the adapter is and the command that serves it (the base as the user
    named it; the adapter as its hub id when pushed, else this folder)."""
    from bdlora.hub import is_repo_id

    n = spec.nblocks
    tp = f" --tensor-parallel-size {n}" if n > 1 else ""
    rank_flag = next(v for v in (1, 8, 16, 32, 64, 128, 256, 320, 512) if v >= spec.r)
    hub_id = cfg.hub_model_id if getattr(cfg, "push_to_hub", False) else None
    name = (hub_id.split("/")[-1] if hub_id else Path(cfg.output_dir).name) or "adapter"
    base_repo = base.partition("@")[0]
    ev = facts.get("eval_metrics") or {}
    meta = ["---"] + ([f"base_model: {base_repo}"] if is_repo_id(base_repo) else []) + [
        "library_name: peft", "tags: [bdlora, bd-lora, lora, block-diagonal, peft]", "---"]
    data = cfg.train_file if cfg.train_file and is_repo_id(cfg.train_file.split(":")[0]) else \
        Path(str(cfg.train_file)).name
    lines = meta + [
        "", f"# BD-LoRA adapter for {base}", "",
        f"A Block-Diagonal LoRA (BD-LoRA) adapter trained with bdlora: {n} blocks, total rank {spec.r} "
        f"({spec.block_rank} per block), rsLoRA scale {spec.scale:.6g} (alpha {spec.lora_alpha:g} per block; saved as "
        f"PEFT `lora_alpha` {spec.peft_lora_alpha:g} with `use_rslora`). Served at tensor-parallel size {n}, every "
        f"GPU runs an independent rank-{spec.block_rank} adapter on its own weight shard with no LoRA communication.",
        "",
        f"- column-parallel modules (B block-diagonal): {', '.join(spec.column_modules) or '-'}",
        f"- row-parallel modules (A block-diagonal): {', '.join(spec.row_modules) or '-'}",
        f"- data: {data} ({cfg.data_format}), {facts.get('steps')} steps, lr {cfg.lr:g}, "
        f"batch {cfg.batch_size} x {cfg.grad_accum}",
    ]
    moe = bool(facts.get("moe_layers"))
    if moe:
        lines.append(f"- the fused experts of {facts['moe_layers']} MoE layers: gate_up_proj (B block-diagonal, gate "
                     "and up sliced as vLLM shards them) and down_proj (A block-diagonal), PEFT's `target_parameters`")
    if ev:
        lines.append(f"- held-out loss {ev['eval_loss']:.4f} (perplexity {ev['eval_ppl']:.3f})")
    if getattr(cfg, "quantized", False):
        what = (f"4-bit ({cfg.bnb_4bit_quant_type or 'nf4'}"
                f"{'' if cfg.bnb_4bit_use_double_quant is False else ', double quantization'})"
                if cfg.load_in_4bit else "8-bit (LLM.int8)")
        lines.append(f"- trained on a bitsandbytes {what} quantized base (QLoRA-style); the adapter weights are full "
                     "precision in the same format as any BD-LoRA adapter and load on the unquantized base (on a "
                     "k-bit base in PEFT: call `bdlora.quant.enable_bdlora_on_kbit()` first)")
    where = (f"vLLM downloads the adapter from the hub as `{hub_id}`." if hub_id else
             "Run it in this folder (`.` is the adapter).")
    lines += [
        "", "## Serve with vLLM", "",
        f"With vLLM and bdlora installed (bdlora's README: install). {where}", "", "```bash",
        f"vllm serve {base_repo} --enable-lora --enable-bdlora{tp} --max-lora-rank {rank_flag} \\",
        f"    --lora-modules {name}={hub_id or '.'}", "```", "",
        f"Requests name the adapter as the model: `\"model\": \"{name}\"`. The plugin also serves it at any "
        f"tensor-parallel size M with M | {n} or {n} | M. It loads in PEFT as it is "
        "(`PeftModel.from_pretrained(base, folder)`, peft >= 0.21); for engines without BD support, "
        f"`bdlora convert to-dense` gives an equivalent standard {'PEFT expert LoRA' if moe else 'LoRA'}.", "",
    ]
    (folder / "README.md").write_text("\n".join(lines))


def _plot_losses(history: list[dict], path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    ev = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    if not train and not ev:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if ev:
        ax.plot(*zip(*ev), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bdlora train", description="Fine-tune one BD-LoRA adapter (transformers "
                                "Trainer + PEFT).")
    p.add_argument("--config", help="YAML job file (keys: see --print-config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (YAML value), e.g. --set max_steps=10; repeatable")
    p.add_argument("--output-dir", default=None, metavar="DIR", help="output_dir of the job (same as --set "
                   "output_dir=DIR)")
    p.add_argument("--print-config", action="store_true", help="print every config key with its default and help")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.print_config:
        from .config import default_config_text

        print(default_config_text(), end="")
        return 0
    if not args.config:
        print("bdlora train: error: --config job.yaml is required (see --print-config)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = None
    try:
        overrides = dict(parse_override(s) for s in args.set)
        if args.output_dir is not None:
            overrides["output_dir"] = args.output_dir
        cfg = TrainConfig.from_yaml(args.config, overrides)
        run_training(cfg)
    except BDLoraError as e:  # ConfigError / DataError / TrainingError
        print(f"bdlora train: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a full disk or a read-only folder: the reason and what to do, not a traceback
        message = _write_failure(e, cfg.output_dir) if cfg is not None else None
        if message is None:
            raise
        print(f"bdlora train: error: {message}", file=sys.stderr)
        return 2
    return 0


def _write_failure(exc: BaseException, output_dir) -> Optional[str]:
    """What to tell the user when a write under ``output_dir`` failed for lack of space or permission (the adapter
    is written atomically: no half-written folder is left); None for other errors."""
    from bdlora.adapter import disk_write_error

    reason = disk_write_error(exc, output_dir)
    if reason is None:
        return None
    ckpts = list_checkpoints(Path(output_dir)) if Path(output_dir).is_dir() else []
    then = (f"make room, then run the same command with --set resume=auto: it continues from {ckpts[-1].name}"
            if ckpts else "make room (or choose another output_dir) and train again: no checkpoint was written "
            "(save_every: 0)")
    return f"{reason}; {then}"


__all__ = ["TrainResult", "TrainingError", "adapt_experts", "bd_experts", "build_peft_model", "claim_output_dir",
           "kbit_quantization_config", "list_checkpoints", "load_base_model", "load_kbit_base_model", "main",
           "resolve_model_path", "resume_checkpoint", "run_training", "write_model_card"]
