"""One dispatch for every kernel entry point: the options a call runs under (``KernelOptions``, passed in, frozen),
the backend rule, and what a call reports back (``Dispatch``, inside the ``LoraResult`` every entry point returns).

Entry points (one per operation) and their backends; "auto" picks in the order listed where the inputs suit:

    grouped_lora        triton, torch                 (grouped.py)
    fused_lora_linear   cublas, triton, torch         (grouped.py dispatches; cublas.py, grouped.py run)
    decode_lora         triton, torch                 (decode.py)
    decode_lora_folded  triton, torch                 (decode.py)

Each returns ``LoraResult(out, dispatch)``; ``dispatch.backend`` is the backend that ran, ``dispatch.note`` says why
where it is not simply the one requested. A requested backend that cannot run the inputs raises (RuntimeError naming
why), unless ``KernelOptions.fallback`` is set: then the next backend of "auto"'s order that can runs and the note
says so. Nothing is recorded in module state: the result is the record.

Triton decides at decoration time whether a kernel is interpreted, so the CPU decision is frozen when
``bdlora.kernels`` is first imported: set TRITON_INTERPRET=1 before that import to run the kernels on CPU.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - triton is an optional extra
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BACKENDS = ("auto", "cublas", "triton", "torch")
TORCH_DROPOUTS = ("counter", "bernoulli")

# ``fused_lora_linear`` issues ~8 GEMMs per adapter segment on the cuBLAS path (5 Triton launches in all on the
# Triton path): with several segments of a small layer the launches dominate. Measured on an H200 with the training
# engine's cuBLAS route (fp32 factors, per-job cuBLAS GEMMs): SmolLM2 shape
# (576 x 576 .. 576 x 1536) 1.7x faster than Triton with one job but 0.80x / 0.53x with 4 / 8; Llama-8B shape
# (4096 x 4096 .. 4096 x 14336) 1.24x / 1.16x faster with 1 / 4.
CUBLAS_MIN_WEIGHT = 2048 * 2048  # d_in x d_out from which cuBLAS is preferred for any number of segments


@dataclass(frozen=True)
class KernelOptions:
    """How one kernel call runs. Frozen: build one per setting (``dataclasses.replace`` for a variant) and pass it.

    backend        "auto" | "cublas" (fused_lora_linear only) | "triton" | "torch".
    fallback       a requested backend that cannot run the inputs: False raises, True runs the next backend of
                   "auto"'s order that can and says so in ``Dispatch.note``.
    interpreter    "auto" may take Triton on CPU under TRITON_INTERPRET=1 (kernel tests); False keeps torch there
                   (the training engine: the interpreter is ~30x slower).
    fuse_base      fused_lora_linear: the Triton path computes the base GEMM inside its LoRA-expand tile (needs the
                   segments to cover every row; not on the cuBLAS path).
    bd_gemm        fused_lora_linear's cuBLAS path: "auto" | "dense" | "blocks" (``cublas`` module docstring).
    fused_dropout  cuBLAS path: dropout inside the LoRA-A products (``dropout.py`` kernels) instead of a materialized
                   mask: None = on CUDA where they apply (dense A of rank <= 128), True = also under the CPU
                   interpreter (tests), False = never.
    fused_dsdb     cuBLAS path: dS and dB of an adapter from one Triton kernel reading dY once (``cublas.dsdb_dense``)
                   instead of two GEMMs: None = on CUDA for B dense as the GEMMs see it and rank <= DSDB_MAX_RANK,
                   True = also under the interpreter, False = never (dB then sums in a fixed order).
    poison_outputs fill every kernel/GEMM output buffer with NaN first, so elements a kernel forgets fail (tests).
    torch_dropout  masks of the torch backend: "counter" = ``dropout.segment_keep_mask(seed, i)`` (the cuBLAS path's
                   masks, from ``dropout_seed``), "bernoulli" = ``F.dropout`` on each segment's rows in segment order
                   from torch's RNG (PEFT's own draw; no seed is drawn).
    """

    backend: str = "auto"
    fallback: bool = False
    interpreter: bool = True
    fuse_base: bool = False
    bd_gemm: str = "auto"
    fused_dropout: bool | None = None
    fused_dsdb: bool | None = None
    poison_outputs: bool = False
    torch_dropout: str = "counter"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.torch_dropout not in TORCH_DROPOUTS:
            raise ValueError(f"torch_dropout must be one of {TORCH_DROPOUTS}, got {self.torch_dropout!r}")


DEFAULT_OPTIONS = KernelOptions()


@dataclass(frozen=True)
class Dispatch:
    """What one kernel call ran.

    op, requested  the entry point and ``options.backend``.
    backend        the backend that ran: "cublas" | "triton" | "torch".
    note           why, where that is not the requested backend ("auto: ...", "fell back from triton: ...").
    dropout_seed   the seed the dropout masks were drawn from (None: no dropout, or torch_dropout="bernoulli").
    dropout        cuBLAS path, per adapter: "triton" (mask drawn in the fused kernels), "mask" (materialized), or
                   "none" (no dropout / empty segment); () on other backends.
    dsdb           cuBLAS path, per adapter: how its backward computes dS and dB, "triton" (``dsdb_dense``, one read
                   of dY) or "cublas" (two GEMMs), "none" (empty segment or no gradient wanted); decided in forward.
    """

    op: str
    requested: str
    backend: str
    note: str = ""
    dropout_seed: int | None = None
    dropout: tuple[str, ...] = ()
    dsdb: tuple[str, ...] = ()


class LoraResult(NamedTuple):
    """What every entry point returns: the output tensor and the ``Dispatch`` record (``y, d = op(...)``)."""

    out: torch.Tensor
    dispatch: Dispatch

    @property
    def backend(self) -> str:
        return self.dispatch.backend


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for grid sizes (what triton.cdiv does, without importing triton)."""
    return -(-a // b)


def next_pow2(v: int) -> int:
    """The smallest power of two >= v (1 for v <= 1): Triton block sizes."""
    return 1 << max(0, int(v) - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """The kernels' ``PREC`` (``_jit.dot``) for inputs of ``dtype``: exact IEEE products for fp32 (tests compare
    against fp64 references); for 16-bit inputs the tensor cores' own products ("tf32" is ignored for them), or
    under the Triton interpreter "upcast" (fp32 products of the 16-bit values: the interpreter's 16-bit tl.dot is
    wrong)."""
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if INTERPRET else "tf32"


def new_output(ref: torch.Tensor, shape, options: KernelOptions, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized output buffer like ``ref`` (NaN-filled under ``options.poison_outputs``)."""
    out = ref.new_empty(tuple(shape), dtype=dtype)
    return out.fill_(float("nan")) if options.poison_outputs else out


def zero_outside_segments(t: torch.Tensor, seg) -> None:
    """Zeroes the rows of ``t`` before ``seg[0]`` and from ``seg[-1]`` on (rows no adapter's LoRA writes). Empty
    ranges are skipped: a PEFT layer's call is one segment over every row, and each dispatched op is host time in a
    step of small batches."""
    if seg[0] > 0:
        t[: seg[0]].zero_()
    if seg[-1] < t.shape[0]:
        t[seg[-1]:].zero_()


def rows(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``t[start:stop]``, or ``t`` itself when that is every row (no slice dispatched for a one-segment call)."""
    return t if start == 0 and stop == t.shape[0] else t[start:stop]


def triton_why_not(*tensors: torch.Tensor) -> str | None:
    """None when Triton can run on these tensors (one device, CUDA or the CPU interpreter; one supported dtype),
    else the reason it cannot."""
    if not HAS_TRITON:
        return "triton is not installed"
    devs = {t.device.type for t in tensors}
    if len(devs) != 1:
        return "tensors on several devices"
    if len({t.dtype for t in tensors}) != 1 or tensors[0].dtype not in SUPPORTED_DTYPES:
        return f"dtypes {sorted({str(t.dtype) for t in tensors})} (one of fp32/fp16/bf16 needed)"
    dev = devs.pop()
    if dev == "cuda" or (dev == "cpu" and INTERPRET):
        return None
    return f"device {dev} (CUDA, or CPU under TRITON_INTERPRET=1, needed)"


def triton_ok(*tensors: torch.Tensor) -> bool:
    """True when Triton can run on these tensors' device with these dtypes."""
    return triton_why_not(*tensors) is None


def gpu_kernel_on(enabled: bool | None, *tensors: torch.Tensor) -> bool:
    """The switch of a Triton kernel that replaces torch/cuBLAS ops on GPUs only (``KernelOptions.fused_dropout``,
    ``fused_dsdb``): None = on CUDA, True = also under the CPU interpreter (tests), False = never; and Triton must
    run on these tensors."""
    if enabled is False or not triton_ok(*tensors):
        return False
    return tensors[0].is_cuda or bool(enabled)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (grid sizing)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def pdl_ok(device: torch.device) -> bool:
    """Whether Triton launches on ``device`` may use programmatic dependent launch (``launch_pdl``, ``gdc_wait``):
    CUDA compute capability 9.0 (Hopper) or later, not the interpreter."""
    device = torch.device(device)
    return device.type == "cuda" and not INTERPRET and _capability(device.index)[0] >= 9


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cublas_why_not(compute: list[torch.Tensor], factors: list[torch.Tensor]) -> str | None:
    """None when the cuBLAS-composed path can run these inputs: every tensor on one device, ``compute`` (x, weight,
    bias) in one floating dtype, the LoRA ``factors`` floating in any precision (the products run in the compute
    dtype, the factors' gradients come back in theirs: fp32 master weights beside a bf16 base); else the reason."""
    if len({t.device for t in compute + factors}) != 1:
        return "tensors on several devices"
    if len({t.dtype for t in compute}) != 1:
        return "x/weight/bias dtypes differ"
    if not all(t.is_floating_point() for t in compute + factors):
        return "not floating"
    return None


def cublas_ok(compute: list[torch.Tensor], factors: list[torch.Tensor]) -> bool:
    """Whether the cuBLAS-composed path can run these inputs (``cublas_why_not``)."""
    return cublas_why_not(compute, factors) is None


def cublas_preferred(device_type: str, n_segments: int, d_in: int, d_out: int) -> bool:
    """Whether "auto" takes the cuBLAS-composed path (where the op has one and the inputs suit it): on CUDA, for one
    non-empty adapter segment or a layer of at least CUBLAS_MIN_WEIGHT weights (measurements above). On CPU "auto"
    keeps Triton (interpreter) or torch."""
    return device_type == "cuda" and (n_segments <= 1 or d_in * d_out >= CUBLAS_MIN_WEIGHT)


NOT_AN_OPTION = "the op has no such path"


def resolve(op: str, options: KernelOptions, device_type: str, *, triton: str | None,
            cublas: str | None = NOT_AN_OPTION, prefer_cublas: bool = False) -> tuple[str, str]:
    """The backend ``op`` runs and a note on why: (backend, note).

    triton / cublas: None when that path can run the inputs, else the reason it cannot (cublas NOT_AN_OPTION for ops
    without a cuBLAS path). prefer_cublas: "auto" takes cuBLAS (when it can run) before Triton. "auto" takes Triton on
    CPU only with ``options.interpreter``. A requested backend that cannot run raises RuntimeError, or with
    ``options.fallback`` gives way to "auto"'s choice among the others.
    """
    has_cublas = cublas != NOT_AN_OPTION
    allowed = ("auto", "triton", "torch") + (("cublas",) if has_cublas else ())
    want = options.backend
    if want not in allowed:
        raise ValueError(f"{op}: backend must be one of {', '.join(allowed)}, got {want!r}")
    if want == "triton" and triton is None or want == "cublas" and cublas is None or want == "torch":
        return want, ""
    why = {"triton": triton, "cublas": cublas}.get(want)
    if want != "auto" and not options.fallback:
        path = "the Triton backend" if want == "triton" else "the cuBLAS path"
        raise RuntimeError(f"{op}: {path} cannot run these inputs ({why})")
    use = "torch"
    for b in [b for b in ("cublas", "triton", "torch") if b != want]:
        if b == "cublas" and (cublas is not None or not prefer_cublas):
            continue
        if b == "triton" and (triton is not None or (device_type == "cpu" and not options.interpreter)):
            continue
        use = b
        break
    if want == "auto":
        if use == "cublas":
            note = "auto: cuBLAS preferred (CUDA, one segment or a large layer)"
        elif use == "triton":
            note = "auto: Triton can run the inputs"
        else:
            note = "auto: torch (" + (triton or "CPU without the interpreter option") + ")"
        return use, note
    return use, f"fell back from {want}: {why}"
