"""Fine-tune one BD-LoRA adapter with PEFT on a causal LM.

    python -m bdlora.train --config job.yaml [--set key=value ...]
    accelerate launch --multi_gpu --num_processes K -m bdlora.train --config job.yaml   (K GPUs, or K CPU
        processes over gloo on a machine without GPUs; `torchrun --nproc_per_node K -m bdlora.train` is the same)
    bdlora train --config job.yaml

Note: ``accelerate launch --cpu --num_processes K`` starts ONE process unless an MPI hostfile is given (accelerate's
simple launcher); for data parallelism over local CPU processes use ``--multi_gpu`` (torchrun) as above; the
trainer then uses gloo because no GPU is present (or ``ACCELERATE_USE_CPU=1`` forces CPU).

The adapter is PEFT's ``use_bdlora`` LoRA built from :meth:`bdlora.BDLoraSpec.to_peft_config` (rsLoRA with
``lora_alpha * sqrt(N)``, so each of the N blocks is an independent rank ``r/N`` rsLoRA adapter of one weight shard;
``tests/test_train_equivalence.py`` checks exactly that). ``accelerate`` provides the device, data parallelism
(DDP; gloo on CPU) and gradient accumulation. The data order is a deterministic function of the seed and the step
(:mod:`bdlora.train.data`), so a checkpoint (adapter weights, optimizer, scheduler, per-process RNG, step) resumes
bit-exactly.

Output folder::

    output_dir/
      adapter/               final PEFT LoRA folder (save_pretrained), validated with bdlora.load_adapter
      checkpoints/step-N/    resumable checkpoints (written atomically); also PEFT folders
      metrics.jsonl          one JSON object per log/eval event
      tensorboard/           the same scalars, when tensorboard is installed
      train_config.yaml      the resolved job
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from bdlora.adapter import atomic_output_dir
from bdlora.spec import COLUMN, ROW, BDLoraError, BDLoraSpec

from .config import ConfigError, TrainConfig
from .data import IGNORE_INDEX, DataStream, Example, collate, load_datasets

log = logging.getLogger("bdlora.train")

STATE_NAME = "trainer_state.pt"
STATE_JSON = "trainer_state.json"
_CKPT_RE = re.compile(r"^step-(\d+)$")


# ---------------------------------------------------------------------------------------------------- model
def resolve_model_path(name: str) -> Path:
    """A model folder for ``name``: a path, or the shortcuts ``smollm2`` / ``tiny-random`` (built offline)."""
    from bdlora.models import DEFAULT_CACHE, build_random_llama, smollm2_path

    if name == "smollm2":
        return smollm2_path()
    if name == "tiny-random":
        path = DEFAULT_CACHE / "tiny-random-llama"
        if not (path / "config.json").is_file():
            build_random_llama(path, init_std=0.05)
        return path
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"model: {name!r} is neither a model folder with config.json nor one of the shortcuts "
                          "'smollm2', 'tiny-random' (no hub downloads)")
    return path


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _init_block_a_like_lora(peft_model) -> None:
    """Re-initialize block-diagonal A factors as N independent standard LoRA A's (kaiming-uniform, a=sqrt(5)).

    PEFT's BlockDiagonalLinear draws its packed (r, d_in/N) weight with a=0; a standard LoRA A of one shard,
    (r/N, d_in/N), uses a=sqrt(5). Both have fan-in d_in/N, so one call on the packed weight gives each block the
    distribution of an independent shard LoRA.
    """
    from peft.tuners.lora.variants import BlockDiagonalLinear

    for module in peft_model.modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict):
            continue
        for sub in lora_a.values():
            if isinstance(sub, BlockDiagonalLinear):
                torch.nn.init.kaiming_uniform_(sub.weight, a=math.sqrt(5))


def check_bd_structure(peft_model, spec: BDLoraSpec, expected: dict[str, str]) -> None:
    """After get_peft_model: exactly the expected modules carry LoRA, with the right factor block-diagonal."""
    from peft.tuners.lora.variants import BlockDiagonalLinear

    seen = {}
    for name, module in peft_model.named_modules():
        if isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict) and "default" in module.lora_A:
            a, b = module.lora_A["default"], module.lora_B["default"]
            layout = ROW if isinstance(a, BlockDiagonalLinear) else COLUMN if isinstance(b, BlockDiagonalLinear) else None
            key = name.removeprefix("base_model.model.")
            seen[key] = layout
    want = dict(expected)
    if spec.nblocks == 1:  # one block: PEFT may or may not wrap a 1-block matrix; layout is moot
        seen = {k: want.get(k) for k in seen}
    if seen != want:
        extra = sorted(set(seen) - set(want))
        missing = sorted(set(want) - set(seen))
        wrong = sorted(k for k in set(seen) & set(want) if seen[k] != want[k])
        raise BDLoraError(f"PEFT built a different adapter than the spec: unexpected {extra[:5]}, missing "
                          f"{missing[:5]}, wrong block-diagonal factor {wrong[:5]}")


def build_peft_model(cfg: TrainConfig, model_dir: Path):
    """(peft_model, spec). Validates names and shapes exactly before PEFT touches the model."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    spec = cfg.spec(getattr(base.config, "model_type", None))
    expected = spec.matching_modules(base)
    base.config.use_cache = False
    model = get_peft_model(base, spec.to_peft_config(task_type="CAUSAL_LM"))
    check_bd_structure(model, spec, expected)
    if cfg.a_init == "lora":
        _init_block_a_like_lora(model)
    return model, spec


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def params_digest(model) -> str:
    h = hashlib.sha256()
    for n, p in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
        h.update(n.encode())
        h.update(p.detach().cpu().contiguous().float().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------- helpers
def _rng_state() -> dict:
    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(st: dict) -> None:
    import numpy as np

    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    d = Path(output_dir) / "checkpoints"
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _CKPT_RE.match(p.name)) and (p / STATE_NAME).is_file()]
    return [p for _, p in sorted(found)]


