"""The multi-LoRA fine-tuning engine: many BD-LoRA jobs over ONE frozen base model (BatchLoRA).

A *round* advances every active job by one optimizer step:

1. admission: queued jobs enter while ``max_active_jobs`` and the memory model allow (a job that cannot fit even
   alone is refused with a message);
2. every active job draws its step's samples (``batch_size * grad_accum``, each sample once per epoch);
3. all those samples are packed into micro-batches under the token budget (first-fit decreasing, one row segment
   per job and micro-batch);
4. each micro-batch runs one forward/backward through the shared base; each job's loss is the sum of its
   response-token cross-entropies divided by the number of response tokens of its whole step, so the gradient does
   not depend on how the step was split into micro-batches (grad accumulation is exact);
5. per job: grad-norm clipping, AdamW step, LR schedule step; evaluation and early exit (ALTO) when due;
   finished / exited jobs write their PEFT BD-LoRA folder and free their slot for the queue.

Multi-process: with ``WORLD_SIZE > 1`` (``accelerate launch`` / ``torchrun``) and ``pipeline_stages: 1`` the
micro-batches of a round are spread over the ranks (data parallel) and each job's gradients all-reduced as one
flat buffer (one all-reduce per job and step, plus one for the losses); with
``pipeline_stages == WORLD_SIZE`` the run goes to :mod:`bdlora.train.engine.pipeline` (LoRAPP).
"""

from __future__ import annotations

import csv
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from bdlora.adapter import save_adapter
from bdlora.spec import BDLoraError
from .config import ConfigError, JobConfig, RunConfig
from .data import DatasetSplit, EpochSampler, Sample
from .early_exit import DIVERGING, OVERFITTING, UNDERPERFORMING, EarlyExit, select_after_warmup, warmup_steps
from .reporting import RunReporter
from .memory import JobFootprint, MemoryModel, device_budget_bytes
from .multilora import BatchContext, JobAdapter, dropout_rng, inject_multilora, round_seed
from .packing import MicroBatch, build_microbatch, plan_microbatches

CHECKPOINT = "engine_state.pt"
# a job's run state in checkpoints (the engine's and the pipeline's run_state.pt); its tensors: job_tensor_state
JOB_RUN_FIELDS = ("status", "reason", "step", "tokens", "time_s", "history", "warm_val", "warm_done", "adapter_path",
                  "result")
GPU_PAD_MULTIPLE = 64  # pad_multiple when the run file leaves it out and the engine runs on a GPU (RunConfig)
RESULTS_CSV = "results.csv"
RESULT_FIELDS = ["job", "status", "stop_reason", "r", "lora_alpha", "nblocks", "lr", "batch_size", "steps",
                 "total_steps", "final_train_loss", "final_eval_loss", "best_eval_loss", "best_step", "tokens",
                 "time_s", "adapter"]


class EngineError(BDLoraError):
    """A run that cannot go on (jobs the memory budget can never admit); the message says what to change."""


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _bucket_groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (dtype, device), in first-seen order: the flat buffers of the data-parallel
    gradient all-reduce (one per job and step when its factors share a dtype and device, as they do)."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


def load_base(path: str | os.PathLike, precision: str = "fp32", device="cpu", attn_implementation=None,
              stage: Optional[tuple[int, int]] = None):
    """The frozen base and its tokenizer, loaded like ``bdlora train`` does (:func:`bdlora.models.load_causal_lm`):
    straight in ``precision``'s dtype (bf16: no fp32 copy), from a folder ``path``.

    ``stage=(s, P)``: only pipeline stage s of P (:func:`bdlora.train.engine.pipeline.load_stage_model`): the model
    is built on the meta device and only that stage's decoder layers (+ the embeddings on the first stage, the final
    norm and LM head on the last) are read from the safetensors files, straight onto ``device``: a stage never holds
    the whole base, on the CPU or on its GPU."""
    from transformers import AutoTokenizer

    from bdlora.models import load_causal_lm, torch_dtype_of

    device = torch.device(device)
    if stage is not None:
        from .pipeline import load_stage_model

        model = load_stage_model(path, torch_dtype_of(precision, device.type), device, attn_implementation, *stage)
    else:
        model = load_causal_lm(path, torch_dtype_of(precision, device.type), attn_implementation)
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.to(device).eval()  # eval(): no base-model dropout, like a frozen base in PEFT
    return model, tok


