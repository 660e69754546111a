"""What the engine decides between steps: which queued jobs enter (admission under ``max_active_jobs`` and the
memory model), when a job is evaluated, and what its losses mean (ALTO early exit, completion, warm-up parking and
top-k selection per group). The same decisions drive the single-process engine and every pipeline stage.

The scheduler decides; the engine it is given carries the decisions out through its public hooks: ``fits(jobs)``
(the memory model's answer), ``activate`` / ``park`` / ``finish`` (a job's state and its adapter) and
``evaluate(jobs)`` (validation losses). A pipeline stage overrides those hooks to share numbers across stages, so
every rank decides identically."""

from __future__ import annotations

from bdlora.spec import BDLoraError

from .early_exit import UNDERPERFORMING, select_after_warmup


class EngineError(BDLoraError):
    """A run that cannot go on (jobs the memory budget can never admit); the message says what to change."""


def admission_order(jobs) -> list:
    """Queued jobs in the order admission takes them: higher priority first, file order within a priority."""
    return sorted(jobs, key=lambda j: (-j.cfg.priority, j.id))


class Scheduler:
    def __init__(self, engine):
        self.engine = engine
        self.run_cfg = engine.run_cfg
        self.jobs = engine.jobs
        self.group_sizes: dict[str, int] = {}
        for j in self.jobs:
            self.group_sizes[j.cfg.group] = self.group_sizes.get(j.cfg.group, 0) + 1

    def active_jobs(self) -> list:
        return [j for j in self.jobs if j.status == "active"]

    # -- admission -----------------------------------------------------------------------------------------------
    def admit(self) -> None:
        """Backfills free slots: survivors of a warm-up selection first, then the queue by priority (file order
        within a priority), while ``max_active_jobs`` and the memory model allow; a job that cannot fit even alone
        is refused with a message."""
        eng = self.engine
        cands = [j for j in self.jobs if j.status == "parked" and j.warm_done]
        cands += admission_order(j for j in self.jobs if j.status == "queued")
        for job in cands:
            active = self.active_jobs()
            if len(active) >= self.run_cfg.max_active_jobs:
                break
            ok_alone, pred_alone = eng.fits([job])
            if not ok_alone:
                msg = (f"refused: needs ~{pred_alone / 2**30:.2f} GiB alone (memory model) but the budget is "
                       f"{eng.mem_budget / 2**30:.2f} GiB; lower its r, max_length or the token_budget, or raise "
                       "memory_budget_gb (the model's estimate is generous)")
                eng.log(f"[engine] job {job.name}: {msg}")
                eng.finish(job, msg, write=False)
                continue
            ok, _ = eng.fits(active + [job])
            if not ok:
                break  # wait for a slot; FCFS within priority
            eng.activate(job)

    def admit_next(self) -> list:
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

    # -- evaluation points ---------------------------------------------------------------------------------------
    def warmup_applies(self, job) -> bool:
        ee = self.run_cfg.early_exit
        return (ee.enabled and ee.warmup_select and self.group_sizes.get(job.cfg.group, 1) > 1
                and job.warm_steps is not None and job.warm_steps < job.total_steps)

    def next_eval_step(self, job, after: int) -> int:
        """The first step after ``after`` at which the job is evaluated: the next multiple of its ``eval_every``, its
        last step, or its warm-up step when warm-up selection applies."""
        every = job.cfg.eval_every  # 0: at the end only (and at the warm-up step)
        due = [job.total_steps] + ([(after // every + 1) * every] if every else [])
        if self.warmup_applies(job) and job.warm_steps > after:
            due.append(job.warm_steps)
        return min(due)

    def eval_due(self, job) -> bool:
        return job.step >= job.total_steps or self.next_eval_step(job, job.step - 1) == job.step

    # -- decisions after a step ----------------------------------------------------------------------------------
    def after_step(self) -> int:
        """Evaluations, early exit, warm-up parking and selection after a round; returns #jobs evaluated."""
        eng = self.engine
        jobs = self.active_jobs()
        due = [j for j in jobs if self.eval_due(j)]
        vals = eng.evaluate(due) if due else {}
        for job in jobs:
            if job.id in vals:
                v = vals[job.id]
                job.history["val"].append((job.step, v))
                job.detector.report(job.step, v)
                if job.detector.is_best_latest:
                    job.best_state = {k: t.detach().cpu().clone() for k, t in job.adapter.state_dict().items()}
            if job.detector.should_stop():
                eng.finish(job, job.detector.reason)
            elif job.step >= job.total_steps:
                eng.finish(job, "completed")
            elif self.warmup_applies(job) and job.step == job.warm_steps and not job.warm_done:
                job.warm_val = vals.get(job.id, job.history["train"][-1][1])
                eng.park(job)
        self.select_warmup()
        return len(vals)

    def select_warmup(self) -> None:
        """Once every member of a group has reached its warm-up step: keep the top ``keep_ratio`` by warm-up loss,
        finish the others as underperforming."""
        groups: dict[str, list] = {}
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
                self.engine.finish(self.jobs[jid], UNDERPERFORMING)
            self.engine.log(f"[engine] warm-up selection in group {g!r}: kept "
                            f"{[self.jobs[k].name for k in kept]}, evicted {len(evicted)}")


__all__ = ["EngineError", "Scheduler", "admission_order"]
