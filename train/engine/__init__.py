"""Multi-LoRA fine-tuning engine: many BD-LoRA jobs over one frozen base (mLoRA BatchLoRA / LoRAPP, ALTO early
exit, token-budget packing, memory-model admission).

Run: ``bdlora sweep --config run.yaml`` or ``python -m bdlora.train.engine --config run.yaml`` (or ``accelerate launch
-m bdlora.train.engine ...``). The run file uses the keys of ``bdlora train`` (:mod:`bdlora.train.engine.config`).
"""

from .config import ConfigError, EarlyExitConfig, EngineKeys, JobConfig, RunConfig, describe_run_keys, load_run, parse_run
from .early_exit import EarlyExit, linreg_slope, select_after_warmup
from .memory import JobFootprint, MemoryModel
from .packing import Item, pack_ffd

__all__ = [
    "ConfigError", "EarlyExit", "EarlyExitConfig", "Engine", "EngineKeys", "Item", "JobConfig", "JobFootprint",
    "MemoryModel", "RunConfig", "describe_run_keys", "linreg_slope", "load_run", "pack_ffd", "parse_run", "run_engine",
    "select_after_warmup",
]


def __getattr__(name):  # heavy imports (transformers) only when the engine itself is used
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "run_engine":
        from .launch import run_engine

        return run_engine
    raise AttributeError(name)
