"""BatchLoRA: one frozen base model, every target ``nn.Linear`` replaced by a multi-adapter module.

The concatenated micro-batch of all active jobs goes through ONE base GEMM per layer; each job's BD-LoRA
is applied to its own row segment. Every layer call is one ``bdlora.kernels.fused_lora_linear`` call (base GEMM and
every job's LoRA) under the context's ``KernelOptions`` (``BatchContext.kernel_options``); the kernels' one dispatch
picks the backend and reports it (``MultiLoraLinear.last_dispatch``). ``lora_backend``: "cublas" one autograd node,
one cuBLAS GEMM per product, in the base's dtype (a bf16 base with the usual fp32 factors: bf16 products and fp32
gradients, the numerics of the single-job trainer's bf16 autocast); "triton" the grouped Triton kernels (one launch
per stage for all jobs; the same numerics as cuBLAS); "torch" (alias "engine") the kernels' torch reference
(``bdlora.kernels.fused_lora_linear_ref``, LoRA in the factors' dtype: fp32 LoRA products beside a bf16 base);
"auto" the kernels' rule (cuBLAS or Triton on GPU, ``bdlora.kernels.dispatch.cublas_preferred``; torch on CPU, where
the Triton interpreter is ~30x slower: ``KernelOptions(interpreter=False)``). A requested backend that cannot run a
call (e.g. a job without this module between two with it: a segment without adapter, which only torch runs) gives
way to the next that can (``KernelOptions(fallback=True)``); the dispatch says so and the layer logs it once.
Block-diagonal factors stay packed (N sub-blocks) in storage; the Triton and torch paths also compute them per block,
the cuBLAS path as one dense GEMM up to rank 128 (``bdlora.kernels.cublas``).

LoRA dropout (PEFT semantics): while training (``ctx.training`` and autograd recording), each job's LoRA input
rows are dropped out with that job's ``lora_dropout`` p (inverted dropout, before A); the base path and evaluation
(``torch.no_grad``) see no dropout. The torch backend uses ``F.dropout`` on the job's rows
(``KernelOptions(torch_dropout="bernoulli")``); the kernels get the job's p in its descriptor and a dropout seed
they draw from torch's RNG, so all follow ``torch.manual_seed`` (the engine seeds each round from the job seeds and
steps: :func:`dropout_rng`).

Factors are stored packed in PEFT orientation (README.md, "Adapter format"): column layer lora_A (r, d_in), lora_B (d_out, r/N);
row layer lora_A (r, d_in/N), lora_B (d_out, r).
"""

from __future__ import annotations

import contextlib
import logging
import math
import zlib
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from bdlora.adapter import Adapter, AdapterConfig
from bdlora.kernels import Dispatch, KernelOptions, fused_lora_linear, grouped_lora
from bdlora.layout import COLUMN, LoraFactors, layout_by_name
from bdlora.spec import BDLoraSpec

PEFT_PREFIX = "base_model.model."
_log = logging.getLogger(__name__)


def kernel_options(lora_backend: str) -> KernelOptions:
    """The kernels' options for the engine's ``lora_backend`` ("engine" is the torch backend's old name)."""
    return KernelOptions(backend="torch" if lora_backend == "engine" else lora_backend, fallback=True,
                         interpreter=False, torch_dropout="bernoulli")


@dataclass
class BatchContext:
    """What the current forward pass runs: ``segments`` = [(job id, start, end)] over the flattened tokens."""

    segments: list[tuple[int, int, int]] = field(default_factory=list)
    backend: str = "auto"  # the run's lora_backend
    training: bool = True  # LoRA dropout on while this is set and autograd records (never under no_grad)

    warned: set = field(default_factory=set)  # messages logged once per context
    # the kernels' host-side plans of the current segments, shared by every layer of the micro-batch
    plan_cache: dict = field(default_factory=dict)
    kernel_tuning: dict = field(default_factory=dict)  # further KernelOptions fields (benchmarks: fused_dropout, ...)

    @property
    def kernel_options(self) -> KernelOptions:
        opts = kernel_options(self.backend)
        return replace(opts, **self.kernel_tuning) if self.kernel_tuning else opts

    @contextlib.contextmanager
    def segments_of(self, segments: list[tuple[int, int, int]]):
        """The rows of the forward (and backward) passes run inside; none after. A checkpointed layer's backward
        runs its forward again and needs the same rows."""
        self.use_segments(segments)
        try:
            yield
        finally:
            self.use_segments([])

    def use_segments(self, segments: list[tuple[int, int, int]]) -> None:
        """The rows of the next forward (``[]`` after it); the plans of the previous ones are dropped."""
        self.segments = segments
        self.plan_cache.clear()

    def warn_once(self, msg: str) -> None:
        if msg not in self.warned:
            self.warned.add(msg)
            _log.warning("bdlora kernels: %s", msg)

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
        self._kernel_adapters: dict[str, LoraFactors] = {}
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

    def kernel_adapter(self, name: str, dropout: bool = True) -> LoraFactors:
        """The kernels' view of this job's factors on module ``name`` (:class:`bdlora.layout.LoraFactors`: layout,
        nblocks, scale and the job's LoRA dropout; ``dropout=False``: the same factors with dropout 0, for forwards
        that must not drop). Built once and reused while the parameter objects stay the same (the optimizer and
        ``load_factors`` update them in place): ``LoraFactors`` validates shapes when built, which costs more host
        time per layer call than a small batch's GEMMs on GPU. Kept on the job's module so it is freed with the job."""
        a, b = self.factors(name)
        ad = self._kernel_adapters.get(name)
        if ad is None or ad.lora_A is not a or ad.lora_B is not b:
            ad = self._kernel_adapters[name] = LoraFactors(a, b, self.layouts[name], self.spec.nblocks, self.scale,
                                                           self.dropout)
            self._kernel_adapters.pop((name, "no-dropout"), None)
        if dropout or self.dropout == 0:
            return ad
        nd = self._kernel_adapters.get((name, "no-dropout"))
        if nd is None or nd.lora_A is not a or nd.lora_B is not b:
            nd = self._kernel_adapters[(name, "no-dropout")] = replace(ad, dropout=0.0)
        return nd

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def to_adapter(self, base_model_path: Optional[str] = None) -> Adapter:
        cfg = AdapterConfig.from_spec(self.spec, base_model_path)
        mods = {}
        for name, key in self.keys.items():
            mods[PEFT_PREFIX + name] = LoraFactors(self.a[key].detach().float().cpu().clone(),
                                                   self.b[key].detach().float().cpu().clone(), self.layouts[name],
                                                   self.spec.nblocks, self.scale)
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


class MultiLoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus the BD-LoRA of every job in the batch context, each on its row segment.

    A plain ``nn.Linear`` base runs in the same kernel call as the LoRA terms (``fused_lora_linear``). A subclass
    with its own forward (bitsandbytes' ``Linear4bit``, whose weight is packed 4-bit storage) runs that forward, and
    the jobs' LoRA terms (``grouped_lora``, from the layer's input) are added to its output."""

    def __init__(self, base: nn.Linear, name: str, layout: str, ctx: BatchContext, registry: dict):
        super().__init__()
        self.base = base
        self.name, self.layout, self.ctx, self.registry = name, layout, ctx, registry
        self.base_runs_itself = type(base) is not nn.Linear
        self.last_dispatch: Optional[Dispatch] = None  # what the kernels ran for the last call with LoRA
        for p in self.base.parameters():
            p.requires_grad_(False)

    @property
    def weight(self):
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reg, name = self.registry, self.name
        segs = [s for s in self.ctx.segments if s[0] in reg and name in reg[s[0]].keys]
        if not segs:
            return self.base(x) if self.base_runs_itself else F.linear(x, self.base.weight, self.base.bias)
        x2 = x.reshape(-1, x.shape[-1])
        seg, adapters = self._kernel_args(segs)
        if self.base_runs_itself:
            base_out = self.base(x)
            opts = self.ctx.kernel_options
            if opts.backend == "cublas":  # the cuBLAS path fuses the base GEMM; the LoRA terms alone: auto's choice
                opts = replace(opts, backend="auto")
            delta, d = grouped_lora(x2, seg, adapters, options=opts, plan_cache=self.ctx.plan_cache)
            y2 = base_out.reshape(-1, base_out.shape[-1]) + delta.to(base_out.dtype)
        else:
            y2, d = fused_lora_linear(x2, self.base.weight, self.base.bias, seg, adapters,
                                      options=self.ctx.kernel_options, plan_cache=self.ctx.plan_cache)
        self.last_dispatch = d
        if d.note.startswith("fell back"):
            self.ctx.warn_once(f"lora_backend {d.requested} -> {d.backend} ({d.note})")
        return y2.reshape(*x.shape[:-1], y2.shape[-1])

    def _kernel_args(self, segs) -> tuple[list[int], list]:
        """(seg boundaries, per segment the job's kernel descriptor or None) of the ``bdlora.kernels`` call: gaps
        between the jobs' segments (a job without this module) become segments without adapter. Descriptors carry
        the job's dropout only while this forward drops out (``BatchContext.dropout_active``)."""
        reg = self.registry
        drop = self.ctx.dropout_active() and any(reg[j].dropout > 0 for j, _, _ in segs)
        seg, adapters = [segs[0][1]], []
        for j, s, e in segs:
            if s != seg[-1]:
                adapters.append(None)
                seg.append(s)
            adapters.append(reg[j].kernel_adapter(self.name, drop))
            seg.append(e)
        return seg, adapters


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
        layout = layout_by_name(name, column_modules, row_modules)
        if layout is None:
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, leaf, MultiLoraLinear(mod, name, layout, ctx, registry))
        targets[name] = (layout, mod.in_features, mod.out_features)
    for p in model.parameters():
        p.requires_grad_(False)
    return targets


__all__ = ["BatchContext", "JobAdapter", "MultiLoraLinear", "PEFT_PREFIX", "dropout_rng", "inject_multilora",
           "kernel_options", "round_seed"]
