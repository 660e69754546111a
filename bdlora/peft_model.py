"""A PEFT model built from a :class:`~bdlora.spec.BDLoraSpec` made a checked, correctly initialised BD-LoRA model
that trains on bdlora's kernels: what ``bdlora train`` does after ``get_peft_model``, public for users who train with
their own loop or with TRL's ``SFTTrainer`` (``examples/trl_sft.py``)."""

from __future__ import annotations

import functools
import math

import torch

from .layout import COLUMN, ROW, LoraFactors
from .quant import is_kbit_linear
from .spec import BDLoraError, BDLoraSpec

#: How a PEFT BD-LoRA layer computes its LoRA term while training: "peft" (PEFT's ``BlockDiagonalLinear``, an einsum
#: over the blocks, and ``nn.Dropout``), "cublas" (the kernel variant: bdlora's GEMMs, dropout and dS/dB kernels),
#: "auto" ("cublas" for calls of at least AUTO_MIN_ROWS rows on a CUDA device outside torch.compile, "peft"
#: otherwise).
LORA_BACKENDS = ("auto", "peft", "cublas")
#: Rows (tokens, padding included) from which "auto" takes the kernels. On one H200 at the 8B shape the kernels
#: were 1.20-1.26x faster per step from ~4,500 rows per call up (batch 32 of 30-250 tokens, 4 x 2048 tokens) and,
#: since a kernel-layer call dispatches fewer torch ops than PEFT's (41 against 56 at a bf16 base), 1.17x at
#: ~1,200-2,000 rows (batch 8, a step bound by host work); smaller calls are not measured (BENCHMARKS.md,
#: "Training").
AUTO_MIN_ROWS = 1024


def init_block_a_like_lora(peft_model) -> None:
    """Re-initialize block-diagonal A factors as N independent standard LoRA A's (kaiming-uniform, a=sqrt(5)).

    PEFT's BlockDiagonalLinear draws its packed (r, d_in/N) weight with a=0; a standard LoRA A of one shard,
    (r/N, d_in/N), uses a=sqrt(5). Both have fan-in d_in/N, so one call on the packed weight gives each block the
    distribution of an independent shard LoRA.
    """
    from peft.tuners.lora.variants import BlockDiagonalLinear

    for module in peft_model.modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict):
            continue
        for sub in lora_a.values():
            if isinstance(sub, BlockDiagonalLinear):
                torch.nn.init.kaiming_uniform_(sub.weight, a=math.sqrt(5))


