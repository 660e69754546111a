"""Conversions keep the served function (or report exactly how much they lose)."""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from bdlora import BDLoraError, load_adapter, save_adapter
from bdlora.adapter import Adapter, AdapterConfig
from bdlora.convert import bd_to_dense, delta_weight, dense_to_bd, reblock
from bdlora.layout import LoraFactors
from bdlora.sharding import check_tp_compatible, shard_factors


def _deltas(ad):
    return {p: delta_weight(f) for p, f in ad.modules.items()}


def _logits(model_dir, adapter_dir, ids):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return PeftModel.from_pretrained(base, adapter_dir)(ids).logits


IDS = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(3))


def test_bd_to_dense_same_outputs_in_peft(tiny_llama_dir, peft_bd_adapter, tmp_path):
    ad = load_adapter(peft_bd_adapter)
    dense = bd_to_dense(ad)
    assert not dense.config.is_bd and dense.config.r == ad.config.r
    assert dense.config.scale == pytest.approx(ad.config.scale)
    save_adapter(dense, tmp_path / "dense")
    torch.testing.assert_close(_logits(tiny_llama_dir, tmp_path / "dense", IDS),
                               _logits(tiny_llama_dir, peft_bd_adapter, IDS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 4])
def test_reblock_keeps_outputs(tiny_llama_dir, peft_bd_adapter, tmp_path, tp):
    ad = load_adapter(peft_bd_adapter)  # N = 2
    new = reblock(ad, tp)
    assert new.config.nblocks == tp and new.config.r == 8 * max(1, tp // 2)
    for p, d in _deltas(ad).items():
        torch.testing.assert_close(delta_weight(new.modules[p]), d)
    save_adapter(new, tmp_path / f"tp{tp}")
    torch.testing.assert_close(_logits(tiny_llama_dir, tmp_path / f"tp{tp}", IDS),
                               _logits(tiny_llama_dir, peft_bd_adapter, IDS), rtol=1e-5, atol=1e-5)


def _random_factors(layout, n, r, d_in, d_out, gen):
    if layout == "column":
        return torch.randn(r, d_in, generator=gen), torch.randn(d_out, r // n, generator=gen)
    return torch.randn(r, d_in // n, generator=gen), torch.randn(d_out, r, generator=gen)


@pytest.mark.parametrize("layout", ["column", "row"])
@pytest.mark.parametrize("n,m", [(1, 1), (2, 2), (4, 2), (4, 1), (2, 4), (1, 4), (2, 8), (8, 2)])
def test_tp_shards_compute_the_adapter_without_communication(layout, n, m):
    """Column: each rank's output slice is exact from its own factors. Row: per-rank partial sums add up
    to the full result, i.e. the base all-reduce is the only collective needed."""
    gen = torch.Generator().manual_seed(n * 10 + m)
    r, d_in, d_out = 8 * max(n, m), 48, 40
    a, b = _random_factors(layout, n, r, d_in, d_out, gen)
    full = delta_weight(LoraFactors(a, b, layout, n))  # (d_out, d_in)
    x = torch.randn(5, d_in, generator=gen, dtype=torch.float64)
    want = x @ full.T
    partial = torch.zeros(5, d_out, dtype=torch.float64)
    for t in range(m):
        a_t, b_t = shard_factors(a, b, layout, n, m, t)
        if layout == "column":
            assert a_t.shape[1] == d_in and b_t.shape[0] == d_out // m
            out_t = (x @ a_t.double().T) @ b_t.double().T
            torch.testing.assert_close(out_t, want[:, t * d_out // m:(t + 1) * d_out // m])
        else:
            assert a_t.shape[1] == d_in // m and b_t.shape[0] == d_out
            x_t = x[:, t * d_in // m:(t + 1) * d_in // m]
            partial += (x_t @ a_t.double().T) @ b_t.double().T
        # per-rank rank = r/N when M >= N: exactly the bytes of one block, no zeros
        if m >= n:
            assert a_t.shape[0] == r // n
    if layout == "row":
        torch.testing.assert_close(partial, want)


def test_shards_read_from_safetensors_slices(peft_bd_adapter):
    from safetensors import safe_open

    ad = load_adapter(peft_bd_adapter)
    p = "base_model.model.model.layers.1.mlp.down_proj"
    with safe_open(str(peft_bd_adapter / "adapter_model.safetensors"), "pt") as f:
        a_sl, b_sl = f.get_slice(p + ".lora_A.weight"), f.get_slice(p + ".lora_B.weight")
        for t in range(2):
            got = shard_factors(a_sl, b_sl, "row", 2, 2, t)
            want = shard_factors(ad.modules[p].lora_A, ad.modules[p].lora_B, "row", 2, 2, t)
            assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_incompatible_tp_is_refused():
    with pytest.raises(BDLoraError, match=r"nblocks=4 but tensor-parallel size is 3.*\[1, 2, 4\]"):
        check_tp_compatible(4, 3)


def _dense_adapter(r=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (64, 64), "k_proj": (32, 64), "o_proj": (64, 64), "down_proj": (64, 96)}
    cfg = AdapterConfig(r=r, peft_lora_alpha=8.0, use_rslora=True, target_modules=list(shapes))
    mods = {f"base_model.model.model.layers.0.x.{n}": LoraFactors(torch.randn(r, din, generator=gen),
                                                                   torch.randn(dout, r, generator=gen), scale=cfg.scale)
            for n, (dout, din) in shapes.items()}
    return Adapter(cfg, mods)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_dense_to_bd_exact(n):
    dense = _dense_adapter()
    bd, report = dense_to_bd(dense, n)
    assert bd.config.nblocks == n and bd.config.r == 4 * n and report.total == 0.0
    for p, d in _deltas(dense).items():
        torch.testing.assert_close(delta_weight(bd.modules[p]), d)


def test_dense_to_bd_truncated_reports_true_error():
    dense = _dense_adapter(r=8)
    errs = []
    for rank in (4, 8, 16, 32):
        bd, report = dense_to_bd(dense, 4, rank=rank)
        want, got = _deltas(dense), _deltas(bd)
        num = sum(float(((got[p] - want[p]) ** 2).sum()) for p in want)
        den = sum(float((want[p] ** 2).sum()) for p in want)
        assert report.total == pytest.approx((num / den) ** 0.5, rel=1e-5, abs=1e-6)  # factors are stored in fp32
        errs.append(report.total)
    assert errs[0] > errs[1] > errs[2] > 0.0  # each block's delta has rank <= 8: rank 32 = 8 per block is exact
    assert errs[3] == 0.0


def test_dense_to_bd_refusals():
    dense = _dense_adapter()
    with pytest.raises(BDLoraError, match="target rank 6 is not divisible by nblocks=4"):
        dense_to_bd(dense, 4, rank=6)
    with pytest.raises(BDLoraError, match="in neither"):
        dense_to_bd(dense, 2, column_modules=["q_proj"], row_modules=["o_proj", "down_proj"])
    bd, _ = dense_to_bd(dense, 2)
    with pytest.raises(BDLoraError, match="already has use_bdlora"):
        dense_to_bd(bd, 2)
    with pytest.raises(BDLoraError, match="needs a BD-LoRA adapter"):
        reblock(dense, 2)


def test_reblock_checks_layer_splits_before_anything_else(peft_bd_adapter):
    from bdlora.convert import ConversionError

    ad = load_adapter(peft_bd_adapter)  # k_proj/v_proj have 128 outputs, q/o 256, gate/up/down 512
    with pytest.raises(ConversionError, match=r"k_proj: column-parallel layer with d_out \(outputs\)=128 cannot be "
                                              r"split into 256 blocks"):
        reblock(ad, 256)
    # a TP that splits every layer but not the blocks: the route through a dense adapter, with both commands
    gen = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (48, 48), "k_proj": (24, 48), "o_proj": (48, 48), "down_proj": (48, 96)}
    dense = Adapter(AdapterConfig(r=4, peft_lora_alpha=8.0, use_rslora=True, target_modules=list(shapes)),
                    {f"m.layers.0.x.{n}": LoraFactors(torch.randn(4, din, generator=gen), torch.randn(dout, 4, generator=gen))
                     for n, (dout, din) in shapes.items()})
    bd2, _ = dense_to_bd(dense, 2)
    with pytest.raises(ConversionError, match=r"(?s)nblocks=2 to 3 blocks.*"
                       r"bdlora convert to-dense in out-dense\n  bdlora convert to-bd out-dense out --nblocks 3") as e:
        reblock(bd2, 3, "in", "out")
    assert "reblock --tp" not in str(e.value)
    bd3, _ = dense_to_bd(bd_to_dense(bd2), 3)  # ... and that route works, exactly
    for p, f in bd2.modules.items():
        torch.testing.assert_close(delta_weight(bd3.modules[p]), delta_weight(f))
    with pytest.raises(ConversionError, match="must be a positive integer"):
        reblock(ad, 0)
