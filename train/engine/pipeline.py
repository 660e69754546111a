"""LoRAPP (mLoRA, paper 000 §3.2): the frozen base split into P pipeline stages on P processes; the micro-batches
of different jobs fill the pipeline with no flush between jobs.

* Stage s holds decoder layers ``[lo_s, hi_s)`` (embeddings on stage 0, final norm + LM head on the last) and the
  LoRA factors, optimizers and schedules of every job for the modules of those layers.
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
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from bdlora.adapter import Adapter, AdapterConfig, save_adapter

from .config import RunConfig
from .multilora import dropout_rng, round_seed
from .packing import MicroBatch


def stage_bounds(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """Even split of ``n_layers`` decoder layers into ``stages`` contiguous ranges (earlier stages get extras)."""
    if stages > n_layers:
        raise ValueError(f"{stages} pipeline stages but the model has only {n_layers} decoder layers")
    base, extra = divmod(n_layers, stages)
    out, lo = [], 0
    for s in range(stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


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


_P2P_GROUPS: list = []  # [(the default group they were made in, (forward group, backward group))]


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
    if not (_P2P_GROUPS and _P2P_GROUPS[0][0] is world):
        ranks = list(range(dist.get_world_size()))
        pair = (dist.new_group(ranks, timeout=timeout), dist.new_group(ranks, timeout=timeout))
        _P2P_GROUPS[:] = [(world, pair)]
    return _P2P_GROUPS[0][1]


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


def _build_stream(engine) -> tuple[list[PMB], dict, dict]:
    """Every job's steps packed into single-job micro-batches, interleaved round-robin over jobs."""
    from .packing import build_microbatch, plan_microbatches

    run = engine.run_cfg
    stream: list[PMB] = []
    step_targets: dict[tuple[int, int], int] = {}
    mbs_in_step: dict[tuple[int, int], int] = {}
    longest = max(j.total_steps for j in engine.jobs)
    for k in range(longest):
        for job in engine.jobs:
            if k >= job.total_steps:
                continue
            idx = job.sampler.next_batch()
            bins = plan_microbatches([(job.id, idx)], lambda j: engine._lengths(j), run.token_budget,
                                     engine.pad_multiple)
            mbs = [build_microbatch(b, lambda j: engine.jobs[j].data.train, engine.pad_id, engine.pad_multiple)
                   for b in bins]
            step_targets[(job.id, k)] = sum(mb.n_targets(job.id) for mb in mbs)
            mbs_in_step[(job.id, k)] = len(mbs)
            job.tokens += sum(len(job.data.train[i]) for i in idx)
            for mb in mbs:
                stream.append(PMB(len(stream), job.id, k, mb))
    return stream, step_targets, mbs_in_step


