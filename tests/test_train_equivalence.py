"""The trained BD-LoRA adapter is exactly N independent rank-r/N rsLoRA adapters on the N weight shards.

Reference model, PEFT-free: every adapted projection is physically split into N shards, as Megatron tensor
parallelism shards it,
  * column-parallel (q/k/v/gate/up): N Linear(d_in, d_out/N), outputs concatenated;
  * row-parallel (o/down): N Linear(d_in/N, d_out) on the input slices, outputs summed (bias once);
and each shard carries a plain LoRA of rank r/N with scale alpha/sqrt(r/N). The BD adapter's packed blocks are
copied into the shard LoRAs; forward outputs and gradients (w.r.t. inputs and every factor block) must match the
PEFT BD model in float64, for N in {2, 4}, on single layers and on a whole (trained) tiny Llama.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from bdlora import BDLoraSpec
from bdlora.layout import COLUMN, ROW

TOL = dict(rtol=1e-10, atol=1e-12)


class ShardLoRA(nn.Module):
    """A standard LoRA linear (no PEFT): y = x W^T + b + s * (x A^T) B^T with s = alpha / sqrt(rank)."""

    def __init__(self, weight, bias, A, B, alpha: float):
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)
        self.A = nn.Parameter(A.clone())  # (rank, d_in)
        self.B = nn.Parameter(B.clone())  # (d_out, rank)
        self.scale = alpha / math.sqrt(A.shape[0])

    def forward(self, x):
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        return y + self.scale * (x @ self.A.T) @ self.B.T


class ColumnSharded(nn.Module):
    def __init__(self, shards):
        super().__init__()
        self.shards = nn.ModuleList(shards)

    def forward(self, x):
        return torch.cat([s(x) for s in self.shards], dim=-1)


class RowSharded(nn.Module):
    def __init__(self, shards, bias):
        super().__init__()
        self.shards = nn.ModuleList(shards)
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)
        self.width = shards[0].weight.shape[1]

    def forward(self, x):
        parts = x.split(self.width, dim=-1)
        y = sum(s(p) for s, p in zip(self.shards, parts))
        return y if self.bias is None else y + self.bias


def shard_peft_layer(layer, layout: str, nblocks: int, block_alpha: float) -> nn.Module:
    """The physically sharded reference of one PEFT BD-LoRA layer, factors copied block by block."""
    base = layer.get_base_layer()
    W, b = base.weight.detach(), None if base.bias is None else base.bias.detach()
    A = layer.lora_A["default"].weight.detach()
    B = layer.lora_B["default"].weight.detach()
    r = A.shape[0]
    rb = r // nblocks
    shards = []
    if layout == COLUMN:  # A (r, d_in) dense; B packed (d_out, r/N): output block i <- rank block i
        o = W.shape[0] // nblocks
        for i in range(nblocks):
            shards.append(ShardLoRA(W[i * o:(i + 1) * o], None if b is None else b[i * o:(i + 1) * o],
                                    A[i * rb:(i + 1) * rb], B[i * o:(i + 1) * o], block_alpha))
        return ColumnSharded(shards)
    c = W.shape[1] // nblocks  # row: A packed (r, d_in/N): rank block i reads input block i; B (d_out, r)
    for i in range(nblocks):
        shards.append(ShardLoRA(W[:, i * c:(i + 1) * c], None, A[i * rb:(i + 1) * rb], B[:, i * rb:(i + 1) * rb],
                                block_alpha))
    return RowSharded(shards, b)


def packed_grads_from_shards(ref: nn.Module, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard LoRAs' factor gradients re-assembled in PEFT's packed layout."""
    gA = torch.cat([s.A.grad for s in ref.shards], dim=0)
    if layout == COLUMN:
        gB = torch.cat([s.B.grad for s in ref.shards], dim=0)
    else:
        gB = torch.cat([s.B.grad for s in ref.shards], dim=1)
    return gA, gB


class TwoLayer(nn.Module):
    """A Megatron MLP in miniature: a column-parallel up projection, then a row-parallel down projection."""

    def __init__(self, d=48, h=96):
        super().__init__()
        self.up_proj = nn.Linear(d, h, bias=True)
        self.down_proj = nn.Linear(h, d, bias=True)

    def forward(self, x):
        return self.down_proj(torch.tanh(self.up_proj(x)))


def _randomize_lora(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)


