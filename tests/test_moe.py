"""BD-LoRA on fused expert tensors (``bdlora.moe``): N independent rank r/N LoRAs on the N tensor-parallel shards
of every expert (vLLM's ``w13`` / ``w2``), in float64; the dense equivalent; refusals."""

from __future__ import annotations

import math

import pytest
import torch

from bdlora.moe import (BDLoraExperts, EXPERT_TENSORS, dense_factors, device_factors, device_weights, expert_lora,
                        factor_shapes)
from bdlora.spec import BDLoraError


def _experts(e=4, h=16, i=8, seed=0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=2)
    experts = Qwen3MoeExperts(cfg).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return experts


def _bd(experts, n, r, seed=1):
    bd = BDLoraExperts(experts, nblocks=n, r=r, lora_alpha=8.0).to(experts.gate_up_proj.dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bd.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.2)
    return bd


def _routing(t=11, e=4, k=2, seed=2):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g, dtype=torch.float64)
    return idx, w / w.sum(-1, keepdim=True)


def _sharded_reference(bd: BDLoraExperts, x, idx, w, m=None):
    """Every device k of m (default N) computes its own shard of every expert with a plain LoRA of its own (rank
    r/N per block it holds, the adapter's scale alpha/sqrt(r/N)); the down projection's partial outputs are summed
    (the row-parallel all-reduce). Factors are views (M = N) or functions of bd's packed parameters, so gradients
    land on the same tensors."""
    n, base = bd.nblocks, bd.base
    m = m or n
    scale = 8.0 / math.sqrt(bd.r / n)
    out = torch.zeros_like(x)
    for k in range(m):
        w13, w2 = device_weights(base.gate_up_proj, base.down_proj, k, m)
        a1, b1 = device_factors("gate_up_proj", *bd.factors("gate_up_proj"), n, k, m)
        a2, b2 = device_factors("down_proj", *bd.factors("down_proj"), n, k, m)
        for e in range(bd.num_experts):
            tok, pos = torch.where(idx == e)
            if not len(tok):
                continue
            xe = x[tok]
            gu = xe @ w13[e].t() + scale * (xe @ a1[e].t()) @ b1[e].t()
            gate, up = gu.chunk(2, dim=-1)  # the shard's gate rows, then its up rows
            hk = base.act_fn(gate) * up
            part = hk @ w2[e].t() + scale * (hk @ a2[e].t()) @ b2[e].t()
            out = out.index_add(0, tok, part * w[tok, pos, None])
    return out


