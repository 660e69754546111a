"""bdlora: train and serve Block-Diagonal LoRA adapters.

Core objects: :class:`BDLoraSpec` (shape and scaling), :class:`LoraFactors` (one module's layout and packed factors,
``bdlora.layout``), :func:`load_adapter` / :func:`save_adapter` (PEFT folders), and the conversions in :mod:`bdlora.convert`. Training lives in ``bdlora.train`` (the checkout's ``train/``), serving in
``bdlora.vllm_plugin`` (``vllm_plugin/``): the install maps those folders (pyproject.toml ``package-dir``), so a
checkout runs through its editable install (``pip install -e .``, which scripts/setup_env.sh does);
docs/architecture.md has the layout.
"""

from .adapter import Adapter, AdapterConfig, load_adapter, read_config, save_adapter
from .layout import COLUMN, ROW, LoraFactors
from .peft_model import prepare_bd_model, use_bdlora_kernels
from .spec import PRESETS, BDLoraError, BDLoraSpec, matched_lora_rank

def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bdlora")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


__version__ = _version()

__all__ = [
    "Adapter", "AdapterConfig", "BDLoraError", "BDLoraSpec", "COLUMN", "LoraFactors", "PRESETS", "ROW",
    "load_adapter", "matched_lora_rank", "prepare_bd_model", "read_config", "save_adapter", "use_bdlora_kernels",
]
