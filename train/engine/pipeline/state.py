"""The pipeline's checkpoints, written at segment boundaries under ``<output_dir>/pipeline_state/``: one file per
stage (its layers' factors and optimizer states) and rank 0's shared run state pointing at the segment."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from .. import checkpoint
from ..checkpoint import atomic_torch_save
from ..jobs import job_run_state, job_tensor_state
from ..scheduler import EngineError

STATE_DIR = "pipeline_state"
RUN_STATE = "run_state.pt"  # rank 0: the shared run state (statuses, steps, histories, results, segment counter)


def _stage_file(d: Path, stage: int, segment: int) -> Path:
    return d / f"stage{stage}.seg{segment}.pt"


def save_checkpoint(engine, dist, stage: int, stages: int, segment: int, stats: dict) -> None:
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
                  "token_budget": engine.token_budget, "jobs": {j.name: job_run_state(j) for j in engine.jobs}}
        atomic_torch_save(shared, d / RUN_STATE)
    dist.barrier()
    keep = _stage_file(d, stage, segment)
    for f in d.glob(f"stage{stage}.seg*.pt"):
        if f != keep:
            f.unlink(missing_ok=True)


def load_checkpoint(engine, dist, stage: int, stages: int) -> Optional[tuple[int, dict]]:
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
                                "token_budget": shared.get("token_budget"),
                                "jobs": {n: {**js, **mine["jobs"].get(n, {})} for n, js in shared["jobs"].items()}})
    return shared["segment"], mine["stats"]



__all__ = ["RUN_STATE", "STATE_DIR", "load_checkpoint", "save_checkpoint"]
