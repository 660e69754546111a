"""The engine's run state on disk: ``engine_state.pt`` (round, every job's run and tensor state, the round log and the
memory model's measured points), written atomically by rank 0 and read back into a fresh engine, so that a run killed
at any point resumes bit-identically. The pipeline keeps its own files per stage (:mod:`.pipeline`) and restores
through the same :func:`restore`."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .jobs import JOB_RUN_FIELDS, job_run_state, job_tensor_state

CHECKPOINT = "engine_state.pt"


def atomic_torch_save(obj, path: Path) -> None:
    """torch.save to a temp file renamed into place: a crash leaves the old file or the new one, never half."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save(engine) -> None:
    """Rank 0 writes the run state of ``engine`` to ``output_dir/engine_state.pt``."""
    if engine.rank != 0:
        return
    jobs = {j.name: {**job_run_state(j), **job_tensor_state(j)} for j in engine.jobs}
    state = {"round": engine.round, "jobs": jobs, "round_log": engine.round_log,
             "memory_points": engine.memory.points, "token_budget": engine.token_budget}
    engine.out.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(state, engine.out / CHECKPOINT)


def load(engine, path) -> None:
    restore(engine, torch.load(path, map_location="cpu", weights_only=False))


def restore(engine, state: dict) -> None:
    """Run and job state from a checkpoint's dict (:func:`save`'s layout) into ``engine``: each job with tensors is
    rebuilt (:meth:`Engine.build_job`) and loaded; jobs the checkpoint does not know stay queued."""
    engine.round = state["round"]
    engine.round_log = state.get("round_log", [])
    engine.memory.points = state.get("memory_points", [])
    if engine.run_cfg.token_budget == "auto" and state.get("token_budget"):
        # the budget the run started with: micro-batches (and so the numerics) stay those of the interrupted run
        engine.token_budget = state["token_budget"]
    for j in engine.jobs:
        s = state["jobs"].get(j.name)
        if s is None:
            continue  # a job added to the run file after the checkpoint: queued
        for k in JOB_RUN_FIELDS:
            setattr(j, k, s[k])
        if "adapter" in s:
            engine.build_job(j)
            j.adapter.load_state_dict(s["adapter"])
            j.opt.load_state_dict(s["opt"])
            j.sched.load_state_dict(s["sched"])
            j.sampler.load_state_dict(s["sampler"])
            j.detector.load_state_dict(s["detector"])
            j.best_state = s["best_state"]
            if j.status == "active":
                engine.registry[j.id] = j.adapter
        j.history = {k: [tuple(x) for x in v] for k, v in j.history.items()}


__all__ = ["CHECKPOINT", "atomic_torch_save", "load", "restore", "save"]
