"""``python -m bdlora.train.engine --config run.yaml`` (also under ``accelerate launch`` / ``torchrun``)."""

from __future__ import annotations

import argparse
import os
import sys


def _init_distributed():
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

        from .pipeline import run_pipeline_distributed, run_pipeline_spawn

        if dist.is_available() and dist.is_initialized():
            return run_pipeline_distributed(run)  # launched with one process per stage
        return run_pipeline_spawn(run)  # single launch: spawn the stages locally
    from .engine import Engine

    return Engine(run, model=model, tokenizer=tokenizer).run()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bdlora.train.engine", description=__doc__)
    ap.add_argument("--config", required=True, help="YAML run file")
    ap.add_argument("--output-dir", help="override output_dir")
    ap.add_argument("--max-rounds", type=int, help="stop (resumably) after this many rounds")
    ap.add_argument("--no-resume", action="store_true", help="ignore an existing run checkpoint")
    args = ap.parse_args(argv)
    from .config import ConfigError, load_run

    try:
        run = load_run(args.config)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output_dir:
        run.output_dir = args.output_dir
    if args.max_rounds is not None:
        run.max_rounds = args.max_rounds
    if args.no_resume:
        run.resume = False
    dist = _init_distributed()
    try:
        run_engine(run)
    finally:
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()
    return 0


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
    finally:
        dist.destroy_process_group()


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
    mp.spawn(_spawn_worker, args=(run, nprocs, port, backend), nprocs=nprocs, join=True)


if __name__ == "__main__":
    sys.exit(main())
