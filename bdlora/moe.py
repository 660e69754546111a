"""BD-LoRA on the fused expert tensors of Mixture-of-Experts models.

transformers stores a MoE block's experts as two 3-D tensors (Qwen3-MoE, Mixtral-style ``*Experts`` modules):

    gate_up_proj  (E, 2I, H)   rows [0, I) the gate projection, [I, 2I) the up projection (``chunk(2, -1)``)
    down_proj     (E, H, I)

Under tensor parallelism over N devices (vLLM's ``FusedMoE``) device k holds, of every expert, the gate rows
``[k I/N, (k+1) I/N)`` and the same up rows (``w13``, (E, 2I/N, H)) and the down columns ``[k I/N, (k+1) I/N)``
(``w2``, (E, H, I/N)): gate_up is column-parallel with two slices, down row-parallel. BD-LoRA follows those shards:

* ``gate_up_proj``, column layout with 2 slices: ``lora_A`` (E, r, H) dense, ``lora_B`` (E, 2I, r/N) packed in the
  weight's own row order; row j of either slice belongs to block ``(j mod I) // (I/N)``, and block k's rows read
  rank block k (rows ``[k r/N, (k+1) r/N)`` of ``lora_A``);
* ``down_proj``, row layout: ``lora_A`` (E, r, I/N) packed (block k: rows ``[k r/N, (k+1) r/N)``, reading input
  columns ``[k I/N, (k+1) I/N)``), ``lora_B`` (E, H, r) dense.

So device k holds and computes, for every expert, an independent rank r/N LoRA of its own shard (its blocks of the
packed factor and its rank rows/columns of the dense one: :func:`device_factors`), and the LoRA needs no
communication: the down projection's partial sums ride on the all-reduce the base layer does anyway. The scale is
the dense layers' rsLoRA one, ``alpha / sqrt(r/N)`` per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layout import COLUMN, ROW, Layout, unpack_block_diagonal
from .spec import BDLoraError

#: the fused expert tensors BD-LoRA adapts: {parameter name: (layout, output slices)}
EXPERT_TENSORS: dict[str, tuple[Layout, int]] = {"gate_up_proj": (COLUMN, 2), "down_proj": (ROW, 1)}


def check_expert_shapes(name: str, weight_shape, nblocks: int, r: int) -> None:
    """Raises :class:`BDLoraError` naming the tensor when N blocks cannot follow its shards."""
    layout, slices = EXPERT_TENSORS[name]
    _, d_out, d_in = weight_shape
    split = d_out // slices if layout == COLUMN else d_in
    if (layout == COLUMN and d_out % slices) or split % nblocks or r % nblocks:
        what = "each of its output slices" if layout == COLUMN else "its input"
        raise BDLoraError(f"{name} {tuple(weight_shape)}: {what} ({split}) and the rank r={r} must divide into "
                          f"nblocks={nblocks} equal blocks")


def factor_shapes(name: str, weight_shape, nblocks: int, r: int) -> tuple[tuple, tuple]:
    """(lora_A, lora_B) shapes of the packed factors of one expert tensor (E, d_out, d_in)."""
    check_expert_shapes(name, weight_shape, nblocks, r)
    e, d_out, d_in = weight_shape
    if EXPERT_TENSORS[name][0] == COLUMN:
        return (e, r, d_in), (e, d_out, r // nblocks)
    return (e, r, d_in // nblocks), (e, d_out, r)


def expert_lora(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, layout: Layout, nblocks: int,
                slices: int = 1) -> torch.Tensor:
    """One expert's LoRA term (unscaled): x (T, d_in) -> (T, d_out) through its packed factors (2-D: one expert's
    slice of the (E, ...) tensors), block-diagonal as the module docstring lays out; differentiable."""
    t = x.shape[0]
    n = nblocks
    if layout == COLUMN:
        r = lora_a.shape[0]
        s = (x @ lora_a.t()).view(t, n, r // n)  # rank block k feeds output block k
        d_out = lora_b.shape[0]
        b = lora_b.view(slices, n, d_out // (slices * n), r // n)
        return torch.einsum("tkc,skjc->tskj", s, b).reshape(t, d_out)
    r, kb = lora_a.shape
    s = torch.einsum("tkm,kcm->tkc", x.view(t, n, kb), lora_a.view(n, r // n, kb)).reshape(t, r)
    return s @ lora_b.t()


def dense_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, layout: Layout, nblocks: int, slices: int = 1
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (E, r, d_in), (E, d_out, r) dense factors with the zeros of the block-diagonal one written out
    (``bdlora.layout.unpack_block_diagonal`` per expert, and per output slice for gate_up): the standard expert LoRA
    that computes the same (for engines without BD, and references)."""
    if layout == COLUMN:
        dense_b = torch.stack([torch.cat([unpack_block_diagonal(part, nblocks) for part in b.chunk(slices, dim=0)])
                               for b in lora_b])
        return lora_a, dense_b
    return torch.stack([unpack_block_diagonal(a, nblocks) for a in lora_a]), lora_b


