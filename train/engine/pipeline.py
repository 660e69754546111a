"""LoRAPP (mLoRA, Ye et al., VLDB 2025, Sec. 3.2): the frozen base split into P pipeline stages on P processes; the micro-batches
of different jobs fill the pipeline with no flush between jobs.

* Stage s holds decoder layers ``[lo_s, hi_s)`` (embeddings on stage 0, final norm + LM head on the last) and the
  LoRA factors, optimizers and schedules of every job for the modules of those layers. It never holds the rest of
  the base: :func:`load_stage_model` builds the model on the meta device and reads only the stage's tensors from the
  checkpoint's safetensors files (sharded or not, tied head included) straight onto its device in the run's dtype,
  so a stage's weights are about 1/P of the model (recorded per stage in the results: ``load_per_stage``).
* Each job's optimizer step is packed into single-job micro-batches (token budget, first-fit decreasing); the
  stream interleaves the jobs round-robin. A job's next-step micro-batch may enter a stage only after that
  stage has applied the job's previous step; other jobs' micro-batches keep the stages busy meanwhile, so with
  L >= P jobs the pipeline needs no flush (bubble max((P-L)/P, 0) in the paper's model).
* The schedule is simulated identically on every rank (unit-time slots): the first stage prefers forward, the
  others (the last included) prefer backward; at most P - s micro-batches are in flight on stage s (1F1B memory
  bound); forward order on a stage follows the previous stage's, backward order the next stage's, so the
  point-to-point messages match in order (NCCL-safe) and by tag (gloo).
* Grad-norm clipping needs the job's norm over all stages: backward messages carry the downstream sum of squared
  norms; stage 0 completes it and sends it with the job's next forward, where every stage applies the pending
  step before running that forward (no extra synchronization); the last steps are applied after one broadcast.
* Segments: the run streams each active job's steps up to its next evaluation point (the next multiple of its
  ``eval_every``, its last step, or its warm-up step: where the single-process engine evaluates), then drains the
  pipeline (the broadcast above). At that boundary, identical on every rank, the last stage's train and validation
  losses are broadcast and the engine's own code decides (:class:`StageEngine`; :meth:`Engine.after_step`: ALTO early
  exit, best-validation factors, warm-up parking and top-k selection; :meth:`Engine.admit`: the queue backfills freed
  slots under ``max_active_jobs`` and the memory model, predicted per stage with the stage's modules, the worst stage
  deciding; its analytic base term counts the stage's own weights, its activation term every layer, so it is
  conservative); finished jobs' factors are gathered to rank 0 and written. ``save_every`` / ``max_rounds`` /
  ``resume`` act at boundaries: each stage writes ``pipeline_state/stage{s}.seg{n}.pt`` (its layers' factors,
  AdamW / LR-schedule states, samplers, early-exit states), rank 0 ``pipeline_state/run_state.pt`` (statuses,
  histories, segment counter); a resumed run ends with the same adapters and losses as an uninterrupted one.
  Differences from the single-process engine: a non-finite train loss is acted on at the next boundary (not at
  once); LoRA-dropout masks are seeded per pipeline micro-batch, so dropout jobs are reproducible (and resume
  exactly) but do not equal the single-process run; the memory model is refitted from each stage's measured peak
  per segment (GPU), not per step.

Activations and gradients travel with ``torch.distributed`` send/recv (gloo on CPU, NCCL on GPU), each direction
on its own process group (:func:`p2p_groups`). :func:`init_distributed` starts a process group bound to this process's
GPU (``device_id``) for launchers that run the pipeline.
"""

from __future__ import annotations

import gc
import inspect
import json
import math
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from bdlora.adapter import Adapter, AdapterConfig, save_adapter

from . import checkpoint
from .checkpoint import atomic_torch_save
from .config import RunConfig
from .engine import Engine
from .jobs import adapter_is_finite, job_run_state, job_tensor_state, record_train_step
from .loop import Advance, run_loop
from .model import _OtherStage, stage_bounds
from .multilora import dropout_rng, round_seed
from .packing import MicroBatch
from .reporting import RunReporter, format_table, plot_job, result_rows, write_results_csv
from .scheduler import EngineError


