"""One pipeline stage at work: the process group (:func:`init_distributed`), the two point-to-point groups
(:func:`p2p_groups`), and :class:`Stage`, which runs this rank's forward and backward ops, moves activations and
gradients, and applies each job's optimizer step once its global gradient norm is known."""

from __future__ import annotations

import inspect
import math
import time
import weakref
from collections import defaultdict

import torch

from ..multilora import dropout_rng, round_seed
from .schedule import PMB


def init_distributed(backend: str, local_rank: int, **kwargs) -> None:
    """``torch.distributed.init_process_group(backend, **kwargs)``; with NCCL the process first selects its GPU
    (``torch.cuda.set_device(local_rank)``) and, where this torch accepts it, binds the group to that GPU
    (``device_id``), so NCCL neither guesses the device from the global rank nor warns about it."""
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend, **kwargs)


# [weak references to (the default group they were made in, forward group, backward group)]: weak, so that
# destroy_process_group frees the groups (their gloo worker threads are joined then, not while the interpreter
# shuts down, where a worker releasing a finished collective's tensors aborts the process)
_P2P_GROUPS: list = []


def p2p_groups(timeout=None):
    """The pipeline's two point-to-point process groups over all ranks: activations (towards later stages) travel
    on the first, gradients (towards earlier stages) on the second.

    Why two: NCCL runs the sends and receives of one group between two ranks in order on one stream, and a send
    may wait until its receive is posted. In steady 1F1B stage s queues "send activation, then receive gradient"
    while stage s + 1 queues "send gradient, then receive activation": on one group each send waits for a receive
    queued behind the other rank's send, and both ranks wait forever. On a group per direction each stream
    carries one direction in the schedule's order (forward order on a stage follows the previous stage's, backward
    order the next stage's), so a message only waits on earlier messages of its own direction, a chain that ends
    at the first / last stage. (gloo matches by tag and needs no split; it uses the same two groups: one code path.)

    ``new_group`` is collective: the first call in a process group must happen on every rank at the same point;
    it creates the groups (``timeout``: theirs, default torch's), later calls return the same pair until the
    default group is replaced (destroyed and initialized again)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    cached = tuple(r() for r in _P2P_GROUPS)
    if cached and cached[0] is world and cached[1] is not None and cached[2] is not None:
        return cached[1], cached[2]
    ranks = list(range(dist.get_world_size()))
    pair = (dist.new_group(ranks, timeout=timeout), dist.new_group(ranks, timeout=timeout))
    _P2P_GROUPS[:] = [weakref.ref(world), weakref.ref(pair[0]), weakref.ref(pair[1])]
    return pair


class Stage:
    """Executes one rank's op list."""

    def __init__(self, engine, stage: int, stages: int, dist, groups):
        self.e, self.s, self.P, self.dist = engine, stage, stages, dist
        self.fwd_group, self.bwd_group = groups
        self.dev = engine.device
        self.decoder = getattr(engine.model, engine.model.base_model_prefix)
        self.head = engine.model.get_output_embeddings()
        self.hidden = engine.model.config.hidden_size
        self.dtype = next(engine.model.parameters()).dtype
        self.pending: dict[int, int] = {}
        self.norm_total: dict[int, float] = {}
        self.carry: dict[tuple[int, int], float] = defaultdict(float)
        self.done_b: dict[tuple[int, int], int] = defaultdict(int)
        self.inputs: dict[int, torch.Tensor] = {}
        self.outs: dict[int, torch.Tensor] = {}
        self.loss_sums: dict[int, float] = {}
        self.sends = []
        self.busy = 0.0

    # messages ------------------------------------------------------------------------------------------
    def _group(self, src: int, dst: int):
        """The message's direction's group (see :func:`p2p_groups`): forward towards a later stage."""
        return self.fwd_group if dst > src else self.bwd_group

    def _send(self, t: torch.Tensor, dst: int, tag: int):
        t = t.contiguous()
        self.sends.append((self.dist.isend(t, dst, group=self._group(self.s, dst), tag=tag), t))

    def _recv(self, shape, dtype, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.dev)
        self.dist.recv(buf, src, group=self._group(src, self.s), tag=tag)
        return buf

    # optimizer --------------------------------------------------------------------------------------------
    def apply(self, job_id: int, norm_sq: float) -> None:
        job = self.e.jobs[job_id]
        params = [p for p in job.adapter.parameters() if p.grad is not None]
        if job.cfg.max_grad_norm:
            coef = min(1.0, job.cfg.max_grad_norm / (math.sqrt(max(norm_sq, 0.0)) + 1e-6))
            for p in params:
                p.grad.mul_(coef)
        job.opt.step()
        job.sched.step()
        job.opt.zero_grad(set_to_none=True)
        self.pending.pop(job_id, None)

    def _local_norm_sq(self, job_id: int) -> float:
        return float(sum((p.grad.double() ** 2).sum() for p in self.e.jobs[job_id].adapter.parameters()
                         if p.grad is not None))

    # ops ----------------------------------------------------------------------------------------------------
    def forward(self, pm: PMB, step_targets: dict, train: bool = True) -> None:
        s, P, m = self.s, self.P, pm.idx
        mb = pm.mb.to(self.dev)
        shape = (*mb.input_ids.shape, self.hidden)
        tagbase = 4 * m if train else 4 * m + 1_000_000
        if s > 0:
            x = self._recv(shape, self.dtype, s - 1, tagbase)
            meta = self._recv((1,), torch.float64, s - 1, tagbase + 1)
            prev_norm = float(meta[0])
        else:
            prev_norm = self.norm_total.get(pm.job, -1.0) if pm.job in self.pending else -1.0
        t0 = time.perf_counter()
        if train and pm.job in self.pending:
            self.apply(pm.job, prev_norm)
        cfg = self.e.jobs[pm.job].cfg
        seed = (round_seed("lora-dropout", self.e.run_cfg.seed, cfg.seed, pm.step, m, s)
                if train and cfg.lora_dropout > 0 else None)
        with self.e.ctx.segments_of(mb.segments), torch.set_grad_enabled(train), dropout_rng(seed, self.dev):
            if s == 0:
                out = self.decoder(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False,
                                   **mb.attention_kwargs)
            else:
                if train:
                    x.requires_grad_(True)
                out = self.decoder(inputs_embeds=x, position_ids=mb.position_ids, use_cache=False,
                                   **mb.attention_kwargs)
        h = out.last_hidden_state
        if s == P - 1:
            pos, lab = mb.targets[pm.job]
            with torch.set_grad_enabled(train):
                logits = self.head(h.reshape(-1, self.hidden).index_select(0, pos)).float()
                loss_sum = torch.nn.functional.cross_entropy(logits, lab, reduction="sum")
            self.loss_sums[m] = float(loss_sum.detach())
            if train:
                self.outs[m] = loss_sum / max(step_targets[(pm.job, pm.step)], 1)
        else:
            self._send(h.detach(), s + 1, tagbase)
            self._send(torch.tensor([prev_norm], dtype=torch.float64, device=self.dev), s + 1, tagbase + 1)
            if train:
                self.outs[m] = h
        if train and s > 0:
            self.inputs[m] = x
        self.busy += time.perf_counter() - t0

    def backward(self, pm: PMB, mbs_in_step: dict) -> None:
        s, P, m = self.s, self.P, pm.idx
        key = (pm.job, pm.step)
        # the micro-batch's rows again: a checkpointed layer runs its forward once more in its backward
        if s == P - 1:
            t0 = time.perf_counter()
            with self.e.ctx.segments_of(pm.mb.segments):
                self.outs.pop(m).backward()
        else:
            shape = (*pm.mb.input_ids.shape, self.hidden)
            g = self._recv(shape, self.dtype, s + 1, 4 * m + 2)
            meta = self._recv((1,), torch.float64, s + 1, 4 * m + 3)
            self.carry[key] = max(self.carry[key], float(meta[0]))
            t0 = time.perf_counter()
            with self.e.ctx.segments_of(pm.mb.segments):
                torch.autograd.backward(self.outs.pop(m), g)
        self.done_b[key] += 1
        if self.done_b[key] == mbs_in_step[key]:
            val = self._local_norm_sq(pm.job) + self.carry.pop(key, 0.0)
            self.pending[pm.job] = pm.step
            if s == 0:
                self.norm_total[pm.job] = val
        else:
            val = self.carry.get(key, 0.0)
        if s > 0:
            x = self.inputs.pop(m)
            self._send(x.grad, s - 1, 4 * m + 2)
            self._send(torch.tensor([val], dtype=torch.float64, device=self.dev), s - 1, 4 * m + 3)
        self.busy += time.perf_counter() - t0

    def finish_sends(self):
        for req, _ in self.sends:
            req.wait()
        self.sends = []



__all__ = ["Stage", "init_distributed", "p2p_groups"]
