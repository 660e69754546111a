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

__all__ = ["jit", "tl"]