@dataclass
class PMB:
    """A pipeline micro-batch: one job's share of one optimizer step."""

    idx: int
    job: int
    step: int
    mb: MicroBatch


def simulate_schedule(mbs: list[PMB], stages: int, inflight: Optional[list[int]] = None
                      ) -> tuple[list[list[tuple[str, int]]], float]:
    """Per-stage op lists [("F"|"B", mb index)] and the bubble ratio of the unit-slot simulation."""
    P, M = stages, len(mbs)
    limit = inflight or [P - s for s in range(P)]
    steps_of: dict[tuple[int, int], list[int]] = defaultdict(list)
    for m in mbs:
        steps_of[(m.job, m.step)].append(m.idx)
    INF = math.inf
    fdone = [[INF] * M for _ in range(P)]
    bdone = [[INF] * M for _ in range(P)]
    ops: list[list[tuple[str, int]]] = [[] for _ in range(P)]
    fcount, bcount = [0] * P, [0] * P
    t, busy = 0, 0

    def job_ready(s, m):  # the job's previous step fully backpropagated on stage s
        prev = steps_of.get((mbs[m].job, mbs[m].step - 1), [])
        return all(bdone[s][i] < t for i in prev)

    while bcount[0] < M:
        chosen = []
        for s in range(P):
            f_cand = b_cand = None
            inflight_s = fcount[s] - bcount[s]
            if fcount[s] < M and inflight_s < limit[s]:
                if s == 0:
                    for m in range(M):
                        if fdone[0][m] == INF and job_ready(0, m):
                            f_cand = m
                            break
                else:
                    m = ops_f_order(ops[s - 1], fcount[s])
                    if m is not None and fdone[s - 1][m] < t and job_ready(s, m):
                        f_cand = m
            if bcount[s] < fcount[s]:
                if s == P - 1:
                    for _, m in ops_f_list(ops[s]):
                        if bdone[s][m] == INF and fdone[s][m] < t:
                            b_cand = m
                            break
                else:
                    m = ops_b_order(ops[s + 1], bcount[s])
                    if m is not None and bdone[s + 1][m] < t:
                        b_cand = m
            prefer_f = s == 0
            if prefer_f:
                pick = ("F", f_cand) if f_cand is not None else (("B", b_cand) if b_cand is not None else None)
            else:
                pick = ("B", b_cand) if b_cand is not None else (("F", f_cand) if f_cand is not None else None)
            chosen.append(pick)
        for s, pick in enumerate(chosen):
            if pick is None:
                continue
            kind, m = pick
            ops[s].append(pick)
            busy += 1
            if kind == "F":
                fdone[s][m] = t
                fcount[s] += 1
            else:
                bdone[s][m] = t
                bcount[s] += 1
        t += 1
        if t > 10 * (M + P) * 4:
            raise RuntimeError("pipeline schedule simulation did not terminate (dependency cycle)")
    bubble = 1.0 - busy / (P * t) if t else 0.0
    return ops, bubble


def ops_f_list(ops):
    return [(k, m) for k, m in ops if k == "F"]


def ops_f_order(ops, i):
    f = [m for k, m in ops if k == "F"]
    return f[i] if i < len(f) else None


def ops_b_order(ops, i):
    b = [m for k, m in ops if k == "B"]
    return b[i] if i < len(b) else None


def theory_bubble(stages: int, jobs: int) -> float:
    """mLoRA's LoRAPP bubble model max((D - L)/D, 0)."""
    return max((stages - jobs) / stages, 0.0)


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


class _Stage:
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
        self.e.ctx.segments = mb.segments
        cfg = self.e.jobs[pm.job].cfg
        seed = (round_seed("lora-dropout", self.e.run_cfg.seed, cfg.seed, pm.step, m, s)
                if train and cfg.lora_dropout > 0 else None)
        try:
            with torch.set_grad_enabled(train), dropout_rng(seed, self.dev):
                if s == 0:
                    out = self.decoder(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)
                else:
                    if train:
                        x.requires_grad_(True)
                    out = self.decoder(inputs_embeds=x, position_ids=mb.position_ids, use_cache=False)
        finally:
            self.e.ctx.segments = []
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
        if s == P - 1:
            t0 = time.perf_counter()
            self.outs.pop(m).backward()
        else:
            shape = (*pm.mb.input_ids.shape, self.hidden)
            g = self._recv(shape, self.dtype, s + 1, 4 * m + 2)
            meta = self._recv((1,), torch.float64, s + 1, 4 * m + 3)
            self.carry[key] = max(self.carry[key], float(meta[0]))
            t0 = time.perf_counter()
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


