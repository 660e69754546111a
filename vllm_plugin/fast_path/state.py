"""The state of the fast path: per engine (:class:`LayerBuild`), per punica wrapper (:class:`TokenSlots`) and per
layer (:class:`LayerState`). Every buffer a CUDA graph may capture is allocated here, when the layers are built."""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from bdlora.kernels import KernelOptions
from bdlora.kernels.decode import FoldedLaunch, SlotSegments

from .. import vllm_api as api
from . import FastPathOptions

logger = logging.getLogger("bdlora.vllm_plugin")

#: Prefix of the fast-path layers' names in the engine's registry (never one of vLLM's own layer prefixes).
NAME_PREFIX = "bdlora:"


def op_key_name(key: torch.Tensor) -> str:
    """The registry name of the layer whose op key is ``key``: the key's address (a key is never reallocated, and
    each engine has its own registry)."""
    return f"{NAME_PREFIX}{key.data_ptr():#x}"


@dataclass
class LayerBuild:
    """What one BD-mode LoRA manager (one engine's worker) builds its layers with, handed to the layers through the
    classes of :func:`bdlora.vllm_plugin.layers.layer_classes` (the loader makes one per ``create_lora_manager``).

    ``rank``: the per-device buffer rank; ``options``: the fast path's options (None: vLLM's kernels for every
    size); ``registry``: the engine's ``compilation_config.static_forward_context``, where each fast-path layer is
    entered under its name for the custom ops to find through vLLM's forward context; ``path_counts``: calls of the
    custom ops by the path that ran (:func:`bdlora.vllm_plugin.diagnostics.read_path_counts`); ``workspaces``: one
    decode workspace per device, one one-launch workspace per (device, dtype) and the side stream per device, shared by
    this build's layers (their launches never overlap). A new build starts new ones, so a later engine never resizes
    buffers an earlier one's graphs captured."""

    rank: int
    options: Optional[FastPathOptions] = None
    registry: dict = field(default_factory=dict)
    path_counts: Counter = field(default_factory=Counter)
    workspaces: dict = field(default_factory=dict)
    tunings: dict = field(default_factory=dict)
    logged: set = field(default_factory=set)

    def tuning(self, dev):
        """This build's ``ServingTuning`` for a device (its JSON file, with the options' overrides), looked up once per
        device and logged."""
        from .tuning import device_tuning

        dev = torch.device(dev)
        if dev not in self.tunings:
            tuning, source = device_tuning(dev, self.options.tuning_dict())
            self.tunings[dev] = tuning
            logger.info("bdlora kernels on %s: %s (%s)", dev, tuning, source)
        return self.tunings[dev]

    def register(self, layer, dev) -> torch.Tensor:
        """Makes ``layer``'s op key, enters the layer in the engine's registry under the key's name
        (:func:`op_key_name`) and returns the key.

        The key is a one-element tensor on ``dev`` that the custom ops take to find their layer. A tensor rather
        than a name because torch.compile lifts it to a graph input: the layers of one kind then trace to the same
        graph, which vLLM compiles once for all of them (it compiles isometric piecewise graphs once; a name would
        be a constant that differs per layer, one compilation per layer)."""
        key = torch.zeros(1, dtype=torch.int32, device=dev)
        self.registry[op_key_name(key)] = layer
        return key

    def log_once(self, level: int, key, msg: str, *args) -> None:
        """Logs ``msg`` the first time this build sees ``key`` (a message per layer kind, not per layer)."""
        if key not in self.logged:
            self.logged.add(key)
            logger.log(level, msg, *args)

    def side_stream(self, dev):
        """The second CUDA stream this build's layers compute LoRA terms on beside their base GEMMs (``side_max``),
        one per device; None off CUDA (the term then runs on the one stream, before the GEMM)."""
        dev = torch.device(dev)
        if dev.type != "cuda":
            return None
        return self.workspaces.setdefault(("side_stream", dev), torch.cuda.Stream(device=dev))

    def decode_workspace(self, dev, max_tokens: int, n_slices: int, max_out: int, d_in: int, rank: int):
        """This build's two-launch workspace for the device, grown at layer build time (before any CUDA-graph capture)
        so that every batch of up to ``max_tokens`` tokens through the layer fits."""
        from bdlora.kernels.decode import DecodeWorkspace, decode_grid, decode_tiles

        dev = torch.device(dev)
        ws = self.workspaces.setdefault(dev, DecodeWorkspace(dev))
        tiles = decode_tiles(dev)
        for t in range(1, max_tokens + 1):
            ws.reserve(decode_grid(t, n_slices, 1, max_out, d_in, rank, tiles))
        return ws

    def gemv_workspace(self, dev, dtype, folded, max_tokens: int, tiles):
        """This build's one-launch workspace for the device and dtype, grown at layer build time for batches of up to
        ``max_tokens`` tokens through the folded layer."""
        from bdlora.kernels import GemvWorkspace

        dev = torch.device(dev)
        ws = self.workspaces.setdefault(("gemv", dev, dtype), GemvWorkspace(dev, dtype))
        return ws.reserve(folded, max_tokens, tiles)