@pytest.mark.parametrize("backend", ["peft", "cublas"])
@pytest.mark.parametrize("nblocks", [2, 4])
def test_layers_equal_independent_shard_loras(nblocks, backend):
    """PEFT's BD layer and bdlora's kernel variant of it (what ``bdlora train`` runs on a GPU)."""
    from peft import get_peft_model

    from bdlora.peft_model import use_bdlora_kernels

    torch.manual_seed(0)
    spec = BDLoraSpec(nblocks=nblocks, r=4 * nblocks, lora_alpha=16.0, column_modules=("up_proj",),
                      row_modules=("down_proj",))
    model = get_peft_model(TwoLayer().double(), spec.to_peft_config())
    _randomize_lora(model, seed=nblocks)
    assert use_bdlora_kernels(model, backend) == (2 if backend == "cublas" else 0)
    up = model.base_model.model.up_proj
    down = model.base_model.model.down_proj
    ref_up = shard_peft_layer(up, COLUMN, nblocks, spec.lora_alpha)
    ref_down = shard_peft_layer(down, ROW, nblocks, spec.lora_alpha)

    # PEFT's scale is exactly the shard LoRA scale alpha / sqrt(r/N).
    assert up.scaling["default"] == pytest.approx(ref_up.shards[0].scale, rel=1e-15)
    assert down.scaling["default"] == pytest.approx(ref_down.shards[0].scale, rel=1e-15)

    x = torch.randn(5, 7, 48, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_bd = model(x1)
    y_ref = ref_down(torch.tanh(ref_up(x2)))
    torch.testing.assert_close(y_bd, y_ref, **TOL)
    # Each layer on its own too (column and row separately).
    torch.testing.assert_close(up(x), ref_up(x), **TOL)
    h = torch.randn(5, 7, 96, dtype=torch.float64)
    torch.testing.assert_close(down(h), ref_down(h), **TOL)

    w = torch.randn_like(y_bd)
    (y_bd * w).sum().backward()
    (y_ref * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, **TOL)
    for layer, ref, layout in ((up, ref_up, COLUMN), (down, ref_down, ROW)):
        gA, gB = packed_grads_from_shards(ref, layout)
        torch.testing.assert_close(layer.lora_A["default"].weight.grad, gA, **TOL)
        torch.testing.assert_close(layer.lora_B["default"].weight.grad, gB, **TOL)
        # No gradient leaks across blocks: every shard gradient is non-trivial and comes only from its shard.
        assert all(s.A.grad.abs().sum() > 0 and s.B.grad.abs().sum() > 0 for s in ref.shards)

    # One optimizer step on both keeps them identical (same factors after AdamW).
    opt_bd = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt_ref = torch.optim.AdamW([p for m in (ref_up, ref_down) for p in m.parameters() if p.requires_grad], lr=1e-2)
    opt_bd.step()
    opt_ref.step()
    for layer, ref, layout in ((up, ref_up, COLUMN), (down, ref_down, ROW)):
        A = torch.cat([s.A for s in ref.shards], 0)
        B = torch.cat([s.B for s in ref.shards], 0 if layout == COLUMN else 1)
        torch.testing.assert_close(layer.lora_A["default"].weight.detach(), A.detach(), **TOL)
        torch.testing.assert_close(layer.lora_B["default"].weight.detach(), B.detach(), **TOL)


def _sharded_reference_model(peft_model, spec):
    """A deep copy of the base model with every adapted projection replaced by its sharded shard-LoRA version."""
    base = copy.deepcopy(peft_model.get_base_model())
    refs = {}
    for name, layer in peft_model.get_base_model().named_modules():
        if not hasattr(layer, "lora_A") or not isinstance(layer.lora_A, nn.ModuleDict):
            continue
        layout = spec.layout_of(name)
        ref = shard_peft_layer(layer, layout, spec.nblocks, spec.lora_alpha)
        parent_name, leaf = name.rsplit(".", 1)
        setattr(base.get_submodule(parent_name), leaf, ref)
        refs[name] = (layer, ref, layout)
    return base, refs


@pytest.fixture(scope="module")
def trained(tiny_llama_dir, tmp_path_factory):
    """BD-LoRA adapters trained by the trainer for a few steps (N=2 and N=4) on the tiny Llama."""
    from bdlora.train.config import TrainConfig
    from bdlora.train.tasks import toy_chat_records, write_jsonl
    from bdlora.train.trainer import run_training

    tmp = tmp_path_factory.mktemp("equiv")
    data = write_jsonl(toy_chat_records(16), tmp / "d.jsonl")
    out = {}
    for n in (2, 4):
        cfg = TrainConfig(model=str(tiny_llama_dir), nblocks=n, r=8, lora_alpha=16, train_file=str(data),
                          eval_fraction=0.0, lr=5e-3, warmup_ratio=0.0, batch_size=4, max_steps=3,
                          output_dir=str(tmp / f"n{n}"), report_to=[], progress=False)
        out[n] = run_training(cfg)
    return out


@pytest.mark.parametrize("nblocks", [2, 4])
def test_trained_llama_equals_sharded_model(trained, nblocks):
    res = trained[nblocks]
    model, spec = res.model, res.spec
    model = copy.deepcopy(model).double().eval()
    # Training moved every factor away from its init (B starts at zero): the adapter is really trained.
    for n, p in model.named_parameters():
        if "lora_B" in n:
            assert p.abs().max() > 0, n
    ref_model, refs = _sharded_reference_model(model, spec)
    assert {lay for _, _, lay in refs.values()} == {COLUMN, ROW} and len(refs) == 14
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(0))
    out_bd = model(input_ids=ids).logits
    out_ref = ref_model(input_ids=ids).logits
    torch.testing.assert_close(out_bd, out_ref, rtol=1e-9, atol=1e-10)
    w = torch.randn(out_bd.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (out_bd * w).sum().backward()
    (out_ref * w).sum().backward()
    for name, (layer, ref, layout) in refs.items():
        gA, gB = packed_grads_from_shards(ref, layout)
        torch.testing.assert_close(layer.lora_A["default"].weight.grad, gA, rtol=1e-8, atol=1e-10, msg=name)
        torch.testing.assert_close(layer.lora_B["default"].weight.grad, gB, rtol=1e-8, atol=1e-10, msg=name)