class StageEngine(Engine):
    """The engine on one pipeline stage. Its scheduler (:class:`~.scheduler.Scheduler`: evaluation history, ALTO
    early exit, best-validation factors, warm-up parking and top-k; backfill under ``max_active_jobs`` and the
    memory model) runs unchanged; these three hooks feed it numbers that every rank shares, so every rank decides
    identically. ``stage`` is set once this rank's :class:`_Stage` exists."""

    stage: Optional["_Stage"] = None

    def __init__(self, run: RunConfig):
        import torch.distributed as dist

        # Engine.__init__ loads the base through load_base(stage=...): only this stage's layers (load_stage_model)
        self.pipeline_stage = (dist.get_rank(), dist.get_world_size())
        super().__init__(run)
        # what the stage's base load read and holds (load_stage_model's record, its key list left out)
        self.load_stats = {k: v for k, v in getattr(self.model, "stage_load", {}).items() if k != "keys"}
        self.to_save: list = []  # (job, adapter) finished at this boundary: gathered from every stage, then written

    def fits(self, jobs):
        """The memory model on this stage's modules; every rank takes the worst stage's answer."""
        ok, pred = super().fits(jobs)
        over = pred / self.mem_budget if self.mem_budget else 0.0
        t = torch.tensor([over, pred], dtype=torch.float64, device=self.device)
        self.stage.dist.all_reduce(t, op=self.stage.dist.ReduceOp.MAX)
        return bool(t[0] <= 1.0), float(t[1])

    def evaluate(self, jobs):
        """Forward-only pipeline passes over the jobs' validation sets; the last stage's losses on every rank."""
        st = self.stage
        jobs = [j for j in jobs if j.data.val]
        if not jobs:
            return {}
        vstream = []
        for job in jobs:
            for mb in self.microbatches([(job.id, list(range(len(job.data.val))))], split="val"):
                vstream.append(PMB(len(vstream), job.id, -1, mb))  # single-job bins: one job per micro-batch
        st.loss_sums = {}
        for pm in vstream:
            st.forward(pm, {}, train=False)
        st.finish_sends()
        vals = None
        if st.s == st.P - 1:
            vals = {}
            for job in jobs:
                mine = [pm for pm in vstream if pm.job == job.id]
                vsum = sum(st.loss_sums[pm.idx] for pm in mine)
                vals[job.id] = vsum / max(sum(pm.mb.n_targets(job.id) for pm in mine), 1)
        box = [vals]
        st.dist.broadcast_object_list(box, src=st.P - 1)
        return box[0]

    def finish(self, job, reason, write=True):
        """The engine's own (best-validation restore on overfitting/divergence, result row, slot freed) without its
        rank-0 save, which would write only stage 0's layers: the stages' factors are gathered after the decisions."""
        adapter = job.adapter
        rank, self.rank = self.rank, -1
        try:
            super().finish(job, reason, write)
        finally:
            self.rank = rank
        if write and adapter is not None:
            self.to_save.append((job, adapter))


def _build_stream(engine, jobs: list, counts: dict[int, int]) -> tuple[list[PMB], dict, dict]:
    """One segment: ``counts[job.id]`` steps of each job of ``jobs`` (from its current step on), packed into
    single-job micro-batches and interleaved round-robin over the jobs."""
    from .packing import build_microbatch, plan_microbatches

    run = engine.run_cfg
    stream: list[PMB] = []
    step_targets: dict[tuple[int, int], int] = {}
    mbs_in_step: dict[tuple[int, int], int] = {}
    for i in range(max(counts.values(), default=0)):
        for job in jobs:
            if i >= counts[job.id]:
                continue
            k = job.step + i
            idx = job.sampler.next_batch()
            bins = plan_microbatches([(job.id, idx)], lambda j: engine.lengths(j), run.token_budget,
                                     engine.pad_multiple)
            mbs = [build_microbatch(b, lambda j: engine.jobs[j].data.train, engine.pad_id, engine.pad_multiple)
                   for b in bins]
            step_targets[(job.id, k)] = sum(mb.n_targets(job.id) for mb in mbs)
            mbs_in_step[(job.id, k)] = len(mbs)
            job.tokens += sum(len(job.data.train[i]) for i in idx)
            for mb in mbs:
                stream.append(PMB(len(stream), job.id, k, mb))
    return stream, step_targets, mbs_in_step