class TokenSlots:
    """Per punica wrapper: ``buf`` (int32, max_num_batched_tokens) = the wrapper's token -> LoRA slot map for the
    current batch, -1 after it (padding tokens of a CUDA graph add no LoRA, and stale or uninitialized entries of
    ``_token_lora_indices`` are never read). Refreshed right after each ``update_metadata`` (host side, before the
    forward), so a captured graph, which reads ``buf``, sees every new mapping."""

    def __init__(self, wrapper):
        src = wrapper._token_lora_indices
        self.buf = torch.full((src.shape[0],), -1, dtype=torch.int32, device=src.device)
        self._segments: dict = {}  # n_loras -> SlotSegments of buf (segments())
        self._wrapper = weakref.ref(wrapper)
        orig = wrapper.update_metadata

        def update_metadata(*args, **kwargs):
            out = orig(*args, **kwargs)
            self.refresh()
            return out

        api.patch(wrapper, "update_metadata", update_metadata, point="PunicaWrapperBase.update_metadata")  # instance
        self.refresh()

    @classmethod
    def of(cls, wrapper) -> Optional["TokenSlots"]:
        """The wrapper's TokenSlots (made on first use), or None where it has no ``_token_lora_indices``."""
        slots = getattr(wrapper, "_bdlora_token_slots", None)
        if slots is None and isinstance(getattr(wrapper, "_token_lora_indices", None), torch.Tensor):
            slots = cls(wrapper)
            wrapper._bdlora_token_slots = slots
        return slots

    def refresh(self) -> None:
        w = self._wrapper()
        if w is None:
            return
        n = min(int(w.indices_len[0] or 0), self.buf.shape[0])
        if n:
            self.buf[:n].copy_(w._token_lora_indices[:n])
        self.buf[n:].fill_(-1)
        for seg in self._segments.values():
            seg.update(self.buf)

    def segments(self, n_loras: int) -> SlotSegments:
        """``buf`` grouped by slot for ``n_loras`` slots (the tiled kernel on sorted tokens, ``gemm_sorted``): one
        ``SlotSegments`` per slot count, regrouped at every refresh (a few small kernels, once per slot map)."""
        seg = self._segments.get(n_loras)
        if seg is None:
            # first asked for inside a forward (inference mode), but updated by every later refresh, also outside it:
            # normal tensors (an inference tensor may not be written outside inference mode)
            with torch.inference_mode(False):
                seg = self._segments[n_loras] = SlotSegments.empty(self.buf.shape[0], n_loras, self.buf.device)
            seg.update(self.buf)
        return seg


@dataclass
class FoldPaths:
    """A fold layer's [W; A] and its cut-offs by token count T (see :mod:`.ladder`): T == 1 with one-token tiles or
    T <= ``gemv_max`` the one-launch kernel, from ``min_tokens`` up to ``decode_max`` the per-token kernel, up to
    ``gemm_max`` the tiled one (with ``gemm_rows``' tiles; ``gemm_sorted``: on the tokens grouped by slot)."""

    weight: object  # bdlora.kernels.FoldedWeight ([W; A])
    decode_max: int = 0
    gemm_max: int = 0
    min_tokens: int = 1  # a wide fold's multi-token kernels start above two_launch_max
    gemv_max: int = 0
    gemm_rows: object = None  # ServingTuning.gemm_rows for this layer
    gemm_sorted: bool = False
    gemv_tiles: object = None  # bdlora.kernels.GemvTiles for this layer's shape, or None
    gemv_one_token_tiles: object = None  # GemvTiles(one_token=True) for T == 1, or None
    gemv_workspace: object = None  # bdlora.kernels.GemvWorkspace shared by the build's layers on the device

    @property
    def max_tokens(self) -> int:
        """The most tokens a forward may have for the fold's multi-token kernels (from ``min_tokens``); 0: the fold
        serves one-token forwards only."""
        return max(self.gemm_max, self.gemv_max)


