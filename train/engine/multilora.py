"""BatchLoRA: one frozen base model, every target ``nn.Linear`` replaced by a multi-adapter module.

The concatenated micro-batch of all active jobs goes through ONE base GEMM per layer; each job's BD-LoRA
is applied to its own row segment. ``lora_backend``: "cublas" runs the base GEMM and every job's LoRA as
``bdlora.kernels.fused_lora_linear(backend="cublas")``, one autograd node, one cuBLAS GEMM per product, in the
base's dtype (a bf16 base with the usual fp32 factors: bf16 products and fp32 gradients, the numerics of the
single-job trainer's bf16 autocast); "triton" the grouped Triton kernels (``bdlora.kernels.grouped_lora``, one
launch per stage for all jobs); "torch" and "engine" the per-job loop below (``bd_lora_delta``, in the factors'
dtype: fp32 LoRA products beside a bf16 base); "auto" picks per call (``MultiLoraLinear._backend``: cuBLAS or
Triton on GPU, torch on CPU). Block-diagonal factors stay packed (N sub-blocks) in storage; the Triton and torch
paths also compute them per block, the cuBLAS path as one dense GEMM up to rank 128 (``bdlora.kernels.cublas``).

LoRA dropout (PEFT semantics): while training (``ctx.training`` and autograd recording), each job's LoRA input
rows are dropped out with that job's ``lora_dropout`` p (inverted dropout, before A); the base path and evaluation
(``torch.no_grad``) see no dropout. The torch paths use ``F.dropout`` on the job's rows; the kernels get the
job's p in its descriptor and a dropout seed drawn from torch's RNG, so all follow ``torch.manual_seed``
(the engine seeds each round from the job seeds and steps: :func:`dropout_rng`).

Factors are stored packed in PEFT orientation (SPEC §2): column layer lora_A (r, d_in), lora_B (d_out, r/N);
row layer lora_A (r, d_in/N), lora_B (d_out, r).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from bdlora.adapter import Adapter, AdapterConfig, LoraFactors
from bdlora.kernels.reference import bd_matmul
from bdlora.spec import COLUMN, ROW, BDLoraSpec

from bdlora.kernels import LoraAdapter as _KAdapter
from bdlora.kernels import dispatch as _dispatch
from bdlora.kernels import fused_lora_linear as _fused_lora_linear
from bdlora.kernels import grouped_lora as _grouped_lora

PEFT_PREFIX = "base_model.model."


def bd_lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layout: str, nblocks: int,
                  scale: float) -> torch.Tensor:
    """scale * x @ A @ B for packed factors (engine-local reference)."""
    na, nb = (nblocks, 1) if layout == ROW else (1, nblocks)
    return bd_matmul(bd_matmul(x, a, na) * scale, b, nb)


@dataclass
class BatchContext:
    """What the current forward pass runs: ``segments`` = [(job id, start, end)] over the flattened tokens."""

    segments: list[tuple[int, int, int]] = field(default_factory=list)
    backend: str = "auto"
    training: bool = True  # LoRA dropout on while this is set and autograd records (never under no_grad)

    def dropout_active(self) -> bool:
        return self.training and torch.is_grad_enabled()


def round_seed(*parts) -> int:
    """A 63-bit seed from ints/strings (stable across processes, unlike ``hash``)."""
    return zlib.crc32(repr(parts).encode()) * 2**31 + zlib.adler32(repr(parts).encode()) % 2**31


@contextlib.contextmanager
def dropout_rng(seed: Optional[int], device=None):
    """Runs the block with torch's RNG seeded by ``seed`` (CPU, and ``device`` if CUDA), restoring the caller's
    RNG state afterwards; a no-op for ``seed=None``. The engine wraps a round's forwards in it so LoRA-dropout
    masks depend only on the seed (reproducible runs, exact resume), not on what drew from the RNG before."""
    if seed is None:
        yield
        return
    dev = torch.device(device) if device is not None else torch.device("cpu")
    cuda = [dev] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.random.default_generator.manual_seed(int(seed))
        if cuda:  # that device's generator (fork_rng restores it)
            idx = dev.index if dev.index is not None else torch.cuda.current_device()
            torch.cuda.default_generators[idx].manual_seed(int(seed))
        yield


class JobAdapter(nn.Module):
    """One job's BD-LoRA factors on every target module (ParameterDicts keyed ``m<i>``; ``keys`` maps module paths).

    Init: A kaiming-uniform (a=sqrt(5) over the stored fan-in, like nn.Linear / PEFT), B zero, from a per-job seeded
    generator per (job seed, module path), so a job's start depends neither on the jobs beside it nor on the
    pipeline stage holding the module.
    """

    def __init__(self, spec: BDLoraSpec, targets: dict[str, tuple[str, int, int]], seed: int = 0,
                 device=None, dtype=torch.float32, a_init: str = "lora"):
        super().__init__()
        self.spec = spec
        self.layouts = {name: layout for name, (layout, _, _) in targets.items()}
        self.scale = spec.scale
        self.dropout = float(spec.lora_dropout)
        self.a = nn.ParameterDict()
        self.b = nn.ParameterDict()
        self.keys: dict[str, str] = {}
        self._kernel_adapters: dict[str, _KAdapter] = {}
        r, n = spec.r, spec.nblocks
        for i, (name, (layout, d_in, d_out)) in enumerate(sorted(targets.items())):
            key = f"m{i}"
            self.keys[name] = key
            # per-module generator: a module's init depends only on (seed, module path), not on which other
            # modules this process holds (pipeline stages hold a subset)
            g = torch.Generator().manual_seed(int(seed) * 1_000_003 + zlib.crc32(name.encode()))
            if layout == COLUMN:
                a = torch.empty(r, d_in)
                _kaiming_uniform(a, math.sqrt(5), g)  # PEFT's nn.Linear default init
                b = torch.zeros(d_out, r // n)
            else:
                a = torch.empty(r, d_in // n)
                # "lora": each shard's A like a standard LoRA A (the single-job trainer's default);
                # "peft": PEFT's BlockDiagonalLinear init (a=0)
                _kaiming_uniform(a, math.sqrt(5) if a_init == "lora" else 0.0, g)
                b = torch.zeros(d_out, r)
            self.a[key] = nn.Parameter(a.to(device=device, dtype=dtype))
            self.b[key] = nn.Parameter(b.to(device=device, dtype=dtype))

    def factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.keys[name]
        return self.a[k], self.b[k]

    def kernel_adapter(self, name: str, dropout: bool = True) -> _KAdapter:
        """The grouped kernel's descriptor of this job's factors on module ``name``, with the job's LoRA dropout
        (``dropout=False``: the same factors with dropout 0, for forwards that must not drop). Built once and
        reused while the parameter objects stay the same (the optimizer and ``load_factors`` update them in
        place): ``LoraAdapter`` validates shapes when built, which costs more host time per layer call than a
        small batch's GEMMs on GPU. Kept on the job's module so it is freed with the job."""
        a, b = self.factors(name)
        ad = self._kernel_adapters.get(name)
        if ad is None or ad.lora_a is not a or ad.lora_b is not b:
            ad = self._kernel_adapters[name] = _KAdapter(a, b, self.scale, self.layouts[name], self.spec.nblocks,
                                                         dropout=self.dropout)
            self._kernel_adapters.pop((name, "no-dropout"), None)
        if dropout or self.dropout == 0:
            return ad
        nd = self._kernel_adapters.get((name, "no-dropout"))
        if nd is None or nd.lora_a is not a or nd.lora_b is not b:
            nd = self._kernel_adapters[(name, "no-dropout")] = replace(ad, dropout=0.0)
        return nd

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def to_adapter(self, base_model_path: Optional[str] = None) -> Adapter:
        cfg = AdapterConfig.from_spec(self.spec, base_model_path)
        mods = {}
        for name, key in self.keys.items():
            mods[PEFT_PREFIX + name] = LoraFactors(self.a[key].detach().float().cpu().clone(),
                                                   self.b[key].detach().float().cpu().clone(), self.layouts[name])
        return Adapter(cfg, mods)

    def load_factors(self, adapter: Adapter) -> None:
        with torch.no_grad():
            for name, key in self.keys.items():
                f = adapter.modules[PEFT_PREFIX + name]
                self.a[key].copy_(f.lora_A)
                self.b[key].copy_(f.lora_B)


def _kaiming_uniform(t: torch.Tensor, a: float, g: torch.Generator) -> None:
    fan_in = t.shape[1]
    gain = math.sqrt(2.0 / (1 + a * a))
    bound = gain * math.sqrt(3.0 / fan_in)
    with torch.no_grad():
        t.uniform_(-bound, bound, generator=g)


def _contiguous(segs) -> bool:
    """The segments follow each other without gaps (what the kernels' seg boundaries describe)."""
    return all(segs[i][2] == segs[i + 1][1] for i in range(len(segs) - 1))


def _kernel_seed() -> int:
    """The kernels' dropout seed for one call (adapter i draws from seed + i), taken from torch's CPU RNG, which the
    engine seeds per round (``dropout_rng``): reproducible masks and exact resume."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


class MultiLoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus the BD-LoRA of every job in the batch context, each on its row segment."""

    def __init__(self, base: nn.Linear, name: str, layout: str, ctx: BatchContext, registry: dict):
        super().__init__()
        self.base = base
        self.name, self.layout, self.ctx, self.registry = name, layout, ctx, registry
        for p in self.base.parameters():
            p.requires_grad_(False)

    @property
    def weight(self):
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reg, name = self.registry, self.name
        segs = [s for s in self.ctx.segments if s[0] in reg and name in reg[s[0]].keys]
        if not segs:
            return F.linear(x, self.base.weight, self.base.bias)
        x2 = x.reshape(-1, x.shape[-1])
        jobs = [reg[j] for j, _, _ in segs]
        fdtype = jobs[0].factors(name)[0].dtype
        backend = self._backend(x2, sum(e > s for _, s, e in segs))
        if backend == "cublas" and x2.dtype == self.base.weight.dtype and _contiguous(segs):
            # base GEMM and every job's LoRA in one autograd node, each product one cuBLAS GEMM in the base's dtype
            # (fp32 factors beside a bf16 base: bf16 products as under the single-job trainer's bf16 autocast, fp32
            # gradients); a per-job loop of autograd ops launched ~3x more kernels, which bound an 8B-shape step
            # on the host (bench/results/train/*onefn*2026-11-22*)
            seg, adapters, seed = self._kernel_args(segs, jobs)
            y2 = _fused_lora_linear(x2, self.base.weight, self.base.bias, seg, adapters, dropout_seed=seed,
                                    backend="cublas")
            return y2.reshape(*x.shape[:-1], y2.shape[-1])
        y = F.linear(x, self.base.weight, self.base.bias)
        shape = y.shape
        y2 = y.reshape(-1, shape[-1])
        if x2.dtype != fdtype:  # e.g. a bf16 base with fp32 adapter weights: LoRA path in the adapters' dtype
            delta = self._delta(x2.to(fdtype), segs, jobs, None, backend)
            return (y2 + delta.to(y.dtype)).reshape(shape)
        return self._delta(x2, segs, jobs, y2, backend).reshape(shape)

    def _backend(self, x2: torch.Tensor, n_segments: int) -> str:
        """The context's lora_backend with "auto" resolved. On GPU the kernels' own rule
        (``dispatch.cublas_preferred``): cuBLAS GEMMs for one job or a large layer (at 8B shape the Triton grouped
        kernels, then drawing dropout masks one Philox call per element and summing dB with fp32 atomics, were 62%
        of an engine step, bench/results/train/*profile*2026-11-22*), the grouped Triton kernels for several jobs on a
        small layer (fewer launches). On CPU the torch reference (the Triton interpreter, which "auto" would take
        under TRITON_INTERPRET=1, is ~30x slower)."""
        backend = self.ctx.backend
        if backend != "auto":
            return backend
        if not x2.is_cuda:
            return "torch"
        w = self.base.weight
        return "cublas" if _dispatch.cublas_preferred("cuda", n_segments, w.shape[1], w.shape[0]) else "triton"

    def _kernel_args(self, segs, jobs) -> tuple[list[int], list, Optional[int]]:
        """(seg boundaries, the jobs' kernel descriptors, dropout seed or None) of a ``bdlora.kernels`` call over
        contiguous segments: the seed is drawn only when a job drops out in this forward."""
        drop = self.ctx.dropout_active() and any(ja.dropout > 0 for ja in jobs)
        return ([segs[0][1]] + [e for _, _, e in segs], [ja.kernel_adapter(self.name, drop) for ja in jobs],
                _kernel_seed() if drop else None)

    def _delta(self, x2, segs, jobs, out, backend: str):
        """out + LoRA deltas (or the deltas alone when ``out`` is None), rows outside the segments untouched."""
        if backend == "triton" and _contiguous(segs):
            # out= (in-place add) is not used: its backward failed on GPU for row layers (kernels 2026-11)
            seg, adapters, seed = self._kernel_args(segs, jobs)
            delta = _grouped_lora(x2, seg, adapters, dropout_seed=seed, backend="triton")
            return delta if out is None else out + delta
        drop = self.ctx.dropout_active()  # each job then drops out with its own p (none at p = 0)
        # Reference path (CPU, backend "torch"/"engine", factors in another dtype than the base): the same math as
        # bdlora.kernels.grouped_lora_ref without its per-call checks and without materializing a (T, d_out)
        # delta (zero rows + torch.cat) that is then added to ``out`` in a second pass.
        if len(segs) == 1 and segs[0][1] == 0 and segs[0][2] == x2.shape[0]:  # one job over all rows (K=1)
            ja = jobs[0]
            a, b = ja.factors(self.name)
            xj = F.dropout(x2, ja.dropout, training=True) if drop and ja.dropout > 0 else x2
            delta = bd_lora_delta(xj, a, b, self.layout, ja.spec.nblocks, ja.scale)
            return delta if out is None else out + delta
        if out is None:
            out = x2.new_zeros(x2.shape[0], self.base.out_features)
        for ja, (_, s, e) in zip(jobs, segs):
            a, b = ja.factors(self.name)
            xj = x2[s:e]
            if drop and ja.dropout > 0:  # this job's own p, on its rows only (PEFT: dropout before lora_A)
                xj = F.dropout(xj, ja.dropout, training=True)
            # in place into rows s:e: ``out`` is a fresh F.linear output (its backward does not read it) or zeros
            out[s:e] += bd_lora_delta(xj, a, b, self.layout, ja.spec.nblocks, ja.scale)
        return out


def inject_multilora(model: nn.Module, column_modules, row_modules, ctx: BatchContext, registry: dict
                     ) -> dict[str, tuple[str, int, int]]:
    """Replaces every target ``nn.Linear`` (exact name match) by a :class:`MultiLoraLinear`.

    Returns ``{module path: (layout, d_in, d_out)}``; module paths are the base model's (PEFT keys add
    ``base_model.model.``).
    """
    targets = {}
    for name, mod in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(mod, nn.Linear):
            continue
        if leaf in column_modules:
            layout = COLUMN
        elif leaf in row_modules:
            layout = ROW
        else:
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, leaf, MultiLoraLinear(mod, name, layout, ctx, registry))
        targets[name] = (layout, mod.in_features, mod.out_features)
    for p in model.parameters():
        p.requires_grad_(False)
    return targets


__all__ = ["BatchContext", "JobAdapter", "MultiLoraLinear", "PEFT_PREFIX", "bd_lora_delta", "dropout_rng",
           "inject_multilora", "round_seed"]
