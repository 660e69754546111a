"""One job of a multi-LoRA run: its config, data, trainable state (adapter, optimizer, schedule, sampler, early-exit
detector), its history and the checkpoint form of all of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .config import ConfigError, JobConfig
from .data import DatasetSplit, EpochSampler, Sample
from .early_exit import EarlyExit
from .memory import JobFootprint
from .multilora import JobAdapter


# a job's run state in checkpoints (the engine's and the pipeline's run_state.pt); its tensors: job_tensor_state
JOB_RUN_FIELDS = ("status", "reason", "step", "tokens", "time_s", "history", "warm_val", "warm_done", "adapter_path",
                  "result")


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


def build_job(job: "Job", targets: dict, model_type: str, device, early_exit) -> None:
    """The job's trainable state: its adapter on the engine's LoRA modules ``targets``, AdamW, LR schedule, epoch
    sampler and early-exit detector, all seeded by the job."""
    from transformers import get_scheduler

    cfg = job.cfg
    spec = cfg.spec(model_type)
    mine = {n: t for n, t in targets.items() if n.rsplit(".", 1)[-1] in spec.target_modules}
    job.adapter = JobAdapter(spec, mine, seed=cfg.seed, device=device, a_init=cfg.a_init)
    # fused on a GPU: the foreach AdamW computes every tensor's bias correction on the host (a .item() per factor),
    # which made the optimizer steps the host's largest cost once a round trains twenty jobs
    job.opt = torch.optim.AdamW(job.adapter.parameters(), lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                                fused=torch.device(device).type == "cuda")
    job.sched = get_scheduler(cfg.scheduler, job.opt, num_warmup_steps=cfg.warmup_for(job.total_steps),
                              num_training_steps=job.total_steps)
    job.sampler = EpochSampler(len(job.data.train), cfg.step_samples, seed=cfg.seed)
    ee = early_exit
    job.detector = EarlyExit(ee.window, ee.patience, ee.tau_slope, ee.tau_gap, ee.ema_alpha,
                             divergence=ee.enabled, overfitting=ee.enabled)


def record_train_step(job: "Job", loss: float) -> None:
    """One optimizer step of ``job`` done with train loss ``loss``: the step counter, the loss history, the early-exit
    detector and its EMA (the same bookkeeping in the engine's rounds and the pipeline's segments)."""
    job.step += 1
    job.history["train"].append((job.step, loss))
    job.detector.report_train(job.step, loss)
    job.history["ema"].append((job.step, job.detector.ema if job.detector.ema is not None else loss))


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


def optimizer_to(opt, device) -> None:
    """Moves an optimizer's state tensors (not its step counters) to ``device``."""
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":
                st[k] = v.to(device)


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


def check_no_expert_jobs(model, jobs, source: str = "run file") -> None:
    """The engine adapts linear layers only: on a MoE model with fused experts, where `bdlora train` would also
    adapt the experts (``target_parameters`` unset), every job must say ``target_parameters: []``."""
    from bdlora.moe import fused_experts

    if not fused_experts(model):
        return
    for j in jobs:
        if j.target_parameters != []:
            raise ConfigError(f"{source}: job {j.name!r}: this model's MoE experts are fused tensors, which "
                              "`bdlora sweep` does not adapt (`bdlora train` does, by default); set "
                              "target_parameters: [] to sweep attention-only adapters, or train expert adapters "
                              "with `bdlora train`")


def run_source(run) -> str:
    return getattr(run, "source", "run file")


def adapter_is_finite(adapter, job_name: str, log) -> bool:
    """Whether every factor of ``adapter`` is finite; if not, says so through ``log``: such a folder is never
    written (a job that diverged before its first evaluation has no best checkpoint to fall back to)."""
    if all(bool(torch.isfinite(t).all()) for f in adapter.modules.values() for t in (f.lora_A, f.lora_B)):
        return True
    log(f"[engine] {job_name}: its factors are not finite and it has no finite best checkpoint; no adapter written")
    return False


__all__ = ["JOB_RUN_FIELDS", "Job", "adapter_is_finite", "build_job", "check_no_expert_jobs", "job_run_state",
           "job_spec", "job_tensor_state", "load_job_data", "optimizer_to", "record_train_step", "run_source"]
