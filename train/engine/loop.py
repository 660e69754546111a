"""The run loop shared by the engine and the pipeline: admit, advance the active jobs, decide, account, report,
checkpoint, until no job is left or ``max_rounds`` is reached.

What one advance is differs: the engine trains one round (every active job one step) and the pipeline one segment
(every active job up to its next evaluation point, streamed through the stages); both then run the scheduler's
decisions. The loop keeps the accounting that follows identical: each job's time, the round log, progress lines,
``save_every`` (a checkpoint whenever a multiple of it is passed, or a job finished) and ``max_rounds``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..attention import packed_attention, sdpa_backends


@dataclass
class Advance:
    """What one advance did: ``rounds`` it counts as (a segment: as many as its longest job advanced), its training
    time, ``info`` (``microbatches``, ``tokens``) and the extra fields of its round-log entry."""

    rounds: int
    train_s: float
    info: dict
    evals: int
    log_fields: dict = field(default_factory=dict)


def run_loop(engine, advance: Callable[[list], Advance], save: Callable[[], None], write_results: Callable,
             on_stop: Callable, on_end: Callable, reporter):
    """Runs ``engine``'s jobs to the end: ``advance(active)`` per step, ``save()`` by ``save_every``,
    ``write_results()`` when a job finished; returns ``on_stop(rounds)`` after ``max_rounds`` rounds of this call,
    else ``on_end()``. Attention runs with the kernels ``cudnn_attention`` allows, packed example by example where
    ``engine.packed_attention`` (train/attention.py)."""
    with sdpa_backends(engine.run_cfg.cudnn_attention), packed_attention(engine.model, engine.packed_attention):
        return _run_rounds(engine, advance, save, write_results, on_stop, on_end, reporter)


def _run_rounds(engine, advance, save, write_results, on_stop, on_end, reporter):
    run = engine.run_cfg
    rounds_this_call = 0
    while True:
        active = engine.scheduler.admit_next()
        if not active:
            break
        t0 = time.perf_counter()
        step = advance(active)
        dt = time.perf_counter() - t0
        for j in active:
            j.time_s += dt
            if j.result is not None:  # finished this step: its row was made before the time was added
                j.result["time_s"] = round(j.time_s, 3)
        prev_round = engine.round
        engine.round += step.rounds
        rounds_this_call += step.rounds
        engine.round_log.append({"round": engine.round, **step.log_fields, "time_s": dt, "train_s": step.train_s,
                                 "tokens": step.info["tokens"], "microbatches": step.info["microbatches"],
                                 "active": len(active), "evals": step.evals})
        reporter.after_round()
        if run.log_every and engine.round // run.log_every > prev_round // run.log_every:
            engine.log_progress(active, step.info)
        finished_now = any(j.status == "done" for j in active)
        every = run.save_every
        saved = bool(every and (engine.round // every > prev_round // every or finished_now))
        if saved:
            save()
        if finished_now:
            write_results()
        if run.max_rounds is not None and rounds_this_call >= run.max_rounds:
            if not saved:
                save()
            return on_stop(rounds_this_call)
    save()
    return on_end()


__all__ = ["Advance", "run_loop"]
