"""Launches of Triton kernels without Triton's per-call Python: ``launch(kernel, grid, *args, **kwargs)`` is
``kernel[grid](*args, **kwargs)``, but keeps the compiled kernel of each specialization and relaunches it directly.

Why: ``JITFunction.run`` binds and specializes every argument, builds a cache key (``str`` of the compile options),
checks the kernel's globals and asks the driver for the device and stream on every call. Decode steps replay CUDA
graphs and never see that, but vLLM runs prefills eagerly, four BD layers per decoder layer, and BD's prefill is
host-bound (BENCHMARKS.md, "Prefill host time": on an H100 host the direct launch takes 8-14 us off a folded call's
~110 us of host time at 1024 tokens). Training steps of short sequences are host-bound the same way: the cuBLAS
layer's dS/dB kernel and the dropout kernels (``cublas.py``, ``dropout.py``) launch through here too, once per layer
call each.

The direct launch passes the same arguments to the same compiled kernel as Triton's launcher would
(``CompiledKernel.run`` with every parameter in signature order). It is taken only when everything Triton
specializes on is unchanged since the kept kernel was compiled (``specialization_key``: each tensor's dtype and
16-byte alignment; each int's value class: 1, a multiple of 16, 32/64-bit; floats, bools, strings and constexprs
by value), on a GPU (not the CPU interpreter), with no launch hooks installed (profilers such as proton), and with a
Triton that has ``triton.knobs`` (3.4 and later; checked on the GPU with 3.6) and whose compiled kernels expose
``run``/``function``/``packed_metadata``; otherwise the call is ``kernel[grid](...)``, whose result is then kept. ``BDLORA_DIRECT_LAUNCH=0`` in the environment turns the direct
launches off (every call through Triton: for comparisons, or a Triton whose launcher differs).
"""
from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from . import dispatch

try:  # triton >= 3.4 keeps the launch hooks in knobs; older ones on CompiledKernel
    from triton import knobs as _knobs
except Exception:  # pragma: no cover - no triton, or an old one
    _knobs = None


def specialization_key(args: tuple, kwargs: dict) -> tuple:
    """What Triton's binder could specialize a launch on, for these arguments: equal keys (with the same kernel and
    device) compile to the same kernel. Conservative: it distinguishes at least everything Triton does (tensors by
    dtype and 16-byte alignment, ints by value class, everything else by value; keywords by value, in call order).
    One pass, no per-type calls: it runs on every serving launch."""
    return tuple([(v.dtype, v.data_ptr() & 15 == 0) if isinstance(v, _TENSOR)
                  else (v == 1, v & 15 == 0, -(1 << 31) <= v < (1 << 31)) if type(v) is int
                  else v for v in args]) + tuple(kwargs.items())


_TENSOR = torch.Tensor


class _Kept:
    __slots__ = ("compiled", "tail")

    def __init__(self, compiled, tail: tuple):
        self.compiled = compiled
        self.tail = tail  # the keyword parameters' values, in signature order after the positional ones


def _tail(kernel, n_args: int, kwargs: dict) -> tuple | None:
    """The values of ``kernel``'s parameters after the first ``n_args`` in signature order (from ``kwargs``, else
    their defaults), or None when some has neither (Triton's own launch then reports it) or when a constexpr is among
    the first ``n_args`` (``specialization_key`` keys positional ints by class, not value: never kept)."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    if any("constexpr" in str(p.annotation) for p in params[:n_args]):
        return None
    out = []
    for p in params[n_args:]:
        if p.name in kwargs:
            out.append(kwargs[p.name])
        elif p.default is not inspect.Parameter.empty:
            out.append(p.default)
        else:
            return None
    return tuple(out)


class LaunchCache:
    """Compiled kernels kept per (kernel, device, ``specialization_key``); ``launch`` relaunches them directly. One
    per process (``launch``); kernels of a process are few and so are their specializations."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._kept: dict = {}
        self.direct = 0  # launches that skipped Triton's run (tests and benchmarks read it)
        self.triton = 0

    def launch(self, kernel, grid: tuple, *args: Any, **kwargs: Any) -> None:
        dev = args[0].device if args and isinstance(args[0], torch.Tensor) else None
        if (not self.enabled or dev is None or dev.type != "cuda" or dispatch.INTERPRET
                or dev.index != torch.cuda.current_device()):
            kernel[grid](*args, **kwargs)  # Triton launches on the current device: keep its behaviour there
            return
        try:
            key = (kernel, dev.index, specialization_key(args, kwargs))
            kept = self._kept.get(key)
        except TypeError:  # an unhashable argument
            key = kept = None
        if kept is not None and not _hooks():
            self.run_kept(kept, grid, dev.index, args)
            return
        compiled = kernel[grid](*args, **kwargs)
        self.triton += 1
        if key is not None and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            tail = _tail(kernel, len(args), kwargs)
            if tail is not None:
                self._kept[key] = _Kept(compiled, tail)

    def run_kept(self, kept: _Kept, grid: tuple, device_index: int, args: tuple) -> None:
        """Launches a kept kernel directly on the current stream of ``device_index``: the positional arguments, then
        the keyword parameters' values in signature order (as Triton's own launcher passes them)."""
        g = tuple(grid) + (1, 1)
        c = kept.compiled
        c.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device_index), c.function, c.packed_metadata,
              None, None, None, *args, *kept.tail)
        self.direct += 1

    def kept(self, kernel, args: tuple, kwargs: dict) -> _Kept | None:
        """The kernel kept for a launch with these arguments on the first argument's device, or None."""
        try:
            return self._kept.get((kernel, args[0].device.index, specialization_key(args, kwargs)))
        except (TypeError, AttributeError, IndexError):
            return None


