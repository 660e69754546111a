"""Backend choice: Triton on CUDA (or on CPU under TRITON_INTERPRET=1), else the torch reference; ops that have a
cuBLAS-composed path (``fused_lora_linear``) take it on CUDA where it applies (see ``cublas_preferred``).

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

# Which backend each op used last ("triton", "cublas" or "torch"; for "cublas_dropout", the cuBLAS path's dropout,
# "triton" when fused into its kernels, "mask" when materialized); tests assert on it, benchmarks print it.
LAST_BACKEND: dict[str, str] = {}

# ``fused_lora_linear`` issues ~8 GEMMs per adapter segment on the cuBLAS path (5 Triton launches in all on the
# Triton path): with several segments of a small layer the launches dominate. Measured on an H200 with the training
# engine's cuBLAS route (fp32 factors, per-job cuBLAS GEMMs; bench/results/train/*2026-11-22*): SmolLM2 shape
# (576 x 576 .. 576 x 1536) 1.7x faster than Triton with one job but 0.80x / 0.53x with 4 / 8; Llama-8B shape
# (4096 x 4096 .. 4096 x 14336) 1.24x / 1.16x faster with 1 / 4.
CUBLAS_MIN_WEIGHT = 2048 * 2048  # d_in x d_out from which cuBLAS is preferred for any number of segments


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for grid sizes (what triton.cdiv does, without importing triton)."""
    return -(-a // b)


def next_pow2(v: int) -> int:
    """The smallest power of two >= v (1 for v <= 1): Triton block sizes."""
    return 1 << max(0, int(v) - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for inputs of ``dtype``: exact IEEE products for fp32 (tests compare against fp64
    references), tf32 otherwise (ignored for 16-bit inputs)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def triton_ok(*tensors: torch.Tensor) -> bool:
    """True when Triton can run on these tensors' device with these dtypes."""
    if not HAS_TRITON:
        return False
    devs = {t.device.type for t in tensors}
    if len(devs) != 1 or len({t.dtype for t in tensors}) != 1 or tensors[0].dtype not in SUPPORTED_DTYPES:
        return False
    dev = devs.pop()
    return dev == "cuda" or (dev == "cpu" and INTERPRET)


def gpu_kernel_on(enabled: bool | None, *tensors: torch.Tensor) -> bool:
    """The switch of a Triton kernel that replaces torch/cuBLAS ops on GPUs only (``cublas.FUSED_DROPOUT``,
    ``cublas.FUSED_DSDB``): None = on CUDA, True = also under the CPU interpreter (tests), False = never; and
    Triton must run on these tensors."""
    if enabled is False or not triton_ok(*tensors):
        return False
    return tensors[0].is_cuda or bool(enabled)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (grid sizing)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def cublas_ok(compute: list[torch.Tensor], factors: list[torch.Tensor]) -> bool:
    """Whether the cuBLAS-composed path can run these inputs: every tensor on one device, ``compute`` (x, weight,
    bias) in one floating dtype, the LoRA ``factors`` floating in any precision (the products run in the compute
    dtype, the factors' gradients come back in theirs: fp32 master weights beside a bf16 base)."""
    return (len({t.device for t in compute + factors}) == 1 and len({t.dtype for t in compute}) == 1
            and all(t.is_floating_point() for t in compute + factors))


def cublas_preferred(device_type: str, n_segments: int, d_in: int, d_out: int) -> bool:
    """Whether "auto" takes the cuBLAS-composed path (where the op has one and the inputs suit it): on CUDA, for one
    non-empty adapter segment or a layer of at least CUBLAS_MIN_WEIGHT weights (measurements above). On CPU "auto"
    keeps Triton (interpreter) or torch."""
    return device_type == "cuda" and (n_segments <= 1 or d_in * d_out >= CUBLAS_MIN_WEIGHT)


def choose(op: str, backend: str, supported: bool, cublas: bool | None = None, prefer_cublas: bool = False) -> str:
    """Resolve backend "auto" | "triton" | "torch" | "cublas" and record the choice in LAST_BACKEND.

    supported: Triton can run the inputs. cublas: None when the op has no cuBLAS-composed path, else whether that
    path can run the inputs. prefer_cublas: "auto" takes that path (when it can run them) before Triton.
    """
    allowed = ("auto", "triton", "torch") + (() if cublas is None else ("cublas",))
    if backend not in allowed:
        raise ValueError(f"{op}: backend must be one of {', '.join(allowed)}, got {backend!r}")
    if backend == "triton" and not supported:
        raise RuntimeError(f"{op}: the Triton backend cannot run these inputs (device/dtype/triton missing)")
    if backend == "cublas" and not cublas:
        raise RuntimeError(f"{op}: the cuBLAS path cannot run these inputs (devices differ, x/weight/bias dtypes "
                           "differ, or not floating)")
    if backend != "auto":
        use = backend
    elif cublas and prefer_cublas:
        use = "cublas"
    else:
        use = "triton" if supported else "torch"
    LAST_BACKEND[op] = use
    return use
