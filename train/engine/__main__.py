"""``bdlora sweep --config run.yaml`` = ``python -m bdlora.train.engine --config run.yaml`` (also under ``accelerate
launch`` / ``torchrun``)."""

from __future__ import annotations

import argparse
import sys


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
    model (no traceback), when the memory model refused every job, or when a write failed for lack of space or
    permission."""
    args = build_parser().parse_args(argv)
    from bdlora.models import ModelNotFound
    from bdlora.spec import BDLoraError
    from bdlora.train.config import parse_override

    from .config import describe_run_keys, load_run
    from .launch import every_job_refused, init_from_env, run_engine

    if args.print_config:
        print(describe_run_keys(), end="")
        return 0
    if not args.config:
        print("bdlora sweep: error: --config run.yaml is required (see --print-config)", file=sys.stderr)
        return 2
    dist, run = None, None
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
        dist = init_from_env()
        run_engine(run)
        if dist is None or dist.get_rank() == 0:
            refused = every_job_refused(run.output_dir)
            if refused:
                print(f"bdlora sweep: error: {refused}", file=sys.stderr)
                return 2
    except (BDLoraError, ModelNotFound) as e:  # ConfigError, DataError, EngineError; a model that is not there
        print(f"bdlora sweep: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a full disk or a read-only folder: the reason and what to do, not a traceback
        from bdlora.adapter import disk_write_error

        reason = disk_write_error(e, run.output_dir) if run is not None else None
        if reason is None:
            raise
        print(f"bdlora sweep: error: {reason}; make room, then run the same command again (resume: auto continues "
              "from the run's last checkpoint, engine_state.pt, when save_every wrote one)", file=sys.stderr)
        return 2
    finally:
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