def load_job_data(cfg: JobConfig, tok, source: str = "run file", split_seed: Optional[int] = None) -> DatasetSplit:
    """The job's train/validation samples through ``bdlora train``'s data pipeline
    (:func:`bdlora.train.data.load_datasets`: every source and format, the seeded eval_fraction split, the
    tokenized cache), as packing samples. ``split_seed`` (default: the job's seed) draws the eval_fraction split:
    the engine passes the run's seed, so the jobs of a sweep are validated on the same examples. A data problem
    raises DataError naming the job and its files."""
    import dataclasses

    from bdlora.train.data import IGNORE_INDEX, DataError, load_datasets

    if split_seed is not None and split_seed != cfg.seed:
        cfg = dataclasses.replace(cfg, seed=split_seed)
    try:
        train, ev = load_datasets(cfg, tok)
    except DataError as e:
        files = f"train_file={cfg.train_file}" + (f", eval_file={cfg.eval_file}" if cfg.eval_file else "")
        raise DataError(f"{source}: job {cfg.name!r} ({files}): {e}") from None

    def samples(examples):
        out = []
        for ex in examples:
            s = Sample(list(ex.input_ids), [lab != IGNORE_INDEX for lab in ex.labels])
            if len(s) >= 2 and s.n_targets > 0:  # a target needs a token before it
                out.append(s)
        return out

    split = DatasetSplit(samples(train), samples(ev))
    if not split.train:
        raise DataError(f"{source}: job {cfg.name!r}: train_file {cfg.train_file} has no usable training examples "
                        f"(max_length={cfg.max_length} may be too small)")
    return split


def decoder_and_head(model):
    return getattr(model, model.base_model_prefix), model.get_output_embeddings()


def job_losses(model, mb: MicroBatch, ctx: BatchContext) -> dict[int, torch.Tensor]:
    """Forward one packed micro-batch; {job: summed response-token cross-entropy}."""
    decoder, head = decoder_and_head(model)
    ctx.segments = mb.segments
    try:
        out = decoder(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)
    finally:
        ctx.segments = []
    h = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])  # flattened rows: segment order
    losses = {}
    for job, (pos, lab) in mb.targets.items():
        if lab.numel() == 0:
            continue
        logits = head(h.index_select(0, pos)).float()
        losses[job] = F.cross_entropy(logits, lab, reduction="sum")
    return losses


