"""A LoRAPP run on this rank: :class:`StageEngine` (the engine's scheduler on one stage's layers) and
:class:`PipelineRun` (segments through the engine's run loop, checkpoints, results)."""

from __future__ import annotations

import gc
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from bdlora.adapter import Adapter, AdapterConfig, save_adapter

from ..config import RunConfig
from ..engine import Engine
from ..jobs import adapter_is_finite, record_train_step
from ..loop import Advance, run_loop
from ..model import _OtherStage, stage_bounds
from ..reporting import RunReporter, format_table, plot_job, result_rows, write_results_csv
from ..scheduler import EngineError
from .schedule import PMB, build_stream, simulate_schedule, theory_bubble
from .stage import Stage, p2p_groups
from .state import STATE_DIR, load_checkpoint, save_checkpoint


class StageEngine(Engine):
    """The engine on one pipeline stage. Its scheduler (:class:`~.scheduler.Scheduler`: evaluation history, ALTO
    early exit, best-validation factors, warm-up parking and top-k; backfill under ``max_active_jobs`` and the
    memory model) runs unchanged; these three hooks feed it numbers that every rank shares, so every rank decides
    identically. ``stage`` is set once this rank's :class:`Stage` exists."""

    stage: Optional["Stage"] = None

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
    """This rank's part of a LoRAPP run: its :class:`StageEngine` trimmed to the stage's layers, the :class:`Stage`
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
        self.st = engine.stage = Stage(engine, s, P, dist, p2p_groups())
        self.stats = {"busy": 0.0, "wall": 0.0, "microbatches": 0, "sim_busy": 0, "sim_slots": 0.0, "max_active": 0}
        self.segment = 0

    def run(self) -> Optional[dict]:
        engine, reporter = self.engine, None
        try:
            resumed = load_checkpoint(engine, self.dist, self.s, self.P)
            if resumed is not None:
                self.segment, loaded = resumed
                self.stats.update(loaded)
                engine.log(f"[pipeline] resumed from {self.out / STATE_DIR} at segment {self.segment} "
                           f"(round {engine.round})")
            engine.log(f"[pipeline] token budget {engine.token_budget} tokens per micro-batch"
                       + (" (auto)" if engine.run_cfg.token_budget == "auto" else "")
                       + (f"; {engine.checkpointed_layers} of stage 0's decoder layers recompute in backward"
                          if engine.checkpointed_layers else ""))
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
        stream, step_targets, mbs_in_step = build_stream(engine, active, counts)
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
        save_checkpoint(self.engine, self.dist, self.s, self.P, self.segment, self.stats)

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
              "rounds": engine.round_log, "token_budget": engine.token_budget, "pipeline": pstats}
    with open(out / "results.json", "w") as f:
        json.dump(result, f, indent=2)
    return result


__all__ = ["PipelineRun", "StageEngine", "run_pipeline_distributed"]