def device_blocks(nblocks: int, k: int, n_devices: int) -> list[int]:
    """The blocks device k of ``n_devices`` computes with: N/M whole blocks when M | N, one block shared by M/N
    devices when N | M."""
    if n_devices <= nblocks:
        per = nblocks // n_devices
        return list(range(k * per, (k + 1) * per))
    return [k // (n_devices // nblocks)]


def device_factors(name: str, lora_a: torch.Tensor, lora_b: torch.Tensor, nblocks: int, k: int, n_devices: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Device k's plain LoRA factors of one expert tensor at tensor-parallel size M = ``n_devices``, for its own
    shard of every expert (gate rows then up rows for gate_up, as vLLM's ``w13``; down's input columns), where M | N
    or N | M: (E, r_k, d_in_k), (E, d_out_k, r_k) with r_k = r/N x its blocks (:func:`device_blocks`). M = N: its
    own block, no zeros; M < N: its N/M blocks assembled block-diagonally (the zeros exist only here); M > N: its
    block's A replicated and B's rows of its part of the block (gate_up), or its part of the block's inputs in A and
    the block's B replicated (down). The devices' terms add up to the adapter's (down: partial sums)."""
    if n_devices % nblocks and nblocks % n_devices:
        raise BDLoraError(f"{name}: an adapter of nblocks={nblocks} cannot be split over {n_devices} devices (one "
                          "must divide the other)")
    layout, slices = EXPERT_TENSORS[name]
    rb = lora_a.shape[1] // nblocks if layout == COLUMN else lora_b.shape[2] // nblocks
    if n_devices == nblocks:  # the common case: no zeros, plain views of the packed factors
        ranks = slice(k * rb, (k + 1) * rb)
        if layout == COLUMN:
            e, d_out, _ = lora_b.shape
            rows = lora_b.view(e, slices, nblocks, d_out // (slices * nblocks), rb)[:, :, k].reshape(e, -1, rb)
            return lora_a[:, ranks], rows
        return lora_a[:, ranks], lora_b[:, :, ranks]
    ranks = torch.cat([torch.arange(b * rb, (b + 1) * rb) for b in device_blocks(nblocks, k, n_devices)])
    dense_a, dense_b = dense_factors(lora_a, lora_b, layout, nblocks, slices)
    if layout == COLUMN:  # this device's output rows (in each slice), the ranks that reach them
        e, d_out, _ = dense_b.shape
        rows = dense_b.view(e, slices, n_devices, d_out // (slices * n_devices), -1)[:, :, k].reshape(e, -1,
                                                                                                   dense_b.shape[2])
        return dense_a[:, ranks].contiguous(), rows[:, :, ranks].contiguous()
    d_in = dense_a.shape[2] // n_devices  # this device's input columns, the ranks they reach
    return dense_a[:, ranks, k * d_in:(k + 1) * d_in].contiguous(), dense_b[:, :, ranks].contiguous()


def device_weights(gate_up: torch.Tensor, down: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Device k's shards of the experts at tensor-parallel size n, as vLLM's ``FusedMoE`` holds them: ``w13``
    (E, 2I/n, H), gate rows then up rows, and ``w2`` (E, H, I/n)."""
    e, two_i, h = gate_up.shape
    i = two_i // 2
    w13 = gate_up.view(e, 2, n, i // n, h)[:, :, k].reshape(e, 2 * i // n, h)
    return w13, down[:, :, k * (i // n):(k + 1) * (i // n)]


#: the ``target_parameters`` of an expert LoRA on both tensors (PEFT's ``ParamWrapper``; gate_up's factors sit under
#: ``experts.base_layer``: :func:`expert_key_prefixes`)
PEFT_TARGET_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def peft_expert_factors(name: str, lora_a: torch.Tensor, lora_b: torch.Tensor, nblocks: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense equivalent of one expert tensor's BD factors as PEFT stores an expert LoRA
    (``ParamWrapper``): ``lora_A.weight`` (r*E, d_in), rows ``e*r + j``; ``lora_B.weight`` (d_out, r*E), columns
    ``j*E + e``. With ``lora_alpha`` = block alpha x sqrt(N) and ``use_rslora`` PEFT computes the same term, so
    PEFT and engines that serve PEFT expert LoRAs run a BD expert adapter without knowing BD."""
    layout, slices = EXPERT_TENSORS[name]
    return to_peft_layout(*dense_factors(lora_a, lora_b, layout, nblocks, slices))


def to_peft_layout(lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (E, ra, da), (E, db, rb) expert factors flattened as PEFT flattens an expert LoRA's: ``lora_A``
    (ra*E, da) with rows ``e*ra + j``, ``lora_B`` (db, rb*E) with columns ``j*E + e``. The packed (block-diagonal)
    factor keeps its packed width: (r*E, d_in/N) for down's A, (2I, (r/N)*E) for gate_up's B."""
    e = lora_a.shape[0]
    return lora_a.reshape(e * lora_a.shape[1], lora_a.shape[2]), lora_b.permute(1, 2, 0).reshape(lora_b.shape[1], -1)


def from_peft_layout(flat_a: torch.Tensor, flat_b: torch.Tensor, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`to_peft_layout`: (E, ra, da), (E, db, rb)."""
    e = num_experts
    if flat_a.shape[0] % e or flat_b.shape[1] % e:
        raise BDLoraError(f"expert factors {tuple(flat_a.shape)} / {tuple(flat_b.shape)} do not split into "
                          f"{e} experts")
    a = flat_a.reshape(e, flat_a.shape[0] // e, flat_a.shape[1])
    return a, flat_b.reshape(flat_b.shape[0], flat_b.shape[1] // e, e).permute(2, 0, 1)


# ---------------------------------------------------------------------------------------------------- folder format
# A BD expert adapter is a PEFT LoRA folder whose config lists the fused expert tensors in ``target_parameters``
# and their names in ``use_bdlora`` beside the dense layers' (gate_up_proj with the
# block-diagonal B, down_proj with the block-diagonal A); its tensors carry PEFT's expert-LoRA key names and
# flattening (:func:`to_peft_layout`), block-diagonal factors packed. ``bdlora convert to-dense`` writes the dense
# equivalent, which is a PEFT expert LoRA PEFT loads as it is. Reading and writing the folder is bdlora.adapter's.


def expert_key_prefixes(target_parameters) -> dict[str, str]:
    """{expert tensor name: PEFT's module suffix of its factors}. PEFT wraps a module's targeted parameters in the
    order the module registers them (transformers' experts: gate_up_proj, then down_proj), whatever the config's
    order (which PEFT saves from a set), the first innermost: parameter i of k targeted sits under k-1-i
    ``base_layer`` levels of ``mlp.experts``."""
    targeted = {t.rsplit(".", 1)[-1] for t in target_parameters}
    names = [n for n in EXPERT_TENSORS if n in targeted]
    return {n: "mlp.experts" + ".base_layer" * (len(names) - 1 - i) for i, n in enumerate(names)}


def expert_module_suffixes(target_parameters) -> tuple[str, ...]:
    """Endings of the PEFT module paths that hold fused expert factors (``<path>.mlp.experts[.base_layer]``)."""
    return tuple("." + pre for pre in expert_key_prefixes(target_parameters).values())


def check_target_parameters(target_parameters) -> Optional[str]:
    """None when ``target_parameters`` are fused expert tensors bdlora reads (``mlp.experts.gate_up_proj`` and/or
    ``mlp.experts.down_proj``, in any order), else why not."""
    if (not isinstance(target_parameters, (list, tuple)) or not target_parameters
            or any(t not in PEFT_TARGET_PARAMETERS for t in target_parameters)
            or len(set(target_parameters)) != len(target_parameters)):
        return (f"target_parameters={target_parameters!r} (bdlora reads LoRA on the fused expert tensors "
                f"{list(PEFT_TARGET_PARAMETERS)} and no other parameters)")
    return None


@dataclass
class ExpertFactors:
    """One layer's LoRA on one fused expert tensor, per expert: ``lora_A`` (E, r, d_in or d_in/N), ``lora_B``
    (E, d_out, r/N or r) as :func:`factor_shapes` lays them out; ``nblocks`` 1 for a dense (PEFT) expert LoRA."""

    name: str
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    nblocks: int
    scale: float

    @property
    def num_experts(self) -> int:
        return self.lora_A.shape[0]

    def numel(self) -> int:
        return self.lora_A.numel() + self.lora_B.numel()

    def dense_numel(self) -> int:
        e, r, d_in = self.lora_A.shape
        if EXPERT_TENSORS[self.name][0] == ROW:
            d_in *= self.nblocks
        return e * r * (d_in + self.lora_B.shape[1])

    def dense(self) -> "ExpertFactors":
        layout, slices = EXPERT_TENSORS[self.name]
        a, b = dense_factors(self.lora_A, self.lora_B, layout, self.nblocks, slices)
        return ExpertFactors(self.name, a, b, 1, self.scale)


class BDLoraExperts(nn.Module):
    """A transformers experts module (``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I), ``act_fn``) with
    BD-LoRA on both tensors: the base stays frozen, the packed factors train. ``forward`` takes the experts module's
    arguments (hidden states (T, H), top-k expert indices and weights) and routes as transformers' loop does."""

    def __init__(self, experts: nn.Module, nblocks: int, r: int, lora_alpha: float):
        super().__init__()
        self.base = experts
        for p in experts.parameters():
            p.requires_grad_(False)
        self.nblocks, self.r = nblocks, r
        self.scale = lora_alpha / math.sqrt(r / nblocks)
        self.num_experts = experts.gate_up_proj.shape[0]
        for name in EXPERT_TENSORS:
            w = getattr(experts, name)
            a_shape, b_shape = factor_shapes(name, w.shape, nblocks, r)
            a = torch.empty(a_shape, dtype=torch.float32, device=w.device)
            fan_in = a_shape[-1]  # a standard LoRA A of one shard: kaiming-uniform over the shard's fan-in
            nn.init.uniform_(a, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
            self.register_parameter(f"{name}_lora_A", nn.Parameter(a))
            self.register_parameter(f"{name}_lora_B", nn.Parameter(torch.zeros(b_shape, dtype=torch.float32,
                                                                                device=w.device)))

    def factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"{name}_lora_A"), getattr(self, f"{name}_lora_B")

    def _linear(self, name: str, x: torch.Tensor, e: int) -> torch.Tensor:
        layout, slices = EXPERT_TENSORS[name]
        a, b = self.factors(name)
        y = F.linear(x, getattr(self.base, name)[e])
        lora = expert_lora(x.to(a.dtype), a[e], b[e], layout, self.nblocks, slices)
        return y + (self.scale * lora).to(y.dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            hit = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).sum(dim=(0, 1)).nonzero()
        for e in hit.flatten().tolist():
            tok, pos = torch.where(top_k_index == e)
            x = hidden_states[tok]
            gate, up = self._linear("gate_up_proj", x, e).chunk(2, dim=-1)
            h = self._linear("down_proj", self.base.act_fn(gate) * up, e)
            out.index_add_(0, tok, (h * top_k_weights[tok, pos, None]).to(out.dtype))
        return out


def fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """{module name: module} of ``model``'s fused experts modules: 3-D ``gate_up_proj`` (E, 2I, H) and ``down_proj``
    (E, H, I) parameters and an ``act_fn``, as transformers stores Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE experts.
    Other 3-D expert layouts (GPT-OSS's (E, H, 2I) interleaved) are not listed."""
    out = {}
    for name, m in model.named_modules():
        gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if (isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) and gu.dim() == 3 and down.dim() == 3
                and hasattr(m, "act_fn") and not isinstance(m, BDLoraExperts)
                and gu.shape[0] == down.shape[0] and gu.shape[1] == 2 * down.shape[2] and gu.shape[2] == down.shape[1]):
            out[name] = m
    return out


@torch.no_grad()
def _routes_like(experts: nn.Module, wrapped: "BDLoraExperts", top_k: int = 2) -> bool:
    """Whether ``wrapped`` (its B factors still zero) computes what ``experts`` does on random tokens and routes:
    the module's own forward is the reference, so an experts class that computes differently is never trained
    through a different computation."""
    e, _, h = experts.gate_up_proj.shape
    w = experts.gate_up_proj
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(5, h, generator=g).to(device=w.device, dtype=w.dtype)
    k = min(top_k, e)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(5)]).to(w.device)
    wts = torch.rand(5, k, generator=g).to(device=w.device, dtype=w.dtype)
    try:
        ref = experts(x, idx, wts)
    except Exception:  # noqa: BLE001 - a different forward signature: not this module family
        return False
    return torch.allclose(wrapped(x, idx, wts), ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()) + 1e-6)


def wrap_experts(model: nn.Module, nblocks: int, r: int, lora_alpha: float) -> dict[str, "BDLoraExperts"]:
    """Replaces every fused experts module of ``model`` (:func:`fused_experts`) by a :class:`BDLoraExperts` around
    it, in place; returns {module name: BDLoraExperts}. Raises :class:`BDLoraError` naming the module when N blocks
    cannot follow its shards or when its forward computes differently from transformers' expert loop."""
    found = fused_experts(model)
    out = {}
    for name, experts in found.items():
        try:
            wrapped = BDLoraExperts(experts, nblocks, r, lora_alpha)
        except BDLoraError as e:
            raise BDLoraError(f"{name}.{e}") from None
        if not _routes_like(experts, wrapped):
            raise BDLoraError(f"{name} ({type(experts).__name__}): its experts do not compute gate/up = "
                              "chunk(x @ gate_up_proj[e].T), down_proj[e] @ (act(gate) * up) as bdlora's expert "
                              "LoRA assumes; train this model without expert adapters (target_parameters: [])")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, wrapped)
        out[name] = wrapped
    return out


def trained_expert_factors(state: dict[str, torch.Tensor], modules: dict[str, "BDLoraExperts"]
                           ) -> dict[str, ExpertFactors]:
    """{``<module path>.<tensor>``: ExpertFactors} of wrapped experts ``modules`` (by their paths in the model the
    ``state`` dict comes from), the factors taken from ``state`` (parameter name -> tensor: a gathered adapter)."""
    return {f"{path}.{name}": ExpertFactors(name, state[f"{path}.{name}_lora_A"].detach().cpu(),
                                            state[f"{path}.{name}_lora_B"].detach().cpu(), m.nblocks, m.scale)
            for path, m in modules.items() for name in EXPERT_TENSORS}


def check_experts_intact(modules: dict[str, "BDLoraExperts"]) -> Optional[str]:
    """None while every wrapped experts module still runs :meth:`BDLoraExperts.forward`, else which one does not
    (a kernel library that rebinds experts' ``forward``, such as Liger's SwiGLU patch, would drop the LoRA)."""
    for name, m in modules.items():
        if getattr(m.forward, "__func__", None) is not BDLoraExperts.forward:
            return f"{name}: its forward was replaced ({getattr(m.forward, '__qualname__', m.forward)!r})"
    return None


__all__ = ["BDLoraExperts", "EXPERT_TENSORS", "ExpertFactors", "PEFT_TARGET_PARAMETERS", "check_expert_shapes",
           "check_experts_intact", "check_target_parameters", "dense_factors", "device_blocks", "device_factors",
           "device_weights",
           "expert_key_prefixes", "expert_lora", "expert_module_suffixes", "factor_shapes", "from_peft_layout", "fused_experts",
           "peft_expert_factors", "to_peft_layout", "trained_expert_factors", "wrap_experts"]