def _hooks() -> bool:
    """Whether launch hooks are installed (a profiler's): their launches go through Triton, which calls them. Triton
    3.6+ keeps them in a ``HookChain`` (``calls``, empty when none is installed), earlier 3.x as the hook or None."""
    rt = getattr(_knobs, "runtime", None)
    if rt is None:
        return True
    return any(h is not None and getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


#: The kept launches of this process: they are bound to Triton's compiled kernels, which are process-wide too.
LAUNCHES = LaunchCache(enabled=os.environ.get("BDLORA_DIRECT_LAUNCH", "1") != "0")


class KeptLaunch:
    """One call site's launches of one kernel whose specialization is the same on every call (a serving layer's
    prepared launch: ``decode.FoldedLaunch``), without ``launch``'s per-call key: after the first launch through
    ``launch`` (which keeps the compiled kernel), ``self(grid, *args)`` relaunches that kernel directly.

    The caller fixes what Triton specializes on: the keyword arguments (constexprs and launch options) are given once
    here; between calls only the tensors at positions ``fresh`` (new allocations) and the ints at positions
    ``varying`` may change. Each call checks that the ``fresh`` tensors are still 16-byte aligned, and construction
    that every ``varying`` parameter is ``do_not_specialize`` (Triton compiles one kernel for all its values);
    otherwise, and wherever ``launch`` would not go direct, the call is ``launch(kernel, grid, *args, **kwargs)``.
    """

    def __init__(self, kernel, *, fresh: tuple = (), varying: tuple = (), **kwargs: Any):
        self.kernel, self.fresh, self.kwargs = kernel, tuple(fresh), kwargs
        params = getattr(kernel, "params", None)
        # the kept kernel serves every value of a varying int only if Triton never specializes on it
        self.keepable = params is not None and all(getattr(params[i], "do_not_specialize", False) for i in varying)
        self._kept: _Kept | None = None
        self._device = -1

    def __call__(self, grid: tuple, *args: Any) -> None:
        kept = self._kept
        if (kept is not None and LAUNCHES.enabled and self._device == torch.cuda.current_device() and not _hooks()
                and all(args[i].data_ptr() & 15 == 0 for i in self.fresh)):
            LAUNCHES.run_kept(kept, grid, self._device, args)
            return
        LAUNCHES.launch(self.kernel, grid, *args, **self.kwargs)
        if kept is None and self.keepable and LAUNCHES.enabled and args[0].is_cuda:  # else launch kept nothing
            self._kept = LAUNCHES.kept(self.kernel, args, self.kwargs)
            self._device = args[0].device.index


def launch(kernel, grid: tuple, *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)`` through this process's ``LaunchCache``: positional arguments are the
    kernel's leading parameters (the first a tensor on the launch's device), keywords the rest (constexprs) and
    Triton's launch options (num_warps, num_stages, launch_pdl)."""
    LAUNCHES.launch(kernel, grid, *args, **kwargs)


__all__ = ["LAUNCHES", "KeptLaunch", "LaunchCache", "launch", "specialization_key"]