def _make_scheduler(cfg: TrainConfig, optimizer, total_steps: int):
    from transformers import get_scheduler

    name = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}[cfg.scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_for(total_steps),
                         num_training_steps=total_steps)


class _MetricsLog:
    """metrics.jsonl (+ tensorboard when installed) on the main process."""

    def __init__(self, output_dir: Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.tb = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / "metrics.jsonl"
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(output_dir / "tensorboard"))
            except Exception:  # tensorboard not installed (or broken): JSONL only
                self.tb = None

    def write(self, step: int, **values) -> None:
        if not self.enabled:
            return
        rec = {"step": step, "time": round(time.time(), 3), **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)

    def close(self):
        if self.tb is not None:
            self.tb.close()


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


def _new_accelerator(cfg: TrainConfig):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        # Several jobs in one process (tests, notebooks): start from a clean accelerate state so the mixed
        # precision and accumulation settings of an earlier job do not leak in.
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    # accelerate only goes data parallel on CPUs (gloo) when told cpu=True; without an accelerator there is no other
    # choice, and ACCELERATE_USE_CPU (set by `accelerate launch --cpu`) asks for it explicitly.
    cpu = (os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
           or not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
                   or torch.backends.mps.is_available()))
    return Accelerator(cpu=cpu, gradient_accumulation_steps=cfg.grad_accum,
                       mixed_precision="bf16" if cfg.precision == "bf16" else "no")


# ---------------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, examples: list[Example], pad_id: int, batch_size: int, accelerator) -> dict:
    """Token-weighted loss on the response tokens over ``examples`` (sharded over processes), and perplexity."""
    was_training = model.training
    model.eval()
    mine = examples[accelerator.process_index::accelerator.num_processes]
    nll = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    count = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for i in range(0, len(mine), batch_size):
        batch = {k: v.to(accelerator.device) for k, v in collate(mine[i:i + batch_size], pad_id).items()}
        with accelerator.autocast():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                 labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        nll += loss.double()
        count += (labels != IGNORE_INDEX).sum().double()
    nll = accelerator.reduce(nll, "sum")
    count = accelerator.reduce(count, "sum")
    if was_training:
        model.train()
    loss = (nll / count.clamp(min=1)).item()
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": int(count.item())}