# -- checkpoints: <output_dir>/pipeline_state/ ----------------------------------------------------------------
STATE_DIR = "pipeline_state"
RUN_STATE = "run_state.pt"  # rank 0: the shared run state (statuses, steps, histories, results, segment counter)


def _stage_file(d: Path, stage: int, segment: int) -> Path:
    return d / f"stage{stage}.seg{segment}.pt"


def _save_checkpoint(engine, dist, stage: int, stages: int, segment: int, stats: dict) -> None:
    """At a segment boundary (collective): every stage writes its jobs' tensors for its layers (LoRA factors, AdamW
    and LR-schedule states, best-validation factors) with the sampler and early-exit states and its statistics
    into ``stage{s}.seg{n}.pt``; after a barrier rank 0 points ``run_state.pt`` at segment n; then each stage drops
    its older files. A crash at any point leaves a run state whose stage files all exist."""
    d = Path(engine.run_cfg.output_dir) / STATE_DIR
    d.mkdir(parents=True, exist_ok=True)
    jobs = {j.name: job_tensor_state(j) for j in engine.jobs if j.adapter is not None}
    atomic_torch_save({"segment": segment, "stage": stage, "stages": stages, "jobs": jobs, "stats": stats},
                      _stage_file(d, stage, segment))
    dist.barrier()
    if stage == 0:
        shared = {"segment": segment, "stages": stages, "round": engine.round, "round_log": engine.round_log,
                  "jobs": {j.name: job_run_state(j) for j in engine.jobs}}
        atomic_torch_save(shared, d / RUN_STATE)
    dist.barrier()
    keep = _stage_file(d, stage, segment)
    for f in d.glob(f"stage{stage}.seg*.pt"):
        if f != keep:
            f.unlink(missing_ok=True)


def _load_checkpoint(engine, dist, stage: int, stages: int) -> Optional[tuple[int, dict]]:
    """With ``resume``: rank 0 reads ``run_state.pt`` and broadcasts it (every rank resumes, or none), each stage
    adds its own file of that segment and the engine's own :func:`.checkpoint.restore` restores the jobs.
    Returns (segment, this stage's statistics) or None."""
    d = Path(engine.run_cfg.output_dir) / STATE_DIR
    box = [None]
    if stage == 0 and engine.run_cfg.resume and (d / RUN_STATE).is_file():
        box[0] = torch.load(d / RUN_STATE, map_location="cpu", weights_only=False)
    dist.broadcast_object_list(box, src=0)
    shared = box[0]
    if shared is None:
        return None
    if shared["stages"] != stages:
        raise EngineError(f"{d / RUN_STATE} was written by a {shared['stages']}-stage pipeline, this run has "
                           f"{stages} stages; resume with the same pipeline_stages or set resume: false")
    mine = torch.load(_stage_file(d, stage, shared["segment"]), map_location="cpu", weights_only=False)
    checkpoint.restore(engine, {"round": shared["round"], "round_log": shared["round_log"], "memory_points": [],
                                "jobs": {n: {**js, **mine["jobs"].get(n, {})} for n, js in shared["jobs"].items()}})
    return shared["segment"], mine["stats"]