@dataclass
class Job:
    id: int
    cfg: JobConfig
    data: DatasetSplit
    total_steps: int
    status: str = "queued"  # queued | active | parked | done
    reason: Optional[str] = None
    step: int = 0
    tokens: int = 0
    time_s: float = 0.0
    adapter: Optional[JobAdapter] = None
    opt: Optional[torch.optim.Optimizer] = None
    sched: Optional[object] = None
    sampler: Optional[EpochSampler] = None
    detector: Optional[EarlyExit] = None
    history: dict = field(default_factory=lambda: {"train": [], "val": [], "ema": []})
    best_state: Optional[dict] = None
    warm_steps: Optional[int] = None
    warm_val: Optional[float] = None
    warm_done: bool = False
    adapter_path: Optional[str] = None
    result: Optional[dict] = None
    model_type: str = "llama"
    _footprint: Optional[tuple] = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.cfg.name

    def footprint(self, targets) -> JobFootprint:
        # memoized: the memory model asks every round (GPU) and the answer depends only on the config and targets
        if self._footprint is not None and self._footprint[0] is targets:
            return self._footprint[1]
        spec = self.cfg.spec(self.model_type)
        params, rank_sum, dropped = 0, 0, []
        for name, (layout, d_in, d_out) in targets.items():
            if name.rsplit(".", 1)[-1] not in spec.target_modules:
                continue
            r, n = spec.r, spec.nblocks
            params += r * d_in + d_out * (r // n) if layout == "column" else r * (d_in // n) + d_out * r
            rank_sum += r
            if spec.lora_dropout > 0:  # its LoRA-dropout keep-mask on this module's input (memory model)
                dropped.append((name, d_in))
        fp = JobFootprint(self.name, params, rank_sum, tuple(dropped))
        self._footprint = (targets, fp)
        return fp


class Engine:
    def __init__(self, run: RunConfig, model=None, tokenizer=None, log=print):
        kbit = [j for j in run.jobs if getattr(j, "load_in_4bit", False) or getattr(j, "load_in_8bit", False)]
        if kbit:  # MultiLoraLinear reads the base's nn.Linear weights: a bitsandbytes base would not be BD-trained
            raise ConfigError(f"{run_source(run)}: job {kbit[0].name!r}: load_in_4bit/load_in_8bit: the multi-LoRA "
                              "engine has no k-bit base (its LoRA layers run over plain nn.Linear weights); train "
                              "on a quantized base with `bdlora train`, one job at a time")
        self.run_cfg = run
        self.out = Path(run.output_dir)
        dist = _dist()
        self.rank = dist.get_rank() if dist else 0
        self.world = dist.get_world_size() if dist else 1
        self.log = log if self.rank == 0 else (lambda *a, **k: None)
        if run.device == "auto":
            if torch.cuda.is_available():
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            else:
                self.device = torch.device("cpu")
        else:
            self.device = torch.device(run.device)
        from bdlora.models import ModelNotFound, resolve_model

        # the folder to load and the name adapters record as their base (a hub id where there is one)
        try:
            folder, self.base_id = resolve_model(run.model)
        except ModelNotFound as e:
            raise ConfigError(f"{run_source(run)}: model: {e}") from None
        self.base_path = str(folder)
        self.pad_multiple = run.pad_multiple or (GPU_PAD_MULTIPLE if self.device.type == "cuda" else 1)
        if model is None:  # a pipeline stage (StageEngine sets pipeline_stage = (s, P)) loads only its layers
            model, tokenizer = load_base(folder, run.precision, self.device, run.attn_implementation,
                                         stage=getattr(self, "pipeline_stage", None))
        self.model, self.tok = model, tokenizer
        model_type = getattr(model.config, "model_type", "llama")
        cols, rows = set(), set()
        for j in run.jobs:
            s = job_spec(j, model_type, model, run_source(run))
            cols |= set(s.column_modules)
            rows |= set(s.row_modules)
        self.ctx = BatchContext(backend=run.lora_backend)
        self.registry: dict[int, JobAdapter] = {}
        self.targets = inject_multilora(model, cols, rows, self.ctx, self.registry)
        self.model_type = model_type
        self._splits: dict[tuple, DatasetSplit] = {}
        self._len_cache: dict[tuple, list[int]] = {}
        self.jobs = [Job(i, j, self._split(j), 0, model_type=model_type) for i, j in enumerate(run.jobs)]
        for job in self.jobs:
            job.total_steps = job.cfg.total_steps(len(job.data.train))
            if run.early_exit.enabled:
                job.warm_steps = warmup_steps(job.total_steps, run.early_exit.warmup_ratio)
        n_base = sum(p.numel() for p in model.parameters())
        self.memory = MemoryModel.analytic(model.config, n_base, next(model.parameters()).element_size())
        self.mem_budget = device_budget_bytes(self.device, run.memory_budget_gb)
        self.round = 0
        self.pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
        self.group_sizes: dict[str, int] = {}
        for j in self.jobs:
            self.group_sizes[j.cfg.group] = self.group_sizes.get(j.cfg.group, 0) + 1
        self.round_log: list[dict] = []

    # -- data ------------------------------------------------------------------------------------------
    def _split(self, j: JobConfig) -> DatasetSplit:
        key = j.data_key()  # jobs with the same data settings share one tokenized split
        if key not in self._splits:
            self._splits[key] = load_job_data(j, self.tok, run_source(self.run_cfg), split_seed=self.run_cfg.seed)
        return self._splits[key]

    def _lengths(self, job_id: int, split: str = "train") -> list[int]:
        # memoized per dataset split: packing looks the lengths up once per sample of a round, and rebuilding the
        # list each time cost O(samples drawn x dataset size) Python work per round
        data = self.jobs[job_id].data
        key = (id(data), split)
        if key not in self._len_cache:
            self._len_cache[key] = [len(s) for s in getattr(data, split)]
        return self._len_cache[key]

    # -- job lifecycle ------------------------------------------------------------------------------
    def _build(self, job: Job) -> None:
        from transformers import get_scheduler

        cfg = job.cfg
        spec = cfg.spec(self.model_type)
        targets = {n: t for n, t in self.targets.items() if n.rsplit(".", 1)[-1] in spec.target_modules}
        job.adapter = JobAdapter(spec, targets, seed=cfg.seed, device=self.device, a_init=cfg.a_init)
        job.opt = torch.optim.AdamW(job.adapter.parameters(), lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                    eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        job.sched = get_scheduler(cfg.scheduler, job.opt, num_warmup_steps=cfg.warmup_for(job.total_steps),
                                  num_training_steps=job.total_steps)
        job.sampler = EpochSampler(len(job.data.train), cfg.step_samples, seed=cfg.seed)
        ee = self.run_cfg.early_exit
        job.detector = EarlyExit(ee.window, ee.patience, ee.tau_slope, ee.tau_gap, ee.ema_alpha,
                                 divergence=ee.enabled, overfitting=ee.enabled)

    def _activate(self, job: Job) -> None:
        if job.adapter is None:
            self._build(job)
        elif job.adapter.a[next(iter(job.adapter.a))].device != self.device:
            job.adapter.to(self.device)
            _optimizer_to(job.opt, self.device)
        job.status = "active"
        self.registry[job.id] = job.adapter

    def _park(self, job: Job) -> None:
        job.status = "parked"
        self.registry.pop(job.id, None)
        if self.device.type == "cuda":  # free the slot's GPU memory while the group finishes warm-up
            job.adapter.to("cpu")
            _optimizer_to(job.opt, "cpu")

    def active_jobs(self) -> list[Job]:
        return [j for j in self.jobs if j.status == "active"]

    def reset_peak_memory(self) -> None:
        """Start measuring this device's peak memory anew (GPU only)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def observe_memory(self, jobs: list[Job]) -> Optional[int]:
        """Give the memory model the peak since :meth:`reset_peak_memory` for ``jobs`` at the token budget, and refit
        it every 5 points when ``memory_model`` is auto (how admission learns from measured peaks, as mLoRA/ALTO
        do). GPU only: returns the peak in bytes, None on CPU."""
        if self.device.type != "cuda" or not jobs:
            return None
        peak = torch.cuda.max_memory_allocated(self.device)
        self.memory.observe(self.run_cfg.token_budget, [j.footprint(self.targets) for j in jobs], peak)
        if self.run_cfg.memory_model == "auto" and len(self.memory.points) % 5 == 0:
            self.memory.fit()
        return peak

    def _fits(self, jobs: list[Job]) -> tuple[bool, float]:
        pred = self.memory.predict(self.run_cfg.token_budget, [j.footprint(self.targets) for j in jobs])
        return (self.mem_budget is None or pred <= self.mem_budget), pred

    def admit(self) -> None:
        run = self.run_cfg
        # survivors of a warm-up selection first, then the queue by priority (file order within a priority)
        cands = [j for j in self.jobs if j.status == "parked" and j.warm_done]
        cands += sorted((j for j in self.jobs if j.status == "queued"), key=lambda j: (-j.cfg.priority, j.id))
        for job in cands:
            active = self.active_jobs()
            if len(active) >= run.max_active_jobs:
                break
            ok_alone, pred_alone = self._fits([job])
            if not ok_alone:
                msg = (f"refused: needs ~{pred_alone / 2**30:.2f} GiB alone (memory model) but the budget is "
                       f"{self.mem_budget / 2**30:.2f} GiB; lower its r, max_length or the token_budget")
                self.log(f"[engine] job {job.name}: {msg}")
                self._finish(job, msg, write=False)
                continue
            ok, pred = self._fits(active + [job])
            if not ok:
                break  # wait for a slot; FCFS within priority
            self._activate(job)

    # -- training ---------------------------------------------------------------------------------------
    def _microbatches(self, requests, split="train") -> list[MicroBatch]:
        bins = plan_microbatches(requests, lambda j: self._lengths(j, split), self.run_cfg.token_budget,
                                 self.pad_multiple)
        return [build_microbatch(b, lambda j: getattr(self.jobs[j].data, split), self.pad_id,
                                 self.pad_multiple) for b in bins]

    def train_round(self) -> dict:
        jobs = self.active_jobs()
        requests = [(j.id, j.sampler.next_batch()) for j in jobs]
        mbs = self._microbatches(requests)
        step_targets = {j.id: 0 for j in jobs}
        step_tokens = {j.id: 0 for j in jobs}
        for mb in mbs:
            for job_id, s, e in mb.segments:
                step_targets[job_id] += mb.n_targets(job_id)
        for job_id, idxs in requests:
            step_tokens[job_id] = sum(len(self.jobs[job_id].data.train[i]) for i in idxs)
        loss_sums = {j.id: torch.zeros((), dtype=torch.float64, device=self.device) for j in jobs}
        self.reset_peak_memory()
        if self.model.training:  # model.train(False) walks every module: only when someone switched it on
            self.model.train(False)
        # LoRA dropout: each micro-batch's masks from a seed of (run seed, the dropout jobs' seeds and steps, its
        # index), so a run is reproducible and resumes exactly
        drop_key = [(j.cfg.seed, j.step) for j in jobs if j.cfg.lora_dropout > 0]
        for i, mb in enumerate(mbs):
            if i % self.world != self.rank:
                continue
            mb = mb.to(self.device)
            seed = round_seed("lora-dropout", self.run_cfg.seed, drop_key, i) if drop_key else None
            with dropout_rng(seed, self.device):
                losses = job_losses(self.model, mb, self.ctx)
            total = sum(l / max(step_targets[j], 1) for j, l in losses.items())
            if torch.is_tensor(total) and total.requires_grad:
                total.backward()
            for j, l in losses.items():
                loss_sums[j] += l.detach().double()
        dist = _dist()
        if dist is not None and self.world > 1:
            # bucketed: one flat all-reduce per job (its gradients flattened into one buffer, reduced, and the
            # parameters' .grad set to views of the reduced buffer), not one per parameter tensor; then the losses
            for job in jobs:
                params = list(job.adapter.parameters())
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                for group in _bucket_groups(grads):  # one group unless the job's factors mix dtypes / devices
                    flat = _flatten_dense_tensors([grads[i] for i in group])
                    dist.all_reduce(flat)
                    for i, g in zip(group, _unflatten_dense_tensors(flat, [grads[i] for i in group])):
                        params[i].grad = g
            flat = torch.stack([loss_sums[j.id] for j in jobs])
            dist.all_reduce(flat)
            for k, j in enumerate(jobs):
                loss_sums[j.id] = flat[k]
        stats = {}
        for job in jobs:
            params = [p for p in job.adapter.parameters()]
            if job.cfg.max_grad_norm:
                gnorm = torch.nn.utils.clip_grad_norm_(params, job.cfg.max_grad_norm)
            else:
                gnorm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None))
            job.opt.step()
            job.sched.step()
            job.opt.zero_grad(set_to_none=True)
            job.step += 1
            job.tokens += step_tokens[job.id]
            loss = float(loss_sums[job.id] / max(step_targets[job.id], 1))
            job.history["train"].append((job.step, loss))
            job.detector.report_train(job.step, loss)
            job.history["ema"].append((job.step, job.detector.ema if job.detector.ema is not None else loss))
            stats[job.name] = {"loss": loss, "grad_norm": float(gnorm), "targets": step_targets[job.id]}
        self.observe_memory(jobs)
        return {"microbatches": len(mbs), "tokens": sum(step_tokens.values()), "jobs": stats}

    @torch.no_grad()
    def evaluate(self, jobs: list[Job]) -> dict[int, float]:
        jobs = [j for j in jobs if j.data.val]
        if not jobs:
            return {}
        for j in jobs:
            self.registry[j.id] = j.adapter
        requests = [(j.id, list(range(len(j.data.val)))) for j in jobs]
        mbs = self._microbatches(requests, split="val")
        sums = torch.zeros(len(jobs), dtype=torch.float64, device=self.device)
        counts = torch.zeros(len(jobs), dtype=torch.float64, device=self.device)
        index = {j.id: k for k, j in enumerate(jobs)}
        for i, mb in enumerate(mbs):
            if i % self.world != self.rank:
                continue
            mb = mb.to(self.device)
            for j, l in job_losses(self.model, mb, self.ctx).items():
                sums[index[j]] += l.double()
                counts[index[j]] += mb.n_targets(j)
        dist = _dist()
        if dist is not None and self.world > 1:
            dist.all_reduce(sums)
            dist.all_reduce(counts)
        for j in jobs:
            if j.status != "active":
                self.registry.pop(j.id, None)
        return {j.id: float(sums[index[j.id]] / counts[index[j.id]].clamp(min=1)) for j in jobs}

    def _eval_due(self, job: Job) -> bool:
        return job.step >= job.total_steps or self.next_eval_step(job, job.step - 1) == job.step

    def next_eval_step(self, job: Job, after: int) -> int:
        """The first step after ``after`` at which the job is evaluated: the next multiple of its ``eval_every``, its
        last step, or its warm-up step when warm-up selection applies."""
        every = job.cfg.eval_every  # 0: at the end only (and at the warm-up step)
        due = [job.total_steps] + ([(after // every + 1) * every] if every else [])
        if self._warmup_applies(job) and job.warm_steps > after:
            due.append(job.warm_steps)
        return min(due)

    def _warmup_applies(self, job: Job) -> bool:
        ee = self.run_cfg.early_exit
        return (ee.enabled and ee.warmup_select and self.group_sizes.get(job.cfg.group, 1) > 1
                and job.warm_steps is not None and job.warm_steps < job.total_steps)

    def after_step(self) -> int:
        """Evaluations, early exit, warm-up parking and selection after a round; returns #jobs evaluated."""
        jobs = self.active_jobs()
        due = [j for j in jobs if self._eval_due(j)]
        vals = self.evaluate(due) if due else {}
        for job in jobs:
            if job.id in vals:
                v = vals[job.id]
                job.history["val"].append((job.step, v))
                job.detector.report(job.step, v)
                if job.detector.is_best_latest:
                    job.best_state = {k: t.detach().cpu().clone() for k, t in job.adapter.state_dict().items()}
            if job.detector.should_stop():
                self._finish(job, job.detector.reason)
            elif job.step >= job.total_steps:
                self._finish(job, "completed")
            elif self._warmup_applies(job) and job.step == job.warm_steps and not job.warm_done:
                job.warm_val = vals.get(job.id, job.history["train"][-1][1])
                self._park(job)
        self._select_warmup()
        return len(vals)

    def _select_warmup(self) -> None:
        groups: dict[str, list[Job]] = {}
        for j in self.jobs:
            groups.setdefault(j.cfg.group, []).append(j)
        for g, members in groups.items():
            parked = [j for j in members if j.status == "parked" and not j.warm_done]
            if not parked or any(j.status in ("queued", "active") for j in members):
                continue
            kept, evicted = select_after_warmup({j.id: j.warm_val for j in parked},
                                                self.run_cfg.early_exit.keep_ratio)
            for j in parked:
                j.warm_done = True
            for jid in evicted:
                self._finish(self.jobs[jid], UNDERPERFORMING)
            self.log(f"[engine] warm-up selection in group {g!r}: kept "
                     f"{[self.jobs[k].name for k in kept]}, evicted {len(evicted)}")

    def _finish(self, job: Job, reason: str, write: bool = True) -> None:
        job.status = "done"
        job.reason = reason
        self.registry.pop(job.id, None)
        if write and job.adapter is not None:
            if reason in (OVERFITTING, DIVERGING) and job.best_state is not None:
                # keep the best-validation checkpoint: the latest state of a diverged job can be inf/NaN
                job.adapter.load_state_dict(job.best_state)
            job.adapter_path = str(self.out / "adapters" / job.name)
            if self.rank == 0:
                adapter = job.adapter.to_adapter(self.base_id)
                if adapter_is_finite(adapter, job.name, self.log):
                    save_adapter(adapter, job.adapter_path)
                else:
                    job.adapter_path = None
                if self.run_cfg.save_plots:
                    plot_job(job, self.out / "plots" / f"{job.name}.png")
        job.result = self._result_row(job)
        # release memory of finished jobs
        job.adapter, job.opt, job.sched, job.best_state = None, None, None, None

    def _result_row(self, job: Job) -> dict:
        c = job.cfg
        vals = [v for _, v in job.history["val"]]
        best = min(vals) if vals else None
        best_step = job.history["val"][vals.index(best)][0] if vals else None
        return {
            "job": job.name, "status": job.status, "stop_reason": job.reason, "r": c.r, "lora_alpha": c.lora_alpha,
            "nblocks": c.nblocks, "lr": c.lr, "batch_size": c.step_samples, "steps": job.step,
            "total_steps": job.total_steps,
            "final_train_loss": job.history["train"][-1][1] if job.history["train"] else None,
            "final_eval_loss": vals[-1] if vals else None, "best_eval_loss": best, "best_step": best_step,
            "tokens": job.tokens, "time_s": round(job.time_s, 3), "adapter": job.adapter_path,
        }

    # -- main loop ----------------------------------------------------------------------------------------
    def admit_next(self) -> list[Job]:
        """Backfills free slots and returns the active jobs, [] when the run is over; raises when jobs are left that
        the memory model will never admit (the loop would otherwise end with them unrun)."""
        self.admit()
        active = self.active_jobs()
        if not active:
            if any(j.status == "parked" and j.warm_done for j in self.jobs):
                raise EngineError("parked warm-up survivors cannot be admitted; raise memory_budget_gb")
            if any(j.status == "queued" for j in self.jobs):
                raise EngineError("queued jobs cannot be admitted (memory model); raise memory_budget_gb")
        return active

    def run(self) -> list[dict]:
        run = self.run_cfg
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / "run_config.json", "w") as f:
                json.dump(run.to_dict(), f, indent=2, default=str)
        if run.resume and (self.out / CHECKPOINT).is_file():
            self.load_checkpoint(self.out / CHECKPOINT)
            self.log(f"[engine] resumed from {self.out / CHECKPOINT} at round {self.round}")
        rounds_this_call = 0
        reporter = RunReporter(self.jobs, self.out, self.jobs[0].cfg.progress, self.rank == 0)
        try:
            return self._run_rounds(reporter)
        finally:
            reporter.close()

    def _run_rounds(self, reporter: RunReporter) -> list[dict]:
        run = self.run_cfg
        rounds_this_call = 0
        while True:
            active = self.admit_next()
            if not active:
                break
            t0 = time.perf_counter()
            info = self.train_round()
            t1 = time.perf_counter()
            n_eval = self.after_step()
            dt = time.perf_counter() - t0
            for j in active:
                j.time_s += dt
                if j.result is not None:  # finished this round: its row was made before the time was added
                    j.result["time_s"] = round(j.time_s, 3)
            self.round += 1
            rounds_this_call += 1
            self.round_log.append({"round": self.round, "time_s": dt, "train_s": t1 - t0, "tokens": info["tokens"],
                                   "microbatches": info["microbatches"], "active": len(active), "evals": n_eval})
            reporter.after_round()
            if run.log_every and self.round % run.log_every == 0:
                self.print_progress(active, info)
            finished_now = any(j.status == "done" for j in active)
            if run.save_every and (self.round % run.save_every == 0 or finished_now):
                self.save_checkpoint()
            if self.rank == 0 and finished_now:
                self.write_results()
            if run.max_rounds is not None and rounds_this_call >= run.max_rounds:
                self.save_checkpoint()
                self.log(f"[engine] stopped after {rounds_this_call} rounds (max_rounds); run again to resume")
                return [self._result_row(j) if j.result is None else j.result for j in self.jobs]
        self.save_checkpoint()
        rows = self.write_results()
        if self.rank == 0:
            self.log(format_table(rows))
        return rows

    def print_progress(self, active: list[Job], info: dict) -> None:
        """One header line for the round (its tokens/s over its training time, from ``round_log``), then one line
        per active job: step, last train and validation loss, the job's tokens/s over its time in the engine
        (rounds it shared, evaluations included), status."""
        last = self.round_log[-1] if self.round_log else {}
        rate = f", {info['tokens'] / last['train_s']:,.0f} tok/s" if last.get("train_s") else ""
        lines = [f"round {self.round}: {len(active)} active, {info['microbatches']} micro-batches, "
                 f"{info['tokens']} tokens{rate}"]
        for j in active:
            val = f"{j.history['val'][-1][1]:.4f}" if j.history["val"] else "-"
            tr = j.history["train"][-1][1] if j.history["train"] else float("nan")
            tps = f"{j.tokens / j.time_s:,.0f}" if j.time_s > 0 else "-"
            status = j.status if j.status != "done" else f"done:{j.reason}"
            lines.append(f"  {j.name[:40]:40s} {j.step:5d}/{j.total_steps:<5d} train {tr:8.4f} val {val:>8s} "
                         f"{tps:>8s} tok/s {status}")
        self.log("\n".join(lines))

    def write_results(self) -> list[dict]:
        rows = [j.result if j.result is not None else self._result_row(j) for j in self.jobs]
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / RESULTS_CSV, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=RESULT_FIELDS)
                w.writeheader()
                for r in rows:
                    w.writerow({k: r.get(k) for k in RESULT_FIELDS})
            with open(self.out / "results.json", "w") as f:
                json.dump({"jobs": rows, "rounds": self.round_log,
                           "memory_model": {"beta": self.memory.beta, "fitted": self.memory.fitted}}, f, indent=2)
        return rows

    # -- checkpoints --------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        if self.rank != 0:
            return
        jobs = {j.name: {**job_run_state(j), **job_tensor_state(j)} for j in self.jobs}
        state = {"round": self.round, "jobs": jobs, "round_log": self.round_log,
                 "memory_points": self.memory.points}
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(state, self.out / CHECKPOINT)

    def load_checkpoint(self, path) -> None:
        self.restore(torch.load(path, map_location="cpu", weights_only=False))

    def restore(self, state: dict) -> None:
        """Run and job state from a checkpoint's dict (:meth:`save_checkpoint`'s layout)."""
        self.round = state["round"]
        self.round_log = state.get("round_log", [])
        self.memory.points = state.get("memory_points", [])
        for j in self.jobs:
            s = state["jobs"].get(j.name)
            if s is None:
                continue  # a job added to the run file after the checkpoint: queued
            for k in JOB_RUN_FIELDS:
                setattr(j, k, s[k])
            if "adapter" in s:
                self._build(j)
                j.adapter.load_state_dict(s["adapter"])
                j.opt.load_state_dict(s["opt"])
                j.sched.load_state_dict(s["sched"])
                j.sampler.load_state_dict(s["sampler"])
                j.detector.load_state_dict(s["detector"])
                j.best_state = s["best_state"]
                if j.status == "active":
                    self.registry[j.id] = j.adapter
            j.history = {k: [tuple(x) for x in v] for k, v in j.history.items()}


