"""bdlora: train and serve Block-Diagonal LoRA adapters.

Core objects: :class:`BDLoraSpec` (shape and scaling), :func:`load_adapter` / :func:`save_adapter` (PEFT folders),
and the conversions in :mod:`bdlora.convert`. Training lives in ``bdlora.train``, serving in ``bdlora.vllm_plugin``.
"""

import os as _os

# A source checkout keeps train/ and vllm_plugin/ beside bdlora/ (installs map them to bdlora.train and
# bdlora.vllm_plugin). Searching the checkout root too makes `python -m bdlora.train` work from the repository root
# whether bdlora is installed editable, installed regularly, or only on PYTHONPATH.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "train")) and _os.path.isfile(
        _os.path.join(_checkout, "train", "__init__.py")):
    __path__.append(_checkout)  # noqa: F821 - __path__ is defined for packages

from .adapter import Adapter, AdapterConfig, LoraFactors, load_adapter, read_config, save_adapter
from .spec import COLUMN, PRESETS, ROW, BDLoraError, BDLoraSpec, matched_lora_rank

__version__ = "0.1.0"

__all__ = [
    "Adapter", "AdapterConfig", "BDLoraError", "BDLoraSpec", "COLUMN", "LoraFactors", "PRESETS", "ROW",
    "load_adapter", "matched_lora_rank", "read_config", "save_adapter",
]
