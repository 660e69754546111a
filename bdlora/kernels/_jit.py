"""``jit`` and ``tl`` for the modules that hold Triton kernels beside their launchers, importable without Triton.

With Triton installed these are ``triton.jit`` and ``triton.language``. Without it ``jit`` returns a stand-in that
raises when launched, so the kernel modules (and their torch references and fallbacks) still import; the dispatch
never picks Triton then (``dispatch.triton_why_not``). Kernel modules use ``from __future__ import annotations``,
so ``tl.constexpr`` annotations are not evaluated at import.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except Exception:  # pragma: no cover - triton is an optional extra
    tl = None

    class _Missing:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError(f"{self.fn.__name__}: triton is not installed")

    def jit(fn=None, **_kwargs):
        return _Missing(fn) if fn is not None else _Missing

if tl is not None:
    @jit
    def dot(a, b, PREC: tl.constexpr):
        """``tl.dot(a, b)`` accumulated in fp32 at input precision ``PREC`` (``dispatch.dot_precision``). "upcast"
        multiplies 16-bit operands in fp32: the Triton interpreter's tl.dot mis-multiplies bf16/fp16, and a product
        of two 16-bit floats is exact in fp32, as on tensor cores (only the summation order differs)."""
        if PREC == "upcast":  # the interpreter only: compiled kernels never take this branch
            tl.static_assert(a.dtype == b.dtype, "tl.dot operands must share a dtype")
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(a, b, input_precision=PREC)
        return out
else:  # pragma: no cover - triton is an optional extra
    dot = None

__all__ = ["dot", "jit", "tl"]