def run_pipeline_distributed(run: RunConfig) -> Optional[dict]:
    """Runs the jobs of ``run`` as a LoRAPP pipeline over the ranks of the initialized process group.

    Fixed job set (no admission queue or early exit in pipeline mode). Rank 0 writes the adapters, results and
    ``pipeline`` statistics (bubble ratios, each stage's peak GPU memory after the split) and returns the results
    dict; other ranks return None. Every rank must call it at the same point (it may create :func:`p2p_groups`).
    """
    import torch.distributed as dist

    from .engine import Engine, format_table, plot_job, RESULT_FIELDS

    if not dist.is_initialized():
        raise RuntimeError("run_pipeline_distributed needs an initialized process group (see run_pipeline_spawn)")
    P, s = dist.get_world_size(), dist.get_rank()
    if P != run.pipeline_stages:
        raise RuntimeError(f"pipeline_stages={run.pipeline_stages} but {P} processes were launched")
    engine = Engine(run)
    engine.log = (lambda *a, **k: None) if s else print
    if engine.device.type == "cuda":
        torch.cuda.set_device(engine.device)  # NCCL's groups and the *_object collectives use the current device
    model = engine.model
    decoder = getattr(model, model.base_model_prefix)
    n_layers = len(decoder.layers)
    lo, hi = stage_bounds(n_layers, P)[s]
    kept = nn.ModuleList(list(decoder.layers)[lo:hi])
    kept_names = {mod.name for layer in kept for mod in layer.modules() if hasattr(mod, "registry")}
    decoder.layers = kept
    if s < P - 1:
        decoder.norm = nn.Identity()
    engine.targets = {n: t for n, t in engine.targets.items() if n in kept_names}
    for job in engine.jobs:
        engine._build(job)
        engine.registry[job.id] = job.adapter
        job.status = "active"
    if engine.device.type == "cuda":  # the peak from here on: this stage's layers (the others' are freed) + activations
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(engine.device)
    stream, step_targets, mbs_in_step = _build_stream(engine)
    ops, sim_bubble = simulate_schedule(stream, P)
    st = _Stage(engine, s, P, dist, p2p_groups())
    dist.barrier()
    t_start = time.perf_counter()
    for kind, m in ops[s]:
        if kind == "F":
            st.forward(stream[m], step_targets)
        else:
            st.backward(stream[m], mbs_in_step)
    st.finish_sends()
    wall = time.perf_counter() - t_start
    # the last step of every job: stage 0 knows its total norm; one broadcast, then every stage applies it
    vec = torch.tensor([st.norm_total.get(j.id, -1.0) for j in engine.jobs], dtype=torch.float64,
                       device=engine.device)
    dist.broadcast(vec, 0)
    for jid in list(st.pending):
        st.apply(jid, float(vec[jid]))
    # final evaluation: forward-only passes over every job's validation set
    val_stream = []
    for job in engine.jobs:
        if job.data.val:
            for mb in engine._microbatches([(job.id, list(range(len(job.data.val))))], split="val"):
                # single-job bins (one request), so each micro-batch belongs to this job only
                val_stream.append(PMB(len(val_stream), job.id, -1, mb))
    st.loss_sums_train = dict(st.loss_sums)
    st.loss_sums = {}
    for pm in val_stream:
        st.forward(pm, {}, train=False)
    st.finish_sends()
    # gather: train/val loss sums (last stage), factors (all stages), timings
    payload = {
        "train": st.loss_sums_train, "val": st.loss_sums, "busy": st.busy, "wall": wall,
        "peak_mem_gib": (torch.cuda.max_memory_allocated(engine.device) / 2**30
                         if engine.device.type == "cuda" else None),
        "factors": {j.id: {n: (f.lora_A, f.lora_B, f.layout) for n, f in j.adapter.to_adapter().modules.items()}
                    for j in engine.jobs},
    }
    gathered = [None] * P
    dist.all_gather_object(gathered, payload)
    if s != 0:
        return None
    last = gathered[-1]
    out = Path(run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, losses = [], {}
    for job in engine.jobs:
        hist = []
        for k in range(job.total_steps):
            tot = sum(last["train"][pm.idx] for pm in stream if pm.job == job.id and pm.step == k)
            hist.append((k + 1, tot / max(step_targets[(job.id, k)], 1)))
        job.history["train"] = hist
        job.step = job.total_steps
        vmbs = [pm for pm in val_stream if pm.job == job.id]
        if vmbs:
            vsum = sum(last["val"][pm.idx] for pm in vmbs)
            vcnt = sum(pm.mb.n_targets(job.id) for pm in vmbs)
            job.history["val"] = [(job.total_steps, vsum / max(vcnt, 1))]
        modules = {}
        for g in gathered:
            for n, (a, b, layout) in g["factors"][job.id].items():
                from bdlora.adapter import LoraFactors

                modules[n] = LoraFactors(a, b, layout)
        job.adapter_path = str(out / "adapters" / job.name)
        save_adapter(Adapter(AdapterConfig.from_spec(job.cfg.spec(engine.model_type), engine.base_path), modules),
                     job.adapter_path)
        job.status, job.reason, job.time_s = "done", "completed", wall
        if run.save_plots:
            plot_job(job, out / "plots" / f"{job.name}.png")
        rows.append(engine._result_row(job))
        losses[job.name] = [l for _, l in hist]
    stage_bubbles = [1.0 - g["busy"] / g["wall"] if g["wall"] > 0 else 0.0 for g in gathered]
    stats = {
        "stages": P, "jobs": len(engine.jobs), "microbatches": len(stream),
        "bubble_measured": sum(stage_bubbles) / P, "bubble_measured_per_stage": stage_bubbles,
        "bubble_schedule_unit_slots": sim_bubble, "bubble_theory_max_D_minus_L_over_D": theory_bubble(P, len(engine.jobs)),
        "wall_s": wall, "peak_mem_gib_per_stage": [g["peak_mem_gib"] for g in gathered],
    }
    import csv

    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in RESULT_FIELDS})
    result = {"jobs": rows, "train_losses": losses, "pipeline": stats}
    with open(out / "results.json", "w") as f:
        json.dump(result, f, indent=2)
    print(format_table(rows))
    print(f"[pipeline] {P} stages, {len(engine.jobs)} jobs, {len(stream)} micro-batches: measured bubble "
          f"{stats['bubble_measured']:.3f} (per stage {[round(b, 3) for b in stage_bubbles]}), schedule "
          f"{sim_bubble:.3f}, theory max((D-L)/D,0) = {stats['bubble_theory_max_D_minus_L_over_D']:.3f}")
    return result


def run_pipeline_spawn(run: RunConfig, backend: Optional[str] = None) -> dict:
    """Spawns ``run.pipeline_stages`` local processes (gloo on CPU, NCCL with enough GPUs) and runs the pipeline."""
    from .__main__ import spawn

    spawn(run, run.pipeline_stages, backend)
    with open(Path(run.output_dir) / "results.json") as f:
        return json.load(f)


__all__ = ["PMB", "init_distributed", "p2p_groups", "run_pipeline_distributed", "run_pipeline_spawn",
           "simulate_schedule", "stage_bounds", "theory_bubble"]