def run_pipeline_distributed(run: RunConfig) -> Optional[dict]:
    """Runs the jobs of ``run`` as a LoRAPP pipeline over the ranks of the initialized process group.

    The run proceeds in segments; each segment advances every active job to its next evaluation point (the next
    multiple of its ``eval_every``, its last step, or its warm-up step), streaming all those steps through the
    pipeline with no flush between jobs, then drains it. At the boundary every rank knows the same train and
    validation losses (computed on the last stage, broadcast) and runs the single-process engine's own code on
    them (:meth:`Engine.after_step`: evaluation history, ALTO early exit, best-validation factors, warm-up
    parking and top-k selection; :meth:`Engine.admit`: backfill of freed slots from the queue under
    ``max_active_jobs`` and the memory model, whose prediction is made per stage and the worst stage decides), so
    all ranks decide identically. Finished jobs' factors are gathered and written by rank 0. ``save_every``
    / ``max_rounds`` / ``resume`` work at segment boundaries (see :func:`_save_checkpoint`; a segment counts as
    many rounds as its longest job advanced).

    Rank 0 writes the adapters, results and ``pipeline`` statistics (bubble ratios, each stage's peak GPU memory
    after the split) and returns the results dict; other ranks return None. Every rank must call it at the same
    point (it may create :func:`p2p_groups`).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("run_pipeline_distributed needs an initialized process group (see "
                           "bdlora.train.engine.launch.run_pipeline_spawn)")
    if dist.get_world_size() != run.pipeline_stages:
        raise EngineError(f"pipeline_stages={run.pipeline_stages} but {dist.get_world_size()} processes were launched")
    return PipelineRun(run, dist).run()


class PipelineRun:
    """This rank's part of a LoRAPP run: its :class:`StageEngine` trimmed to the stage's layers, the :class:`_Stage`
    that moves activations and gradients, the run's statistics and segment counter. :meth:`run` goes through the
    run loop the engine uses (:func:`.loop.run_loop`), one segment per advance."""

    def __init__(self, run: RunConfig, dist):
        self.run_cfg, self.dist = run, dist
        self.P, self.s = P, s = dist.get_world_size(), dist.get_rank()
        engine = self.engine = StageEngine(run)
        engine.log = (lambda *a, **k: None) if s else print
        if engine.device.type == "cuda":
            torch.cuda.set_device(engine.device)  # NCCL's groups and the *_object collectives use the current device
        model = engine.model
        decoder = getattr(model, model.base_model_prefix)
        lo, hi = stage_bounds(len(decoder.layers), P)[s]
        # the loaded stage (load_stage_model) holds layers [lo, hi) at their own indices (their LoRA modules are
        # named model.layers.<i>..., as on one process) and placeholders elsewhere: the decoder runs the kept ones only
        kept = nn.ModuleList(list(decoder.layers)[lo:hi])
        if any(isinstance(layer, _OtherStage) for layer in kept):
            raise EngineError(f"pipeline stage {s}: the loaded model does not hold its layers [{lo}, {hi})")
        kept_names = {mod.name for layer in kept for mod in layer.modules() if hasattr(mod, "registry")}
        decoder.layers = kept
        if s < P - 1:
            decoder.norm = nn.Identity()
        engine.targets = {n: t for n, t in engine.targets.items() if n in kept_names}  # jobs are built for this stage
        self.out = Path(run.output_dir)
        if s == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / "run_config.json", "w") as f:
                json.dump(run.to_dict(), f, indent=2, default=str)
        if engine.device.type == "cuda":  # the peak from here on: this stage's layers (the only ones loaded) + activations
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(engine.device)
        self.st = engine.stage = _Stage(engine, s, P, dist, p2p_groups())
        self.stats = {"busy": 0.0, "wall": 0.0, "microbatches": 0, "sim_busy": 0, "sim_slots": 0.0, "max_active": 0}
        self.segment = 0

    def run(self) -> Optional[dict]:
        engine, reporter = self.engine, None
        try:
            resumed = _load_checkpoint(engine, self.dist, self.s, self.P)
            if resumed is not None:
                self.segment, loaded = resumed
                self.stats.update(loaded)
                engine.log(f"[pipeline] resumed from {self.out / STATE_DIR} at segment {self.segment} "
                           f"(round {engine.round})")
            reporter = RunReporter(engine.jobs, self.out, engine.jobs[0].cfg.progress, engine.rank == 0)
            return run_loop(engine, self.advance, self.save, self.write_results, self.stopped, self.ended, reporter)
        finally:  # break the engine <-> stage cycle: nothing may keep this stage's process groups past their destruction
            if reporter is not None:
                reporter.close()
            engine.stage = None
            self.st.fwd_group = self.st.bwd_group = None

    def advance(self, active) -> Advance:
        """One segment: every active job streamed up to its next evaluation point, the pipeline drained, the last
        stage's losses shared, then the scheduler's decisions and the finished jobs' adapters gathered."""
        engine, st, dist, P = self.engine, self.st, self.dist, self.P
        counts = {j.id: engine.scheduler.next_eval_step(j, j.step) - j.step for j in active}
        tokens0 = sum(j.tokens for j in active)
        stream, step_targets, mbs_in_step = _build_stream(engine, active, counts)
        ops, sim_bubble = simulate_schedule(stream, P)
        st.loss_sums = {}
        self.fold_peak()
        engine.reset_peak_memory()
        dist.barrier()
        t0, busy0 = time.perf_counter(), st.busy
        for kind, m in ops[self.s]:
            if kind == "F":
                st.forward(stream[m], step_targets)
            else:
                st.backward(stream[m], mbs_in_step)
        st.finish_sends()
        # drain: every job's last step of the segment; stage 0 knows its total norm; one broadcast, every stage
        # applies it
        vec = torch.tensor([st.norm_total.get(j.id, -1.0) for j in engine.jobs], dtype=torch.float64,
                           device=engine.device)
        dist.broadcast(vec, 0)
        for jid in list(st.pending):
            st.apply(jid, float(vec[jid]))
        engine.observe_memory(active)  # this stage's peak over the segment: every stage at the same boundaries
        t1 = time.perf_counter()
        n_ops = sum(len(o) for o in ops)
        stats = self.stats
        stats["busy"] += st.busy - busy0
        stats["wall"] += t1 - t0
        stats["microbatches"] += len(stream)
        stats["sim_busy"] += n_ops
        stats["sim_slots"] += n_ops / max(1.0 - sim_bubble, 1e-12)
        stats["max_active"] = max(stats["max_active"], len(active))
        # the segment's train losses: the last stage has them; every rank records the same numbers
        losses = None
        if self.s == P - 1:
            sums: dict = defaultdict(float)
            for pm in stream:
                sums[(pm.job, pm.step)] += st.loss_sums[pm.idx]
            losses = {key: v / max(step_targets[key], 1) for key, v in sums.items()}
        box = [losses]
        dist.broadcast_object_list(box, src=P - 1)
        losses = box[0]
        for job in active:  # the engine's per-step bookkeeping
            for _ in range(counts[job.id]):
                record_train_step(job, losses[(job.id, job.step)])
        n_eval = engine.after_step()  # every active job is due: evaluation, early exit, warm-up, completion
        self.save_finished()
        self.segment += 1
        info = {"microbatches": len(stream), "tokens": sum(j.tokens for j in active) - tokens0}
        return Advance(rounds=max(counts.values()), train_s=t1 - t0, info=info, evals=n_eval,
                       log_fields={"segment": self.segment, "jobs": [j.name for j in active],
                                   "bubble_schedule_unit_slots": sim_bubble})

    def save(self) -> None:
        _save_checkpoint(self.engine, self.dist, self.s, self.P, self.segment, self.stats)

    def save_finished(self) -> None:
        """Collective (the list of finished jobs is the same on every rank): each stage's factors of the jobs that
        finished this segment gathered; rank 0 writes their adapters and plots."""
        engine, to_save = self.engine, self.engine.to_save
        if not to_save:
            return
        mine = {job.id: ad.to_adapter().modules for job, ad in to_save}  # {path: LoraFactors} of this stage
        gathered = [None] * self.P
        self.dist.all_gather_object(gathered, mine)
        if self.s == 0:
            for job, _ in to_save:
                modules = {n: f for g in gathered for n, f in g[job.id].items()}
                adapter = Adapter(AdapterConfig.from_spec(job.cfg.spec(engine.model_type), engine.base_id), modules)
                if adapter_is_finite(adapter, job.name, engine.log):
                    save_adapter(adapter, job.adapter_path)
                else:
                    job.adapter_path = job.result["adapter"] = None
                if self.run_cfg.save_plots:
                    plot_job(job, self.out / "plots" / f"{job.name}.png")
        to_save.clear()

    def fold_peak(self) -> None:
        """The stage's whole-run peak, kept across the memory model's per-segment resets."""
        if self.engine.device.type == "cuda":
            self.stats["peak_mem_bytes"] = max(self.stats.get("peak_mem_bytes", 0),
                                               torch.cuda.max_memory_allocated(self.engine.device))

    def write_results(self) -> Optional[dict]:
        """Collective (the statistics of every stage); rank 0 writes the results and returns them."""
        engine = self.engine
        self.fold_peak()
        payload = {"busy": self.stats["busy"], "wall": self.stats["wall"],
                   "peak_mem_gib": self.stats["peak_mem_bytes"] / 2**30 if engine.device.type == "cuda" else None,
                   "memory_points": len(engine.memory.points), "memory_fitted": engine.memory.fitted,
                   "load": engine.load_stats}
        gathered = [None] * self.P
        self.dist.all_gather_object(gathered, payload)
        if self.s != 0:
            return None
        return _write_results(engine, self.out, gathered, self.stats)

    def stopped(self, rounds: int) -> Optional[dict]:
        result = self.write_results()
        self.engine.log(f"[pipeline] stopped after {rounds} rounds (max_rounds, segment {self.segment}); run again "
                        "to resume")
        return result

    def ended(self) -> Optional[dict]:
        result = self.write_results()
        if result is not None:
            st_ = result["pipeline"]
            print(format_table(result["jobs"]))
            print(f"[pipeline] {self.P} stages, {len(self.engine.jobs)} jobs, {self.segment} segments, "
                  f"{st_['microbatches']} micro-batches: measured bubble {st_['bubble_measured']:.3f} (per stage "
                  f"{[round(b, 3) for b in st_['bubble_measured_per_stage']]}), schedule "
                  f"{st_['bubble_schedule_unit_slots']:.3f}, theory max((D-L)/D,0) = "
                  f"{st_['bubble_theory_max_D_minus_L_over_D']:.3f}")
        return result