def check_bd_structure(peft_model, spec: BDLoraSpec, expected: dict[str, str]) -> None:
    """After get_peft_model: exactly the expected modules carry LoRA, with the right factor block-diagonal."""
    from peft.tuners.lora.variants import BlockDiagonalLinear

    seen = {}
    for name, module in peft_model.named_modules():
        if isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict) and "default" in module.lora_A:
            a, b = module.lora_A["default"], module.lora_B["default"]
            layout = ROW if isinstance(a, BlockDiagonalLinear) else COLUMN if isinstance(b, BlockDiagonalLinear) else None
            key = name.removeprefix("base_model.model.")
            bd = a if layout == ROW else b if layout == COLUMN else None
            if bd is not None and (bd.nblocks != spec.nblocks or not bd.weight.is_floating_point()
                                   or tuple(bd.weight.shape) != (bd.out_features, bd.in_features // spec.nblocks)):
                raise BDLoraError(f"{key}: block-diagonal factor of {bd.nblocks} blocks, shape "
                                  f"{tuple(bd.weight.shape)}, {bd.weight.dtype}; expected {spec.nblocks} blocks packed "
                                  f"as ({bd.out_features}, {bd.in_features // spec.nblocks}) float")
            seen[key] = layout
    want = dict(expected)
    if spec.nblocks == 1:  # one block: PEFT may or may not wrap a 1-block matrix; layout is moot
        seen = {k: want.get(k) for k in seen}
    if seen != want:
        extra = sorted(set(seen) - set(want))
        missing = sorted(set(want) - set(seen))
        wrong = sorted(k for k in set(seen) & set(want) if seen[k] != want[k])
        raise BDLoraError(f"PEFT built a different adapter than the spec: unexpected {extra[:5]}, missing "
                          f"{missing[:5]}, wrong block-diagonal factor {wrong[:5]}")


@functools.lru_cache(maxsize=None)  # one class each per process: PEFT keeps instances of them on every layer
def _kernel_classes():
    """(the kernel variant class, the kernel linear class) of :func:`use_bdlora_kernels`."""
    from peft.tuners.lora.layer import Linear as PeftLinear
    from peft.tuners.lora.variants import BdLoraLinearVariant, BlockDiagonalLinear
    from torch.distributed.tensor import DTensor

    from .kernels import KernelOptions
    from .kernels.cublas import compiled_lora_linear, cublas_lora_add_, cublas_lora_linear

    def dropout_p(module, active_adapter: str) -> float:
        """The adapter's LoRA dropout probability in this call (0 in eval mode or without ``nn.Dropout``)."""
        dropout = module.lora_dropout[active_adapter]
        return dropout.p if module.training and isinstance(dropout, torch.nn.Dropout) else 0.0

    @torch.compiler.disable
    def lora_add_eager(result, x, adapter, seed, options):
        """``cublas_lora_add_`` outside any torch.compile graph: its autograd function keeps host-side state that
        dynamo cannot trace, so a compiled model breaks its graph here and runs the kernels eagerly."""
        return cublas_lora_add_(result, x, adapter, seed, options)[0]

    @torch.compiler.disable
    def lora_linear_eager(x, weight, bias, adapter, seed, options):
        """``cublas_lora_linear`` (base GEMM and LoRA term in one autograd function) outside any compiled graph."""
        return cublas_lora_linear(x, weight, bias, [0, x.shape[0]], [adapter], seed, options)[0]

    class KernelBdLoraVariant(BdLoraLinearVariant):
        """PEFT's BD-LoRA variant with its LoRA term on bdlora's GEMMs (``bdlora.kernels.cublas``): block-diagonal
        products as one dense GEMM up to rank 128 (strided-batched blocks above), the scale in the GEMM's alpha, the
        term accumulated into the base layer's output in the expand GEMM's epilogue, dS and dB from one read of dY,
        and dropout drawn inside the kernels from a counter hash (seeded from torch's CPU generator, so
        checkpoint recomputation and resumed runs draw the same masks) where PEFT materialises ``nn.Dropout``'s.
        Same parameters, initialisation, merge and saved adapter as PEFT's variant (it subclasses it). The input is
        taken in its own dtype (the layer disables PEFT's cast of it to the factors' fp32): the products run in the
        activations' dtype, as under autocast."""

        def __init__(self, backend: str = "cublas", options: KernelOptions = KernelOptions()):
            self.backend, self.options = backend, options

        def kernel_call(self, module, active_adapter: str, x: torch.Tensor):
            """(the adapter as ``LoraFactors``, the dropout seed or None) when this call runs on the kernels, None
            when it takes PEFT's own computation."""
            lora_a, lora_b = module.lora_A[active_adapter], module.lora_B[active_adapter]
            # DeepSpeed ZeRO-3 partitions parameters and gathers a sub-module's only when it is called: the factors
            # are read directly here, so they go through PEFT's own calls instead
            if hasattr(lora_a.weight, "ds_id") or hasattr(lora_b.weight, "ds_id"):
                return None
            # under torch.compile "auto" takes PEFT's layer, which compiles with the model ("cublas" runs the
            # kernels as a custom op inside the graph: _fused_forward)
            if self.backend == "auto" and (torch.compiler.is_compiling() or x.device.type != "cuda"
                                           or x.numel() < AUTO_MIN_ROWS * x.shape[-1]):
                return None
            p = dropout_p(module, active_adapter)
            layout = ROW if isinstance(lora_a, BlockDiagonalLinear) else COLUMN if isinstance(lora_b, BlockDiagonalLinear) else None
            nblocks = (lora_a if layout == ROW else lora_b).nblocks if layout else 1
            adapter = LoraFactors(lora_a.weight, lora_b.weight, layout, nblocks, module.scaling[active_adapter], p)
            return adapter, (int(torch.randint(0, 2**62, ())) if p > 0 else None)

        def forward(self, module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
            call = self.kernel_call(module, active_adapter, x)
            if call is None:
                # PEFT's own computation. Its cast of the input to the factors' dtype is exact and, under autocast,
                # undone by the GEMM's cast back to the autocast dtype: there it is left out (two copies of the
                # activations per call, forward and backward), bit for bit PEFT's result, unless dropout is drawn
                # (its masks depend on the dtype it draws them in)
                if dropout_p(module, active_adapter) > 0 or not torch.is_autocast_enabled(x.device.type):
                    x = x.to(module.lora_A[active_adapter].weight.dtype)
                return super().forward(module, active_adapter, x, result, **kwargs)
            if not result.is_contiguous():
                result = result.contiguous()
            return self.add_term_(result, x, call)

        def add_term_(self, result: torch.Tensor, x: torch.Tensor, call) -> torch.Tensor:
            """``result`` (contiguous) plus the LoRA term of ``call`` (:meth:`kernel_call`'s), added in place."""
            return lora_add_eager(result, x, *call, self.options)

    class KernelLoraLinear(PeftLinear):
        """PEFT's LoRA ``Linear`` whose call, where its one active adapter runs on the kernels
        (:meth:`KernelBdLoraVariant.kernel_call`), is one autograd function for the frozen base GEMM and the LoRA
        term (``cublas.CublasLoraLinearFn``): the LoRA expand writes the output and the base GEMM adds onto it in
        its epilogue, and backward adds the base's dX onto the LoRA's the same way, where PEFT's layer runs the
        base layer, then the term, and autograd adds the two dX's (an activation-sized kernel per layer). Every
        other call (adapters disabled or merged, several active, ``adapter_names``, extra arguments, a sharded
        base) is PEFT's own forward, with the variant for the LoRA term; parameters, state dict, merge and saved
        adapter are PEFT's."""

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            fused = None if args or kwargs else self._fused_forward(x)
            return super().forward(x, *args, **kwargs) if fused is None else fused

        def _fused_forward(self, x: torch.Tensor):
            if self.disable_adapters or self.merged or len(self.active_adapters) != 1:
                return None
            name = self.active_adapters[0]
            variant = self.lora_variant.get(name)
            base = self.base_layer
            # a DTensor (sharded) or DeepSpeed-partitioned base weight is gathered by the base layer's own call
            if not isinstance(variant, KernelBdLoraVariant) or name not in self.lora_A \
                    or isinstance(base.weight, DTensor) or hasattr(base.weight, "ds_id"):
                return None
            device = x.device.type
            autocast = torch.is_autocast_enabled(device)
            if not autocast and x.dtype != base.weight.dtype:
                return None
            call = variant.kernel_call(self, name, x)  # draws the dropout seed: only once it is taken
            if call is None:
                return None
            weight, bias = base.weight, base.bias
            if autocast:  # the base GEMM's inputs as autocast would give them to F.linear, each cast dispatched
                # only where one is needed (every dispatched op is host time in a step of small batches)
                dtype = torch.get_autocast_dtype(device)
                x = x if x.dtype == dtype else x.to(dtype)
                weight = weight if weight.dtype == dtype else weight.to(dtype)
                bias = bias if bias is None or bias.dtype == dtype else bias.to(dtype)
            x2 = x.reshape(-1, x.shape[-1])
            adapter, seed = call
            # inside a compiled graph the layer is a custom op (no graph break) where it can be: no dropout, the base
            # frozen; elsewhere the autograd function, which dynamo runs between graphs
            if torch.compiler.is_compiling() and seed is None and not weight.requires_grad and (
                    bias is None or not bias.requires_grad):
                y = compiled_lora_linear(x2, weight, bias, adapter)
            else:
                y = lora_linear_eager(x2, weight, bias, adapter, seed, variant.options)
            return y.view(*x.shape[:-1], y.shape[-1])

    return KernelBdLoraVariant, KernelLoraLinear


@functools.lru_cache(maxsize=None)
def _kbit_kernel_variant_class():
    """The kernel variant of :func:`use_bdlora_kernels` for PEFT's bitsandbytes 4-/8-bit LoRA layers."""
    import bitsandbytes as bnb

    from .quant import kbit_variant_class

    kernel_variant, _ = _kernel_classes()
    kbit_variant = kbit_variant_class()

    class KernelBdLoraKbitVariant(kernel_variant, kbit_variant):
        """bdlora's BD-LoRA variant for a bitsandbytes 4-/8-bit base (``bdlora.quant``) with its LoRA term on
        bdlora's GEMMs and kernels, added in the expand GEMM's epilogue onto the output of the base layer's own k-bit
        forward (there is no base GEMM to fuse with). The products run in the dtype PEFT's k-bit layer computes
        them in: under autocast its dtype, else the factors' (PEFT's layer has already cast the input to it); a
        base output of another dtype takes the k-bit variant's own computation."""

        def forward(self, module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
            device = x.device.type
            dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                     else module.lora_A[active_adapter].weight.dtype)
            call = self.kernel_call(module, active_adapter, x) if result.dtype == dtype else None
            if call is None:
                return kbit_variant.forward(module, active_adapter, x, result, **kwargs)
            # PEFT's 4-bit layer hands over a copy of the base output; the 8-bit one its own output, which autograd
            # may still need: the term is added onto a copy of that
            if not isinstance(module.get_base_layer(), bnb.nn.Linear4bit):
                result = result.clone()
            elif not result.is_contiguous():
                result = result.contiguous()
            return self.add_term_(result, x if x.dtype == dtype else x.to(dtype), call)

    return KernelBdLoraKbitVariant


def use_bdlora_kernels(peft_model, backend: str = "auto", options=None, fuse_base: bool = True) -> int:
    """Runs the LoRA term of every BD-LoRA layer of ``peft_model`` (an ``nn.Linear`` or a bitsandbytes k-bit base) on
    bdlora's kernels (:data:`LORA_BACKENDS`: "cublas" always, "auto" for calls of at least :data:`AUTO_MIN_ROWS` rows
    on a CUDA device and PEFT's own computation otherwise, decided per call so the model may move after this; "peft"
    changes nothing). ``fuse_base``: such a call also runs the frozen base GEMM in the same autograd function (the layer
    becomes a ``KernelLoraLinear``, a subclass of PEFT's ``Linear``); False keeps PEFT's base layer call and adds the
    term onto its output. ``options``: a ``bdlora.kernels.KernelOptions`` (tests force the Triton kernels under the
    interpreter with it). On a bitsandbytes 4-/8-bit base only the LoRA term moves to the kernels (the base layer's
    own k-bit forward stays). Returns the number of layers switched."""
    if backend not in LORA_BACKENDS:
        raise BDLoraError(f"lora_backend: {backend!r} is not one of {list(LORA_BACKENDS)}")
    if backend == "peft":
        return 0
    from peft.tuners.lora.layer import Linear as PeftLinear
    from peft.tuners.lora.variants import BdLoraLinearVariant

    variant_class, linear_class = _kernel_classes()
    kwargs = {} if options is None else {"options": options}
    switched = 0
    for module in peft_model.modules():
        variants = getattr(module, "lora_variant", None)
        if not isinstance(variants, dict):
            continue
        if is_kbit_linear(getattr(module, "base_layer", None)):
            switched += _use_kbit_kernel_variant(variants, backend, kwargs)
            continue
        if type(getattr(module, "base_layer", None)) is not torch.nn.Linear:
            continue
        for name, variant in list(variants.items()):
            if type(variant) is BdLoraLinearVariant:
                variants[name] = variant_class(backend, **kwargs)
                module.cast_input_dtype_enabled = False
                switched += 1
        # the class of an instance is swapped the way FSDP2's fully_shard does it: same object, parameters, hooks
        if fuse_base and type(module) is PeftLinear and any(isinstance(v, variant_class) for v in variants.values()):
            module.__class__ = linear_class
    return switched


def _use_kbit_kernel_variant(variants: dict, backend: str, kwargs: dict) -> int:
    """Swaps a k-bit layer's BD variants (``bdlora.quant``) for their kernel variant; returns how many. PEFT's k-bit
    layer keeps casting the input to the factors' dtype where autocast is off, as the variant expects."""
    from .quant import kbit_variant_class

    switched = 0
    for name, variant in list(variants.items()):
        if type(variant) is kbit_variant_class():
            variants[name] = _kbit_kernel_variant_class()(backend, **kwargs)
            switched += 1
    return switched


def prepare_bd_model(peft_model, spec: BDLoraSpec, a_init: str = "lora", lora_backend: str = "auto"):
    """Checks that PEFT built exactly ``spec``'s adapter on ``peft_model`` (the spec's modules by exact name, the
    right factor block-diagonal with N packed blocks: PEFT matches names by substring); with ``a_init="lora"``,
    starts every block-diagonal A like an independent rank r/N LoRA A of its shard; runs the BD layers on bdlora's
    kernels per ``lora_backend`` (:func:`use_bdlora_kernels`). Returns the model; raises
    :class:`~bdlora.spec.BDLoraError` naming what differs."""
    if a_init not in ("lora", "peft"):
        raise BDLoraError(f"a_init: {a_init!r} is not 'lora' or 'peft'")
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    check_bd_structure(peft_model, spec, spec.matching_modules(base))
    if a_init == "lora":
        init_block_a_like_lora(peft_model)
    use_bdlora_kernels(peft_model, lora_backend)
    return peft_model


__all__ = ["AUTO_MIN_ROWS", "LORA_BACKENDS", "check_bd_structure", "init_block_a_like_lora", "prepare_bd_model", "use_bdlora_kernels"]
