"""BD-LoRA fine-tuning: ``python -m bdlora.train --config job.yaml`` (see :mod:`bdlora.train.trainer`).

Lazy exports so that ``python -m bdlora.train`` and the CLI do not import torch before they need to.
"""

__all__ = ["TrainConfig", "ConfigError", "run_training", "main"]


def __getattr__(name):
    if name in ("TrainConfig", "ConfigError"):
        from . import config

        return getattr(config, name)
    if name in ("run_training", "main"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
