"""Backend choice: Triton on CUDA (or on CPU under TRITON_INTERPRET=1), else the torch reference.

Triton decides at decoration time whether a kernel is interpreted, so the CPU decision is frozen when
``bdlora.kernels`` is first imported: set TRITON_INTERPRET=1 before that import to run the kernels on CPU.
"""
from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - triton is an optional extra
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Which backend each op used last ("triton" or "torch"); tests assert on it, benchmarks print it.
LAST_BACKEND: dict[str, str] = {}


def triton_ok(*tensors: torch.Tensor) -> bool:
    """True when Triton can run on these tensors' device with these dtypes."""
    if not HAS_TRITON:
        return False
    devs = {t.device.type for t in tensors}
    if len(devs) != 1 or len({t.dtype for t in tensors}) != 1 or tensors[0].dtype not in SUPPORTED_DTYPES:
        return False
    dev = devs.pop()
    return dev == "cuda" or (dev == "cpu" and INTERPRET)


def choose(op: str, backend: str, supported: bool) -> str:
    """Resolve backend "auto" | "triton" | "torch" and record the choice in LAST_BACKEND."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
    if backend == "triton" and not supported:
        raise RuntimeError(f"{op}: the Triton backend cannot run these inputs (device/dtype/triton missing)")
    use = "triton" if backend == "triton" or (backend == "auto" and supported) else "torch"
    LAST_BACKEND[op] = use
    return use
