"""``bdlora sweep --config run.yaml`` = ``python -m bdlora.train.engine --config run.yaml`` (also under ``accelerate
launch`` / ``torchrun``)."""

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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bdlora sweep", description=(
        "Train many BD-LoRA adapters on one frozen base (the multi-LoRA engine). The run file uses the keys of "
        "`bdlora train`: top-level keys are every job's defaults, `jobs:` / `search:` add jobs; a `bdlora train` "
        "job file runs unchanged as a one-job sweep. See --print-config."))
    ap.add_argument("--config", help="YAML run file (or a bdlora train job file)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a top-level key (value read as YAML), e.g. --set lr=1e-4; repeatable")
    ap.add_argument("--print-config", action="store_true", help="print every key with its default and help")
    ap.add_argument("--output-dir", help="override output_dir")
    ap.add_argument("--max-rounds", type=int, help="stop (resumably) after this many rounds")
    ap.add_argument("--no-resume", action="store_true", help="start fresh even when the file says resume: auto")
    return ap


def main(argv=None) -> int:
    """``bdlora sweep``: 0 on success; 2 with ``bdlora sweep: error: <message>`` on a bad run file, data file or
    model (no traceback)."""
    args = build_parser().parse_args(argv)
    from bdlora.models import ModelNotFound
    from bdlora.spec import BDLoraError
    from bdlora.train.config import parse_override

    from .config import describe_run_keys, load_run

    if args.print_config:
        print(describe_run_keys(), end="")
        return 0
    if not args.config:
        print("bdlora sweep: error: --config run.yaml is required (see --print-config)", file=sys.stderr)
        return 2
    dist = None
    try:
        overrides = dict(parse_override(s) for s in args.set)
        if args.output_dir:
            overrides["output_dir"] = args.output_dir
        run = load_run(args.config, overrides)
        if args.max_rounds is not None:
            if args.max_rounds < 1:
                raise BDLoraError(f"--max-rounds must be >= 1, got {args.max_rounds}")
            run.max_rounds = args.max_rounds
        if args.no_resume:
            run.resume = False
        dist = _init_distributed()
        run_engine(run)
    except (BDLoraError, ModelNotFound) as e:  # ConfigError, DataError, EngineError; a model that is not there
        print(f"bdlora sweep: error: {e}", file=sys.stderr)
        return 2
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
