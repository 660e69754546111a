"""One step of the engine on one process or data parallel over several: a round of every active job's optimizer
step through the shared base, and validation losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .jobs import record_train_step
from .multilora import dropout_rng, round_seed
from .packing import MicroBatch


def dist_group():
    """The initialized default process group's module (torch.distributed), or None on one process."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _bucket_groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (dtype, device), in first-seen order: the flat buffers of the data-parallel
    gradient all-reduce (one per job and step when its factors share a dtype and device, as they do)."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


def decoder_and_head(model):
    return getattr(model, model.base_model_prefix), model.get_output_embeddings()


def job_losses(model, mb: MicroBatch) -> dict[int, torch.Tensor]:
    """Forward one packed micro-batch (under its segments: ``BatchContext.segments_of``); {job: summed
    response-token cross-entropy}."""
    decoder, head = decoder_and_head(model)
    out = decoder(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, **mb.attention_kwargs)
    h = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])  # flattened rows: segment order
    losses = {}
    for job, (pos, lab) in mb.targets.items():
        if lab.numel() == 0:
            continue
        logits = head(h.index_select(0, pos)).float()
        losses[job] = F.cross_entropy(logits, lab, reduction="sum")
    return losses


class MicroBatchOutOfMemory(Exception):
    """The GPU ran out of memory in a round's forward or backward, before any job's optimizer step: the jobs'
    gradients are cleared, so the round can run again from the same batches."""

    def __init__(self, tokens: int):
        super().__init__(f"out of GPU memory in a micro-batch of up to {tokens} tokens")
        self.tokens = tokens


def train_round(engine) -> dict:
    """One round: every active job's step packed into micro-batches under the token budget, forward/backward through the
    shared base (this rank's share of the micro-batches), gradients all-reduced per job across ranks, then per job
    clipping, AdamW and the LR schedule. Returns the round's micro-batch count, tokens and per-job statistics."""
    jobs = engine.active_jobs()
    requests = [(j.id, j.sampler.next_batch()) for j in jobs]
    mbs = engine.microbatches(requests)
    step_targets = {j.id: 0 for j in jobs}
    step_tokens = {j.id: 0 for j in jobs}
    for mb in mbs:
        for job_id, s, e in mb.segments:
            step_targets[job_id] += mb.n_targets(job_id)
    for job_id, idxs in requests:
        step_tokens[job_id] = sum(len(engine.jobs[job_id].data.train[i]) for i in idxs)
    loss_sums = {j.id: torch.zeros((), dtype=torch.float64, device=engine.device) for j in jobs}
    engine.reset_peak_memory()
    if engine.model.training:  # model.train(False) walks every module: only when someone switched it on
        engine.model.train(False)
    # LoRA dropout: each micro-batch's masks from a seed of (run seed, the dropout jobs' seeds and steps, its
    # index), so a run is reproducible and resumes exactly
    drop_key = [(j.cfg.seed, j.step) for j in jobs if j.cfg.lora_dropout > 0]
    try:
        _forward_backward(engine, mbs, drop_key, step_targets, loss_sums)
    except torch.cuda.OutOfMemoryError:
        out_of_memory = True
    else:
        out_of_memory = False
    if out_of_memory:  # outside the handler, so the failed graph's tensors are freed with its traceback
        for job in jobs:
            job.opt.zero_grad(set_to_none=True)
        raise MicroBatchOutOfMemory(engine.token_budget)
    dist = dist_group()
    if dist is not None and engine.world > 1:
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
    norms = []
    for job in jobs:
        params = [p for p in job.adapter.parameters()]
        if job.cfg.max_grad_norm:
            gnorm = torch.nn.utils.clip_grad_norm_(params, job.cfg.max_grad_norm)
        else:
            gnorm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None))
        norms.append(gnorm.double())
        job.opt.step()
        job.sched.step()
        job.opt.zero_grad(set_to_none=True)
        job.tokens += step_tokens[job.id]
    # one host copy for every job's loss and norm: each copy syncs the stream, and a sync per job (or per
    # quantity) would stall the GPU between the jobs' updates
    losses_host, norms_host = [], []
    if jobs:
        both = torch.stack([loss_sums[j.id] / max(step_targets[j.id], 1) for j in jobs] + norms).tolist()
        losses_host, norms_host = both[:len(jobs)], both[len(jobs):]
    stats = {}
    for job, loss, gnorm in zip(jobs, losses_host, norms_host):
        record_train_step(job, loss)
        stats[job.name] = {"loss": loss, "grad_norm": gnorm, "targets": step_targets[job.id]}
    engine.observe_memory(jobs)
    return {"microbatches": len(mbs), "tokens": sum(step_tokens.values()), "jobs": stats}


def _forward_backward(engine, mbs: list, drop_key: list, step_targets: dict, loss_sums: dict) -> None:
    """This rank's share of a round's micro-batches forward and backward: gradients accumulate in the jobs'
    factors, each job's summed loss in ``loss_sums``."""
    for i, mb in enumerate(mbs):
        if i % engine.world != engine.rank:
            continue
        mb = mb.to(engine.device)
        seed = round_seed("lora-dropout", engine.run_cfg.seed, drop_key, i) if drop_key else None
        with engine.ctx.segments_of(mb.segments):  # through backward: checkpointed layers run their forward again
            with dropout_rng(seed, engine.device):
                losses = job_losses(engine.model, mb)
            total = sum(l / max(step_targets[j], 1) for j, l in losses.items())
            if torch.is_tensor(total) and total.requires_grad:
                total.backward()
        for j, l in losses.items():
            loss_sums[j] += l.detach().double()


@torch.no_grad()
def evaluate(engine, jobs: list) -> dict[int, float]:
    """Validation loss per job (response-token mean over its whole validation set), the micro-batches spread over the
    ranks."""
    jobs = [j for j in jobs if j.data.val]
    if not jobs:
        return {}
    for j in jobs:
        engine.registry[j.id] = j.adapter
    requests = [(j.id, list(range(len(j.data.val)))) for j in jobs]
    mbs = engine.microbatches(requests, split="val")
    sums = torch.zeros(len(jobs), dtype=torch.float64, device=engine.device)
    counts = torch.zeros(len(jobs), dtype=torch.float64, device=engine.device)
    index = {j.id: k for k, j in enumerate(jobs)}
    for i, mb in enumerate(mbs):
        if i % engine.world != engine.rank:
            continue
        mb = mb.to(engine.device)
        with engine.ctx.segments_of(mb.segments):
            losses = job_losses(engine.model, mb)
        for j, l in losses.items():
            sums[index[j]] += l.double()
            counts[index[j]] += mb.n_targets(j)
    dist = dist_group()
    if dist is not None and engine.world > 1:
        dist.all_reduce(sums)
        dist.all_reduce(counts)
    for j in jobs:
        if j.status != "active":
            engine.registry.pop(j.id, None)
    return {j.id: float(sums[index[j.id]] / counts[index[j.id]].clamp(min=1)) for j in jobs}


__all__ = ["MicroBatchOutOfMemory", "decoder_and_head", "dist_group", "evaluate", "job_losses", "train_round"]
