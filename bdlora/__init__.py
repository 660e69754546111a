"""bdlora: train and serve Block-Diagonal LoRA adapters.

Core objects: :class:`BDLoraSpec` (shape and scaling), :class:`LoraFactors` (one module's layout and packed factors,
``bdlora.layout``), :func:`load_adapter` / :func:`save_adapter` (PEFT folders), and the conversions in :mod:`bdlora.convert`. Training lives in ``bdlora.train`` (the checkout's ``train/``), serving in
``bdlora.vllm_plugin`` (``vllm_plugin/``): the install maps those folders (pyproject.toml ``package-dir``), so a
checkout runs through its editable install (``pip install -e .``, which scripts/setup_env.sh does);
docs/architecture.md has the layout.
"""

from .adapter import Adapter, AdapterConfig, load_adapter, read_config, save_adapter
from .layout import COLUMN, ROW, LoraFactors
from .spec import PRESETS, BDLoraError, BDLoraSpec, matched_lora_rank

__version__ = "0.1.0"

__all__ = [
    "Adapter", "AdapterConfig", "BDLoraError", "BDLoraSpec", "COLUMN", "LoraFactors", "PRESETS", "ROW",
    "load_adapter", "matched_lora_rank", "read_config", "save_adapter",
]
