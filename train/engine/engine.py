"""The multi-LoRA fine-tuning engine: many BD-LoRA jobs over ONE frozen base model (BatchLoRA).

A *round* advances every active job by one optimizer step:

1. admission: queued jobs enter while ``max_active_jobs`` and the memory model allow (a job that cannot fit even
   alone is refused with a message);
2. every active job draws its step's samples (``batch_size * grad_accum``, each sample once per epoch);
3. all those samples are packed into micro-batches under the token budget (first-fit decreasing, one contiguous
   segment of rows per job and micro-batch; ``packing.py``);
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

import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from bdlora.adapter import save_adapter

from ..attention import packed_attention_fits, packed_attention_supported
from ..checkpointing import checkpoint_decoder_layers
from ..liger import apply_liger_to_base, folder_model_type, liger_decision
from . import checkpoint
from .config import ConfigError, JobConfig, RunConfig
from .data import DatasetSplit
from .early_exit import DIVERGING, OVERFITTING, warmup_steps
from .jobs import (Job, adapter_is_finite, build_job, check_no_expert_jobs, job_spec,  # noqa: F401 - names
                   load_job_data, optimizer_to, run_source)
from .loop import Advance, run_loop
from .memory import GiB, MemoryModel, auto_token_budget, device_budget_bytes, token_budget_candidates
from .model import load_base, load_kbit_base
from .multilora import BatchContext, JobAdapter, inject_multilora
from .packing import MicroBatch, build_microbatch, plan_microbatches
from .reporting import (RunReporter, format_table, plot_job, progress_text, result_row, result_rows,
                        write_results_csv)
from .scheduler import EngineError, Scheduler, admission_order  # noqa: F401 - EngineError: the engine's error
from .step import MicroBatchOutOfMemory, dist_group, evaluate, train_round

GPU_PAD_MULTIPLE = 64  # pad_multiple when the run file leaves it out and the engine runs on a GPU (RunConfig)


class Engine:
    """One multi-LoRA run on this process (or data parallel with the other ranks): the frozen base with the jobs' LoRA
    modules injected, the jobs, and the hooks its :class:`~.scheduler.Scheduler` drives (``fits``, ``activate``,
    ``park``, ``finish``, ``evaluate``). A pipeline stage (:class:`~.pipeline.StageEngine`) overrides those hooks."""

    def __init__(self, run: RunConfig, model=None, tokenizer=None, log=print):
        self.run_cfg = run
        self.out = Path(run.output_dir)
        dist = dist_group()
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
        # decided before the base loads (`use_liger_kernel: true` where it cannot run fails in seconds); Liger's
        # kernels patch the base's modules before the jobs' LoRA wraps its projections
        self.liger, self.liger_note = liger_decision(
            run.use_liger_kernel, model.config.model_type if model is not None else folder_model_type(folder),
            on_gpu=self.device.type == "cuda",
            unsupported="pipeline stages (a stage holds only its own layers)" if run.pipeline_stages > 1
            else "a k-bit base (not measured with Liger's kernels)" if run.load_in_4bit else None)
        if model is None and run.load_in_4bit:
            model, tokenizer = load_kbit_base(run.jobs[0], folder, self.device)
        elif model is None:  # a pipeline stage (StageEngine sets pipeline_stage = (s, P)) loads only its layers
            model, tokenizer = load_base(folder, run.precision, self.device, run.attn_implementation,
                                         stage=getattr(self, "pipeline_stage", None))
        if self.liger:
            apply_liger_to_base(model)
        self.model, self.tok = model, tokenizer
        #: packed micro-batches attend example by example through torch's varlen flash attention (train/attention.py)
        #: unless the run names an attention implementation (`sdpa`: transformers' block-causal mask)
        self.packed_attention = (run.attn_implementation is None and packed_attention_supported(self.device)
                                 and packed_attention_fits(model))
        model_type = getattr(model.config, "model_type", "llama")
        check_no_expert_jobs(model, run.jobs, run_source(run))
        cols, rows = set(), set()
        for j in run.jobs:
            s = job_spec(j, model_type, model, run_source(run))
            cols |= set(s.column_modules)
            rows |= set(s.row_modules)
        self.ctx = BatchContext(backend=run.lora_backend)
        self.registry: dict[int, JobAdapter] = {}
        self.targets = inject_multilora(model, cols, rows, self.ctx, self.registry)
        self.checkpointed_layers = (checkpoint_decoder_layers(model, run.gradient_checkpointing_every_n_layers)
                                    if run.gradient_checkpointing else 0)
        self.model_type = model_type
        self._splits: dict[tuple, DatasetSplit] = {}
        self._len_cache: dict[tuple, list[int]] = {}
        self.jobs = [Job(i, j, self._split(j), 0, model_type=model_type) for i, j in enumerate(run.jobs)]
        for job in self.jobs:
            job.total_steps = job.cfg.total_steps(len(job.data.train))
            if run.early_exit.enabled:
                job.warm_steps = warmup_steps(job.total_steps, run.early_exit.warmup_ratio)
        self.memory = MemoryModel.for_model(
            model, checkpointed_layers=self.checkpointed_layers, fused_layers=self.liger,
            mask_length=0 if self.packed_attention else max(j.cfg.max_length for j in self.jobs),
            eager_attention=run.attn_implementation == "eager")
        self.mem_budget = device_budget_bytes(self.device, run.memory_budget_gb)
        self.token_budget = self._choose_token_budget()  # a resumed run takes its checkpoint's (checkpoint.restore)
        self.round = 0
        self.pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
        self.round_log: list[dict] = []
        self.scheduler = Scheduler(self)

    def _choose_token_budget(self) -> int:
        """The run's token budget: the run file's, or with ``auto`` :func:`~.memory.auto_token_budget` for the jobs
        admitted first (by priority, then file order), the smallest choice of all ranks (every rank packs the same
        micro-batches; pipeline stages hold different layers)."""
        run = self.run_cfg
        if run.token_budget != "auto":
            return int(run.token_budget)
        first = self._first_jobs()
        budget = auto_token_budget(self.memory, [j.footprint(self.targets) for j in first], self.mem_budget,
                                   step_tokens=sum(j.cfg.step_samples * j.cfg.max_length for j in first),
                                   longest=max(j.cfg.max_length for j in self.jobs))
        dist = dist_group()
        if dist is not None and self.world > 1:
            t = torch.tensor([budget], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            budget = int(t.item())
        return budget

    def _first_jobs(self) -> list[Job]:
        """The jobs admitted first (by priority, then file order), those ``token_budget: auto`` sizes for."""
        return admission_order(self.jobs)[:self.run_cfg.max_active_jobs]

    # -- data ------------------------------------------------------------------------------------------
    def _split(self, j: JobConfig) -> DatasetSplit:
        key = j.data_key()  # jobs with the same data settings share one tokenized split
        if key not in self._splits:
            self._splits[key] = load_job_data(j, self.tok, run_source(self.run_cfg), split_seed=self.run_cfg.seed)
        return self._splits[key]

    def lengths(self, job_id: int, split: str = "train") -> list[int]:
        """The token lengths of a job's samples: memoized per dataset split, as packing looks them up once per sample
        of a round (rebuilding the list each time cost O(samples drawn x dataset size) Python work per round)."""
        data = self.jobs[job_id].data
        key = (id(data), split)
        if key not in self._len_cache:
            self._len_cache[key] = [len(s) for s in getattr(data, split)]
        return self._len_cache[key]

    def microbatches(self, requests, split="train") -> list[MicroBatch]:
        """``requests`` [(job id, sample indices)] packed into padded micro-batches under the token budget: in one
        row where attention runs example by example (``packed_attention``), else in rows capped for a dense mask."""
        bins = plan_microbatches(requests, lambda j: self.lengths(j, split), self.token_budget,
                                 self.pad_multiple, self.packed_attention)
        return [build_microbatch(b, lambda j: getattr(self.jobs[j].data, split), self.pad_id,
                                 self.pad_multiple, self.packed_attention) for b in bins]

    # -- the scheduler's hooks: a job's state and memory ---------------------------------------------------------
    def build_job(self, job: Job) -> None:
        build_job(job, self.targets, self.model_type, self.device, self.run_cfg.early_exit)

    def activate(self, job: Job) -> None:
        if job.adapter is None:
            self.build_job(job)
        elif job.adapter.a[next(iter(job.adapter.a))].device != self.device:
            job.adapter.to(self.device)
            optimizer_to(job.opt, self.device)
        job.status = "active"
        self.registry[job.id] = job.adapter

    def park(self, job: Job) -> None:
        job.status = "parked"
        self.registry.pop(job.id, None)
        if self.device.type == "cuda":  # free the slot's GPU memory while the group finishes warm-up
            job.adapter.to("cpu")
            optimizer_to(job.opt, "cpu")

    def finish(self, job: Job, reason: str, write: bool = True) -> None:
        """The job is done: its best-validation factors where it overfitted or diverged, its adapter folder (rank 0;
        none if its factors are not finite), plot and result row; its memory is freed."""
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
        job.result = result_row(job)
        job.adapter, job.opt, job.sched, job.best_state = None, None, None, None

    def fits(self, jobs: list[Job]) -> tuple[bool, float]:
        """(whether ``jobs`` fit the memory budget together, the memory model's prediction in bytes)."""
        pred = self.memory.predict(self.token_budget, [j.footprint(self.targets) for j in jobs])
        return (self.mem_budget is None or pred <= self.mem_budget), pred

    def active_jobs(self) -> list[Job]:
        return self.scheduler.active_jobs()

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
        self.memory.observe(self.token_budget, [j.footprint(self.targets) for j in jobs], peak)
        if self.run_cfg.memory_model == "auto" and len(self.memory.points) % 5 == 0:
            self.memory.fit()
        return peak

    # -- steps and decisions -----------------------------------------------------------------------------------
    def train_round(self) -> dict:
        return train_round(self)

    def evaluate(self, jobs: list[Job]) -> dict[int, float]:
        return evaluate(self, jobs)

    def admit(self) -> None:
        self.scheduler.admit()

    def after_step(self) -> int:
        return self.scheduler.after_step()

    # -- the run -------------------------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        run = self.run_cfg
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / "run_config.json", "w") as f:
                json.dump(run.to_dict(), f, indent=2, default=str)
        if self.rank == 0:
            self.log(f"[engine] {len(self.jobs)} jobs on {self.device}, lora_backend {run.lora_backend}, Liger kernels "
                     f"{self.liger_note}" + (f", {self.checkpointed_layers} decoder layers recompute in backward"
                                             if self.checkpointed_layers else "")
                     + (", packed attention (varlen flash)" if self.packed_attention else ""))
        if run.resume and (self.out / checkpoint.CHECKPOINT).is_file():
            checkpoint.load(self, self.out / checkpoint.CHECKPOINT)
            self.log(f"[engine] resumed from {self.out / checkpoint.CHECKPOINT} at round {self.round}")
        self.log(f"[engine] token budget {self.token_budget} tokens per micro-batch" + self._budget_reason())
        reporter = RunReporter(self.jobs, self.out, self.jobs[0].cfg.progress, self.rank == 0)
        try:
            return run_loop(self, self._advance, lambda: checkpoint.save(self), self.write_results,
                            self._stopped, self._ended, reporter)
        finally:
            reporter.close()

    def _budget_reason(self) -> str:
        """How ``token_budget: auto`` chose: the memory model's prediction for the first jobs against the limit."""
        if self.run_cfg.token_budget != "auto":
            return ""
        if self.mem_budget is None:
            return " (auto)"
        first = self._first_jobs()
        need = self.memory.predict(self.token_budget, [j.footprint(self.targets) for j in first])
        return (f" (auto: ~{need / GiB:.1f} GiB predicted for the first {len(first)} jobs, limit "
                f"{self.mem_budget / GiB:.1f} GiB)")

    def _advance(self, active: list[Job]) -> Advance:
        """One round: every active job one step, then the scheduler's decisions. A round that runs out of GPU memory
        under ``token_budget: auto`` runs again from the same batches at the next smaller budget (kept from then on,
        and in the checkpoint)."""
        t0 = time.perf_counter()
        while True:
            samplers = [(j, j.sampler.state_dict()) for j in active]
            try:
                info = self.train_round()
                break
            except MicroBatchOutOfMemory as e:
                smaller = self._smaller_token_budget()
                if smaller is None:
                    raise EngineError(self._out_of_memory_message(e)) from None
                for job, state in samplers:
                    job.sampler.load_state_dict(state)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                self.log(f"[engine] out of GPU memory at {self.token_budget} tokens per micro-batch: the round runs "
                         f"again at {smaller} (token_budget: auto)")
                self.token_budget = smaller
        train_s = time.perf_counter() - t0
        return Advance(rounds=1, train_s=train_s, info=info, evals=self.after_step())

    def _smaller_token_budget(self) -> Optional[int]:
        """The budget an out-of-memory round retries at: the next of ``auto``'s sizes below the current one, on one
        process under ``token_budget: auto``; else None (ranks of data parallel pack the same micro-batches, so one
        rank cannot change its budget alone)."""
        if self.run_cfg.token_budget != "auto" or self.world > 1:
            return None
        longest = max(j.cfg.max_length for j in self.jobs)
        return next((t for t in token_budget_candidates(longest) if t < self.token_budget), None)

    def _out_of_memory_message(self, e: MicroBatchOutOfMemory) -> str:
        fixed = self.run_cfg.token_budget != "auto"
        return (f"{e} ({len(self.active_jobs())} jobs active, token_budget: "
                f"{self.token_budget}{'' if fixed else ' (auto)'}): set a smaller token_budget"
                f"{'' if fixed else ' than ' + str(self.token_budget)} (at least the longest max_length), fewer "
                f"max_active_jobs or gradient_checkpointing: true, and run again with resume: auto to continue from "
                f"the last checkpoint")

    def _stopped(self, rounds: int) -> list[dict]:
        self.log(f"[engine] stopped after {rounds} rounds (max_rounds); run again to resume")
        return result_rows(self.jobs)

    def _ended(self) -> list[dict]:
        rows = self.write_results()
        if self.rank == 0:
            self.log(format_table(rows))
        return rows

    def log_progress(self, active: list[Job], info: dict) -> None:
        self.log(progress_text(self.round, self.round_log, active, info))

    def write_results(self) -> list[dict]:
        rows = result_rows(self.jobs)
        if self.rank == 0:
            write_results_csv(self.out, rows)
            with open(self.out / "results.json", "w") as f:
                json.dump({"jobs": rows, "rounds": self.round_log, "token_budget": self.token_budget,
                           "memory_model": {"beta": self.memory.beta, "fitted": self.memory.fitted}}, f, indent=2)
        return rows


__all__ = ["Engine", "EngineError", "GPU_PAD_MULTIPLE"]