def job_run_state(job: Job) -> dict:
    """The job's run state for a checkpoint (statuses, counters, histories, result row)."""
    return {k: getattr(job, k) for k in JOB_RUN_FIELDS}


def job_tensor_state(job: Job) -> dict:
    """The job's trainable state for a checkpoint (LoRA factors, AdamW, LR schedule, sampler, early exit, best
    factors); {} while it has no adapter (queued or finished)."""
    if job.adapter is None:
        return {}
    return {"adapter": {k: v.detach().cpu() for k, v in job.adapter.state_dict().items()},
            "opt": job.opt.state_dict(), "sched": job.sched.state_dict(), "sampler": job.sampler.state_dict(),
            "detector": job.detector.state_dict(), "best_state": job.best_state}


def atomic_torch_save(obj, path: Path) -> None:
    """torch.save to a temp file renamed into place: a crash leaves the old file or the new one, never half."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _optimizer_to(opt, device) -> None:
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":
                st[k] = v.to(device)


def job_spec(cfg: JobConfig, model_type: str, model=None, source: str = "run file"):
    """The job's BDLoraSpec for the model; a target or block count the model cannot take is a ConfigError naming
    the job and the key (never a reshape error deep in the first forward)."""
    from bdlora.spec import BDLoraError

    try:
        spec = cfg.spec(model_type)
    except BDLoraError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{source}: job {cfg.name!r}: target_modules: {e}") from None
    if model is not None:
        try:
            spec.matching_modules(model)
        except BDLoraError as e:
            key = "nblocks" if "divisible" in str(e) else "target_modules"
            raise ConfigError(f"{source}: job {cfg.name!r}: {key}: {e}") from None
    return spec


def run_source(run) -> str:
    return getattr(run, "source", "run file")


def adapter_is_finite(adapter, job_name: str, log) -> bool:
    """Whether every factor of ``adapter`` is finite; if not, says so through ``log``: such a folder is never
    written (a job that diverged before its first evaluation has no best checkpoint to fall back to)."""
    if all(bool(torch.isfinite(t).all()) for f in adapter.modules.values() for t in (f.lora_A, f.lora_B)):
        return True
    log(f"[engine] {job_name}: its factors are not finite and it has no finite best checkpoint; no adapter written")
    return False


def plot_job(job: Job, path: Path) -> Optional[Path]:
    """Loss curves (train, its EMA, validation) as PNG; returns None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    h = job.history
    if h["train"]:
        ax.plot(*zip(*h["train"]), label="train", alpha=0.5)
    if h["ema"]:
        ax.plot(*zip(*h["ema"]), label="train (EMA)")
    if h["val"]:
        ax.plot(*zip(*h["val"]), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{job.name} ({job.reason})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def format_table(rows: list[dict]) -> str:
    cols = ["job", "stop_reason", "r", "nblocks", "lr", "steps", "final_eval_loss", "best_eval_loss", "tokens",
            "time_s"]

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    table = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
    widths[1] = min(widths[1], 40)
    line = lambda cells: "  ".join(str(c)[:w].ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(t) for t in table])


__all__ = ["Engine", "EngineError", "Job", "adapter_is_finite", "format_table", "job_losses", "job_spec", "load_base", "load_job_data",
           "plot_job"]