def _write_results(engine, out: Path, gathered: list[dict], stats: dict) -> dict:
    """Rank 0: results.csv and results.json (rows, per-job train losses, segments, pipeline statistics)."""
    P = len(gathered)
    rows = result_rows(engine.jobs)
    stage_bubbles = [1.0 - g["busy"] / g["wall"] if g["wall"] > 0 else 0.0 for g in gathered]
    pstats = {
        "stages": P, "jobs": len(engine.jobs), "microbatches": stats["microbatches"],
        "segments": sum(1 for r in engine.round_log if "segment" in r),
        "bubble_measured": sum(stage_bubbles) / P, "bubble_measured_per_stage": stage_bubbles,
        "bubble_schedule_unit_slots": (1.0 - stats["sim_busy"] / stats["sim_slots"]) if stats["sim_slots"] else 0.0,
        "bubble_theory_max_D_minus_L_over_D": theory_bubble(P, max(stats["max_active"], 1)),
        "wall_s": stats["wall"], "peak_mem_gib_per_stage": [g["peak_mem_gib"] for g in gathered],
        # the memory model's measured peaks (one per segment on GPUs) and whether they refitted it (every 5 points)
        "memory_points_per_stage": [g["memory_points"] for g in gathered],
        "memory_fitted_per_stage": [g["memory_fitted"] for g in gathered],
        # each stage's base load (load_stage_model): its layers, the bytes it read from the safetensors files and
        # holds as parameters, the checkpoint's total, and (CPU, Linux) its peak RSS growth over the load
        "load_per_stage": [g["load"] for g in gathered],
    }
    write_results_csv(out, rows)
    result = {"jobs": rows, "train_losses": {j.name: [l for _, l in j.history["train"]] for j in engine.jobs},
              "rounds": engine.round_log, "pipeline": pstats}
    with open(out / "results.json", "w") as f:
        json.dump(result, f, indent=2)
    return result


__all__ = ["PMB", "init_distributed", "p2p_groups", "run_pipeline_distributed",
           "simulate_schedule", "stage_bounds", "theory_bubble"]
