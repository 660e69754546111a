"""Left only for ``decode.py``'s ``from .layout import LAYOUTS``: the layouts, ``LoraFactors`` and the pack/unpack
live in ``bdlora.layout``. Goes when decode.py imports ``LAYOUTS`` from there."""
from bdlora.layout import LAYOUTS

__all__ = ["LAYOUTS"]