# ---------------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: Path, *, model, optimizer, scheduler, step: int, cfg: TrainConfig, accelerator,
                    metrics: dict) -> None:
    """Atomic checkpoint: PEFT folder + trainer_state.pt (trainable weights, optimizer, scheduler, RNG of every
    process, step, config). All processes must call it (the RNG states are gathered)."""
    from accelerate.utils import gather_object

    rngs = gather_object([_rng_state()])
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        with atomic_output_dir(path) as tmp:
            unwrapped.save_pretrained(str(tmp))
            torch.save({
                "step": step,
                "trainable": trainable_state(unwrapped),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": rngs,
                "world_size": accelerator.num_processes,
                "config": cfg.to_dict(),
            }, tmp / STATE_NAME)
            with open(tmp / STATE_JSON, "w") as f:
                json.dump({"step": step, "world_size": accelerator.num_processes, "metrics": metrics,
                           "config": cfg.to_dict()}, f, indent=2)
        keep = list_checkpoints(cfg.output_dir)
        for old in keep[:-cfg.save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_checkpoint(path: Path, *, model, optimizer, scheduler, cfg: TrainConfig, accelerator) -> int:
    """Restores a checkpoint written by :func:`save_checkpoint`; returns its step."""
    state = torch.load(path / STATE_NAME, map_location="cpu", weights_only=False)
    old = state["config"]
    diffs = [k for k in TrainConfig.RESUME_INVARIANT if old.get(k) != getattr(cfg, k)]
    if diffs:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {getattr(cfg, k)!r}" for k in diffs)
        raise ConfigError(f"cannot resume from {path}: the job changed ({detail}); these keys must match the "
                          "checkpoint for an exact resume (start a new output_dir instead)")
    if state["world_size"] != accelerator.num_processes:
        raise ConfigError(f"cannot resume from {path}: it was written by {state['world_size']} process(es), this "
                          f"run has {accelerator.num_processes}; the data order depends on the process count")
    unwrapped = accelerator.unwrap_model(model)
    params = dict(unwrapped.named_parameters())
    with torch.no_grad():
        for name, value in state["trainable"].items():
            if name not in params:
                raise ConfigError(f"checkpoint {path} has parameter {name} the model does not have")
            params[name].copy_(value.to(params[name].device))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"][accelerator.process_index])
    return int(state["step"])


def _resume_path(cfg: TrainConfig) -> Optional[Path]:
    if cfg.resume in (None, "", False):
        return None
    if cfg.resume == "auto":
        found = list_checkpoints(cfg.output_dir)
        return found[-1] if found else None
    p = Path(cfg.resume)
    if not (p / STATE_NAME).is_file():
        raise ConfigError(f"resume: {p} is not a checkpoint folder (no {STATE_NAME}); use 'auto' or a "
                          f"{Path(cfg.output_dir) / 'checkpoints' / 'step-N'} folder")
    return p


# ---------------------------------------------------------------------------------------------------- training
def run_training(cfg: TrainConfig, *, stop_after_steps: Optional[int] = None, validate_adapter: bool = True
                 ) -> TrainResult:
    """Runs one job. ``stop_after_steps`` interrupts the run after that step (checkpointing it first), as a crash
    would after a checkpoint; the job's schedule still spans all its steps. Returns a :class:`TrainResult`."""
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    t0 = time.time()
    cfg.validate()
    accelerator = _new_accelerator(cfg)
    main = accelerator.is_main_process
    out = Path(cfg.output_dir)

    with accelerator.main_process_first():
        model_dir = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(model_dir)
    pad_id = tokenizer.pad_token_id
    train_ex, eval_ex = load_datasets(cfg, tokenizer)

    set_seed(cfg.seed)  # same adapter init on every process
    model, spec = build_peft_model(cfg, model_dir)
    model.train()
    world, rank = accelerator.num_processes, accelerator.process_index
    per_step = cfg.batch_size * cfg.grad_accum * world
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * len(train_ex) / per_step))

    model = accelerator.prepare(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = _make_scheduler(cfg, optimizer, total_steps)
    set_seed(cfg.seed + 7919 * rank)  # dropout streams differ per process

    step = 0
    ckpt = _resume_path(cfg)
    if ckpt is not None:
        step = load_checkpoint(ckpt, model=model, optimizer=optimizer, scheduler=scheduler, cfg=cfg,
                               accelerator=accelerator)
    metrics = _MetricsLog(out, main, cfg.tensorboard)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        import yaml

        (out / "train_config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        n_train = sum(p.numel() for p in params)
        msg = (f"bdlora train: {cfg.model} | N={spec.nblocks} r={spec.r} (r/N={spec.block_rank}) "
               f"scale={spec.scale:.4g} | {len(spec.column_modules)} column + {len(spec.row_modules)} row module "
               f"names, {n_train:,} trainable params | {len(train_ex)} train / {len(eval_ex)} eval examples | "
               f"{total_steps} steps x {per_step} examples ({world} process(es)) on {accelerator.device}")
        if ckpt is not None:
            msg += f" | resumed from {ckpt} at step {step}"
        print(msg, flush=True)
        metrics.write(step, event="start", resumed_from=str(ckpt) if ckpt else None, total_steps=total_steps,
                      world_size=world)

    stream = DataStream(len(train_ex), cfg.seed)
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    samples_file = out / f"samples.rank{rank}.jsonl" if cfg.record_samples else None
    if samples_file is not None:
        out.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
               disable=not (main and cfg.progress))
    last_loss, last_eval = None, {}
    stop_at = min(total_steps, stop_after_steps) if stop_after_steps is not None else total_steps
    try:
        while step < stop_at:
            losses = []
            for micro in range(cfg.grad_accum):
                idx = stream.micro_batch(step, micro, cfg.batch_size, cfg.grad_accum, world, rank)
                exs = [train_ex[i] for i in idx]
                if samples_file is not None:
                    with open(samples_file, "a") as f:
                        f.write(json.dumps({"step": step, "micro": micro, "rank": rank,
                                            "records": [e.index for e in exs]}) + "\n")
                batch = {k: v.to(accelerator.device) for k, v in collate(exs, pad_id).items()}
                with accelerator.accumulate(model):
                    with accelerator.autocast():
                        loss = model(**batch).loss
                    accelerator.backward(loss)
                    losses.append(loss.detach().float())
            if not accelerator.sync_gradients:  # cannot happen: every step has exactly grad_accum micro-batches
                raise RuntimeError("gradient accumulation out of step")
            grad_norm = None
            if cfg.max_grad_norm > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % cfg.log_every == 0 or step == total_steps:
                mean = accelerator.reduce(torch.stack(losses).mean().to(accelerator.device), "mean")
                last_loss = float(mean)
                lr = scheduler.get_last_lr()[0]
                bar.set_postfix(loss=f"{last_loss:.4f}", lr=f"{lr:.2e}")
                metrics.write(step, train_loss=last_loss, lr=lr,
                              **({"grad_norm": grad_norm} if grad_norm is not None else {}))
            bar.update(1)
            if eval_ex and cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
                last_eval = evaluate(model, eval_ex, pad_id, eval_bs, accelerator)
                metrics.write(step, **last_eval)
                bar.write(f"step {step}: eval_loss {last_eval['eval_loss']:.4f} ppl {last_eval['eval_ppl']:.3f}")
            interrupted = stop_after_steps is not None and step == stop_at < total_steps
            periodic = cfg.save_every and (step % cfg.save_every == 0 or step == total_steps)
            if interrupted or periodic:  # the final one makes re-running a finished job (resume: auto) a no-op
                save_checkpoint(out / "checkpoints" / f"step-{step:07d}", model=model, optimizer=optimizer,
                                scheduler=scheduler, step=step, cfg=cfg, accelerator=accelerator,
                                metrics={"train_loss": last_loss, **last_eval})
    finally:
        bar.close()

    unwrapped = accelerator.unwrap_model(model)
    adapter_dir = None
    if step >= total_steps:
        if eval_ex:
            last_eval = evaluate(model, eval_ex, pad_id, eval_bs, accelerator)
            metrics.write(step, **last_eval)
        adapter_dir = out / "adapter"
        if main:
            with atomic_output_dir(adapter_dir) as tmp:
                unwrapped.save_pretrained(str(tmp))
            if validate_adapter:
                _validate_saved(adapter_dir, spec)
        accelerator.wait_for_everyone()
    if samples_file is not None:
        with open(samples_file, "a") as f:
            f.write(json.dumps({"final_step": step, "rank": rank, "params_sha256": params_digest(unwrapped)}) + "\n")
    wall = time.time() - t0
    if main:
        metrics.write(step, event="end", wall_s=round(wall, 2), **({"adapter": str(adapter_dir)} if adapter_dir else {}))
        if adapter_dir is not None:
            ev = (f"; eval loss {last_eval['eval_loss']:.4f} (ppl {last_eval['eval_ppl']:.3f})" if last_eval else "")
            print(f"bdlora train: done in {wall:.1f}s, step {step}/{total_steps}, train loss "
                  f"{last_loss if last_loss is None else round(last_loss, 4)}{ev}; adapter saved to {adapter_dir}",
                  flush=True)
        else:
            print(f"bdlora train: stopped at step {step}/{total_steps} after {wall:.1f}s (checkpoint in "
                  f"{out / 'checkpoints'})", flush=True)
    metrics.close()
    unwrapped.eval()
    return TrainResult(adapter_dir=adapter_dir, step=step, total_steps=total_steps, train_loss=last_loss,
                       eval=last_eval, wall_s=wall, model=unwrapped, tokenizer=tokenizer, spec=spec)


def _validate_saved(adapter_dir: Path, spec: BDLoraSpec) -> None:
    """The saved folder must load with bdlora's strict reader and reproduce the training scale."""
    from bdlora.adapter import load_adapter

    ad = load_adapter(adapter_dir)
    cfg = ad.config
    if not cfg.is_bd or cfg.nblocks != spec.nblocks or cfg.r != spec.r:
        raise BDLoraError(f"{adapter_dir}: saved adapter is not the trained BD-LoRA (nblocks={cfg.nblocks}, "
                          f"r={cfg.r})")
    if not math.isclose(cfg.scale, spec.scale, rel_tol=1e-9):
        raise BDLoraError(f"{adapter_dir}: saved adapter scale {cfg.scale} != training scale {spec.scale}")


# ---------------------------------------------------------------------------------------------------- CLI
def _parse_override(item: str) -> tuple[str, Any]:
    import yaml

    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    k, v = item.split("=", 1)
    return k.strip(), yaml.safe_load(v)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bdlora train", description="Fine-tune one BD-LoRA adapter (PEFT + accelerate).")
    p.add_argument("--config", help="YAML job file (keys: see --print-config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (YAML value), e.g. --set max_steps=10; repeatable")
    p.add_argument("--print-config", action="store_true", help="print every config key with its default and exit")
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
    try:
        overrides = dict(_parse_override(s) for s in args.set)
        cfg = TrainConfig.from_yaml(args.config, overrides)
        run_training(cfg)
    except BDLoraError as e:  # ConfigError / DataError are BDLoraErrors
        print(f"bdlora train: error: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = ["TrainResult", "build_peft_model", "evaluate", "list_checkpoints", "load_checkpoint", "main",
           "resolve_model_path", "run_training", "save_checkpoint"]
