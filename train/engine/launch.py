"""Launching the engine: a parsed run in this process, in locally spawned processes, or as one rank of a launcher
(accelerate / torchrun). Imported by ``__main__`` (the CLI) and by tests; it imports the engine and the pipeline,
never the other way round (no import cycle).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .config import RunConfig


def init_from_env():
    """Process group from the launcher's environment (accelerate/torchrun); gloo on CPU, NCCL on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    import torch
    import torch.distributed as dist

    from .pipeline import init_distributed

    if not dist.is_initialized():
        init_distributed("nccl" if torch.cuda.is_available() else "gloo", int(os.environ.get("LOCAL_RANK", 0)))
    return dist


def run_engine(run, model=None, tokenizer=None):
    """Runs a parsed :class:`RunConfig`: BatchLoRA engine, or the LoRAPP pipeline when ``pipeline_stages > 1``."""
    if run.pipeline_stages > 1:
        import torch.distributed as dist

        from .pipeline import run_pipeline_distributed

        if dist.is_available() and dist.is_initialized():
            return run_pipeline_distributed(run)  # launched with one process per stage
        return run_pipeline_spawn(run)  # single launch: spawn the stages locally
    from .engine import Engine

    return Engine(run, model=model, tokenizer=tokenizer).run()


def _spawn_worker(rank: int, run, world: int, port: int, backend: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from .pipeline import init_distributed

    init_distributed(backend, rank, rank=rank, world_size=world)
    try:
        run_engine(run)
        dist.barrier()  # no rank tears its group down while another still talks to it
    finally:
        dist.destroy_process_group()


def _spawn_process(rank: int, run, world: int, port: int, backend: str) -> None:
    """``mp.spawn``'s entry: one rank, then, outputs written (atomically) and the group joined, leave without the
    interpreter's teardown, where a gloo thread still releasing buffers aborted a finished rank ("terminate called
    without an active exception")."""
    _spawn_worker(rank, run, world, port, backend)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(run, nprocs: int, backend=None) -> None:
    """Runs ``run`` on ``nprocs`` local processes (data parallel, or pipeline stages when pipeline_stages > 1)."""
    import socket

    import torch
    import torch.multiprocessing as mp

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_spawn_process, args=(run, nprocs, port, backend), nprocs=nprocs, join=True)


def run_pipeline_spawn(run: RunConfig, backend: Optional[str] = None) -> dict:
    """Spawns ``run.pipeline_stages`` local processes (gloo on CPU, NCCL with enough GPUs) and runs the pipeline."""
    check_stage_gpus(run)
    spawn(run, run.pipeline_stages, backend)
    with open(Path(run.output_dir) / "results.json") as f:
        return json.load(f)


def check_stage_gpus(run) -> None:
    """A pipeline on GPUs runs one stage per GPU: fewer GPUs than stages is refused before any process starts
    (stage k would ask for GPU k and fail inside a spawned process)."""
    import torch

    from .config import ConfigError
    from .jobs import run_source

    if run.device not in ("auto", "cuda") or not torch.cuda.is_available():
        return
    n = torch.cuda.device_count()
    if n < run.pipeline_stages:
        raise ConfigError(f"{run_source(run)}: pipeline_stages: {run.pipeline_stages} runs one stage per GPU, but "
                          f"this machine has {n} GPU(s): set pipeline_stages to at most {n} (1: the whole base on "
                          "one GPU)")


def every_job_refused(output_dir) -> Optional[str]:
    """The reason when the memory model refused every job of a finished run (nothing trained, no adapter written),
    else None: the run's results.json (rank 0's, either mode)."""
    path = Path(output_dir) / "results.json"
    if not path.is_file():
        return None
    rows = json.loads(path.read_text()).get("jobs", [])
    reasons = [str(r.get("stop_reason") or "") for r in rows]
    if rows and all(x.startswith("refused") for x in reasons):
        return (f"every job was refused, nothing trained: {reasons[0]} ({len(rows)} job(s); "
                f"{path.parent}/results.csv lists them)")
    return None


__all__ = ["check_stage_gpus", "every_job_refused", "init_from_env", "run_engine", "run_pipeline_spawn", "spawn"]