@pytest.mark.parametrize("n,r", [(2, 4), (4, 8), (1, 4)])
def test_bd_experts_equal_independent_shard_loras(n, r):
    experts = _experts()
    bd = _bd(experts, n, r)
    idx, w = _routing()
    x = torch.randn(11, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = bd(x1, idx, w)
    y_ref = _sharded_reference(bd, x2, idx, w)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    base_only = experts(x, idx, w)
    assert (y - base_only).abs().max() > 1e-3  # the adapter changes the output
    g = torch.randn_like(y)
    params = [p for p in bd.parameters() if p.requires_grad]
    grads = torch.autograd.grad((y * g).sum(), params + [x1])
    grads_ref = torch.autograd.grad((y_ref * g).sum(), params + [x2])
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert all(gr.abs().sum() > 0 for gr in grads)  # every factor of every tensor trains


@pytest.mark.parametrize("n,m", [(2, 1), (4, 2), (2, 4), (1, 2)])
def test_bd_experts_split_over_other_device_counts(n, m):
    """Served at M devices with M | N (each holds N/M blocks, rank r/M) or N | M (a block shared by M/N devices,
    rank r/N): the devices' shard LoRAs still add up to the adapter's output, with the ranks the plugin sizes."""
    experts = _experts()
    bd = _bd(experts, n, 8)
    idx, w = _routing()
    x = torch.randn(11, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(bd(x, idx, w), _sharded_reference(bd, x, idx, w, m), rtol=1e-10, atol=1e-12)
    for name in EXPERT_TENSORS:
        a, b = device_factors(name, *bd.factors(name), n, 0, m)
        assert a.shape[1] == b.shape[2] == 8 // min(n, m)


@pytest.mark.parametrize("name", list(EXPERT_TENSORS))
def test_dense_equivalent_and_block_structure(name):
    """The dense factors (zeros written out) compute the same term; every device's factors touch only its shard."""
    experts = _experts()
    bd = _bd(experts, 2, 4)
    layout, slices = EXPERT_TENSORS[name]
    a, b = bd.factors(name)
    da, db = dense_factors(a, b, layout, 2, slices)
    d_in = getattr(experts, name).shape[2]
    x = torch.randn(5, d_in, dtype=torch.float64)
    for e in range(4):
        torch.testing.assert_close(expert_lora(x, a[e], b[e], layout, 2, slices), x @ da[e].t() @ db[e].t())
    full = torch.einsum("eor,eri->eoi", db, da)  # the per-expert delta, (E, d_out, d_in)
    e, d_out, _ = full.shape
    if name == "gate_up_proj":  # rows of shard k (gate_k, up_k) see only rank block k: zero off the blocks
        zero = db.view(e, 2, 2, d_out // 4, 2, 2)  # (E, slice, row block, rows, rank block, ranks)
        assert zero[:, :, 0, :, 1].abs().max() == 0 and zero[:, :, 1, :, 0].abs().max() == 0
    else:  # input block k reaches only rank block k
        zero = da.view(e, 2, 2, 2, d_in // 2)  # (E, rank block, ranks, input block, inputs)
        assert zero[:, 0, :, 1].abs().max() == 0 and zero[:, 1, :, 0].abs().max() == 0


def test_shapes_and_refusals():
    assert factor_shapes("gate_up_proj", (4, 16, 32), 2, 8) == ((4, 8, 32), (4, 16, 4))
    assert factor_shapes("down_proj", (4, 32, 8), 2, 8) == ((4, 8, 4), (4, 32, 8))
    with pytest.raises(BDLoraError, match=r"gate_up_proj \(4, 12, 32\): each of its output slices \(6\)"):
        factor_shapes("gate_up_proj", (4, 12, 32), 4, 8)
    with pytest.raises(BDLoraError, match=r"down_proj .* rank r=6 must divide into nblocks=4"):
        factor_shapes("down_proj", (4, 32, 8), 4, 6)
    with pytest.raises(BDLoraError, match="nblocks=2 cannot be split over 3 devices"):
        device_factors("down_proj", torch.zeros(4, 8, 4), torch.zeros(4, 32, 8), 2, 0, 3)


def test_dense_equivalent_runs_in_peft_expert_lora():
    """The BD experts' dense equivalent, written into PEFT's own expert LoRA (``target_parameters`` on the fused
    tensors, rsLoRA with lora_alpha = block alpha x sqrt(N)), gives the model the BD module's outputs: PEFT (and
    engines serving PEFT expert LoRAs) run a BD expert adapter unchanged."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from bdlora.moe import PEFT_TARGET_PARAMETERS, peft_expert_factors

    n, r, alpha = 2, 4, 8.0
    cfg = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, vocab_size=64)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()  # float32: transformers' grouped expert GEMM takes no float64
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    bds = {}
    for i, layer in enumerate(model.model.layers):
        bds[i] = _bd(layer.mlp.experts, n, r, seed=10 + i)
    peft_model = get_peft_model(__import__("copy").deepcopy(model), LoraConfig(
        r=r, lora_alpha=alpha * math.sqrt(n), use_rslora=True, target_modules=[],
        target_parameters=list(PEFT_TARGET_PARAMETERS)))
    with torch.no_grad():
        for i, layer in enumerate(peft_model.base_model.model.model.layers):
            outer = layer.mlp.experts  # down_proj's wrapper around gate_up_proj's
            for name, wrapper in (("gate_up_proj", outer.base_layer), ("down_proj", outer)):
                assert wrapper.parameter_name == name
                pa, pb = peft_expert_factors(name, *bds[i].factors(name), n)
                wrapper.lora_A["default"].weight.copy_(pa)
                wrapper.lora_B["default"].weight.copy_(pb)
        for i, layer in enumerate(model.model.layers):
            layer.mlp.experts = bds[i]
        ours = model(input_ids=ids).logits
        theirs = peft_model(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    with torch.no_grad(), peft_model.disable_adapter():
        assert (peft_model(input_ids=ids).logits - ours).abs().max() > 1e-4  # the adapter matters


@pytest.mark.parametrize("name", list(EXPERT_TENSORS))
def test_peft_flattening_round_trips_packed_factors(name):
    """Packed factors flattened the way PEFT flattens expert LoRAs (rows e*r + j of A, columns j*E + e of B) and
    back, bit for bit; a count that does not split into the experts is refused."""
    from bdlora.moe import from_peft_layout, to_peft_layout

    bd = _bd(_experts(), 2, 4)
    a, b = bd.factors(name)
    fa, fb = to_peft_layout(a, b)
    assert fa.shape == (a.shape[0] * a.shape[1], a.shape[2]) and fb.shape == (b.shape[1], b.shape[2] * b.shape[0])
    assert torch.equal(fa[3 * a.shape[1] + 1], a[3, 1]) and torch.equal(fb[:, 1 * 4 + 3], b[3, :, 1])
    ra, rb = from_peft_layout(fa, fb, 4)
    assert torch.equal(ra, a) and torch.equal(rb, b)
    with pytest.raises(BDLoraError, match="do not split into 3 experts"):
        from_peft_layout(fa, fb, 3)