@dataclass
class SidePath:
    """The LoRA term on a second CUDA stream beside the base GEMM, for forwards of 2..``max_tokens`` tokens (one token
    too with ``defer``, whose add the caller leaves to the next compiled kernel); ``stream`` None off CUDA."""

    max_tokens: int = 0
    defer: bool = False
    stream: object = None


@dataclass
class LayerState:
    """One BD layer's fast-path buffers and paths (all persistent: a CUDA graph captures their addresses)."""

    name: str  # the base layer's prefix, for messages
    two_launch_max: int  # the two-launch kernel serves T <= this, vLLM's punica path above
    backend: str
    lora_a: torch.Tensor  # (S, L, R, d_in), a view of the tensor behind lora_a_stacked
    lora_b: torch.Tensor  # (L, sum d_out, R)
    b_shared: bool  # lora_b is lora_b_stacked[0]'s storage (one slice) rather than a copy
    offsets: tuple  # slice column offsets (S + 1 ints)
    soff: torch.Tensor  # the same, int32 on the device
    ranks: torch.Tensor  # (L,) int32: rank in use per slot, 0 = empty
    scales: torch.Tensor  # (L,) float32: ones (vLLM folds the scale into B)
    build: Optional[LayerBuild] = None  # the engine's build: path counters, messages logged once
    workspace: object = None  # bdlora.kernels.DecodeWorkspace shared by this engine's layers on the device
    slots: Optional[TokenSlots] = None
    fold: Optional[FoldPaths] = None  # None: the layer does not fold
    side: SidePath = field(default_factory=SidePath)
    pdl: bool = False  # the tuning's pdl (launch the kernels with programmatic dependent launch)
    options: KernelOptions = field(init=False)  # KernelOptions(backend=backend), built once: every forward uses it
    #: the fold's prepared launches (kernel "decode"/"gemm") by (kernel, tiles), built on first use: a prefill
    #: runs eagerly, so the op's host time is paid per call. Bound to ``slots``; dropped when the mapping changes.
    plans: dict = field(init=False, default_factory=dict)
    gemm_rows_warm: bool = False  # every gemm_rows row this layer may take has been launched once (warm_gemm_rows)

    def __post_init__(self):
        self.options = KernelOptions(backend=self.backend)

    def plan(self, kernel: str, tiles) -> FoldedLaunch:
        key = (kernel, tiles)
        plan = self.plans.get(key)
        if plan is None:
            n_loras = self.lora_b.shape[0]
            segments = (self.slots.segments(n_loras) if kernel == "gemm" and self.fold.gemm_sorted and n_loras > 1
                        else None)
            plan = self.plans[key] = FoldedLaunch(
                self.fold.weight, self.lora_b, self.slots.buf, self.ranks, self.scales, self.offsets, kernel=kernel,
                tiles=tiles, pdl=self.pdl, options=self.options, segments=segments)
        return plan

    def rebind(self, slots: Optional[TokenSlots]) -> None:
        """A new punica wrapper's slot map: the prepared launches were bound to the old one."""
        self.slots = slots
        self.plans.clear()
        self.gemm_rows_warm = False

    def warm_gemm_rows(self, x: torch.Tensor) -> None:
        """Launches the tiled plan of every ``gemm_rows`` row this layer's forwards may take once, on x's first row
        (output dropped), at its first tiled forward: Triton compiles one kernel per tile row, and a row first met
        mid-serving (a prefill of 257-2048 tokens, which neither vLLM's warm-up sizes nor its profile run reach)
        compiled there, a latency spike that vLLM's JIT monitor reported on an H100. Skipped while a
        CUDA graph captures (compiling and launching there would land in the graph); the next eager call does it."""
        fold = self.fold
        if self.gemm_rows_warm or fold.gemm_rows is None or self.slots is None:
            return
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        self.gemm_rows_warm = True
        lo = max(fold.min_tokens, fold.decode_max + 1)
        for tiles in fold.gemm_rows.tiles_between(lo, fold.gemm_max):
            self.plan("gemm", tiles)(x[:1])
