"""The PEFT `use_bdlora` folder format: PEFT-written adapters load in bdlora, bdlora-written ones in PEFT."""

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from bdlora import BDLoraError, BDLoraSpec, load_adapter, read_config, save_adapter
from bdlora.adapter import CONFIG_NAME, WEIGHTS_NAME
from bdlora.convert import bd_to_dense, delta_weight
from bdlora.layout import LoraFactors, LoraFactorsError


def test_peft_written_adapter_loads_packed(peft_bd_adapter):
    ad = load_adapter(peft_bd_adapter)
    cfg = ad.config
    assert cfg.is_bd and cfg.nblocks == 2 and cfg.r == 8 and cfg.use_rslora
    assert cfg.scale == pytest.approx(BDLoraSpec(nblocks=2, r=8, lora_alpha=16).scale)
    q = ad.modules["base_model.model.model.layers.0.self_attn.q_proj"]
    k = ad.modules["base_model.model.model.layers.0.self_attn.k_proj"]
    o = ad.modules["base_model.model.model.layers.0.self_attn.o_proj"]
    # column: A (r, d_in), B packed (d_out, r/N); GQA: k is half as wide as q
    assert q.layout == "column" and tuple(q.lora_A.shape) == (8, 256) and tuple(q.lora_B.shape) == (256, 4)
    assert tuple(k.lora_B.shape) == (128, 4)
    # row: A packed (r, d_in/N), B (d_out, r)
    assert o.layout == "row" and tuple(o.lora_A.shape) == (8, 128) and tuple(o.lora_B.shape) == (256, 8)
    assert len(ad.modules) == 2 * 7
    assert all(not (f.lora_A == 0).all() and not (f.lora_B == 0).all() for f in ad.modules.values())


def test_loaded_factors_carry_layout_blocks_and_scale(peft_bd_adapter, tmp_path):
    """One object carries a module's layout, block count, scale and packed factors; the writer refuses factors whose
    layout disagrees with the config, and the factors refuse a block count a dense module cannot have."""
    ad = load_adapter(peft_bd_adapter)
    q = ad.modules["base_model.model.model.layers.0.self_attn.q_proj"]
    o = ad.modules["base_model.model.model.layers.0.self_attn.o_proj"]
    assert (q.layout, q.nblocks, q.scale, q.blocks_a, q.blocks_b) == ("column", 2, ad.config.scale, 1, 2)
    assert (o.layout, o.nblocks, o.rank, o.d_in, o.d_out, o.blocks_a, o.blocks_b) == ("row", 2, 8, 256, 256, 2, 1)
    assert ad.dense_num_parameters() == sum(8 * (f.d_in + f.d_out) for f in ad.modules.values())
    dense = bd_to_dense(ad)
    dq = dense.modules["base_model.model.model.layers.0.self_attn.q_proj"]
    assert (dq.layout, dq.nblocks, dq.scale) == (None, 1, dense.config.scale)
    dense.modules["base_model.model.model.layers.0.self_attn.q_proj"] = LoraFactors(dq.lora_A, dq.lora_B, "column")
    with pytest.raises(BDLoraError, match="column with nblocks=1 but the config makes it dense"):
        save_adapter(dense, tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()
    with pytest.raises(LoraFactorsError, match="layout None"):
        LoraFactors(dq.lora_A, dq.lora_B, None, 2)
    with pytest.raises(LoraFactorsError, match="do not match"):
        LoraFactors(q.lora_A, q.lora_B, "column", 1)  # packed B read as a 1-block factor


def _outputs(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_bdlora_written_adapter_loads_in_peft_identically(tiny_llama_dir, peft_bd_adapter, tmp_path):
    ad = load_adapter(peft_bd_adapter)
    # perturb so the bdlora-written file differs from the PEFT one and we test our writer, not a copy
    for f in ad.modules.values():
        f.lora_B = f.lora_B * 1.5
    out = save_adapter(ad, tmp_path / "ours")
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, out)
    got = _outputs(peft_model, ids)
    # reference: base weights + s * B_dense @ A_dense, merged by hand from the packed factors
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    mods = dict(ref_model.named_modules())
    for path, f in ad.modules.items():
        lin = mods[path.removeprefix("base_model.model.")]
        with torch.no_grad():
            lin.weight += delta_weight(f).float()
    want = _outputs(ref_model, ids)
    assert (got - _outputs(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), ids)).abs().max() > 1e-2
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_roundtrip_is_bit_exact(peft_bd_adapter, tmp_path):
    ad = load_adapter(peft_bd_adapter)
    save_adapter(ad, tmp_path / "copy")
    again = load_adapter(tmp_path / "copy")
    assert again.config.scale == ad.config.scale and again.config.nblocks == ad.config.nblocks
    for p, f in ad.modules.items():
        assert torch.equal(f.lora_A, again.modules[p].lora_A) and torch.equal(f.lora_B, again.modules[p].lora_B)


def test_dense_factor_under_bd_config_is_refused(peft_bd_adapter, tmp_path):
    ad = load_adapter(peft_bd_adapter)
    q = ad.modules["base_model.model.model.layers.0.self_attn.q_proj"]
    q.lora_B = torch.randn(256, 8)  # dense (d_out, r) where packed (d_out, r/N) belongs
    with pytest.raises(BDLoraError, match="dense adapter with a BD config"):
        save_adapter(ad, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_failed_write_leaves_previous_folder_intact(peft_bd_adapter, tmp_path, monkeypatch):
    dest = tmp_path / "dest"
    save_adapter(load_adapter(peft_bd_adapter), dest)
    before = (dest / WEIGHTS_NAME).read_bytes()
    import safetensors.torch as st

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(st, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_adapter(load_adapter(peft_bd_adapter), dest)
    assert (dest / WEIGHTS_NAME).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]


def test_config_errors(tmp_path, peft_bd_adapter):
    with pytest.raises(BDLoraError, match="no adapter_config.json"):
        read_config(tmp_path)
    raw = json.loads((peft_bd_adapter / CONFIG_NAME).read_text())
    raw["r"] = 7
    (tmp_path / CONFIG_NAME).write_text(json.dumps(raw))
    with pytest.raises(BDLoraError, match="r=7 is not divisible by use_bdlora.nblocks=2"):
        read_config(tmp_path)
    raw["r"] = 8
    raw["use_bdlora"]["target_modules_bd_b"] = ["q_proj", "k_proj", "v_proj", "gate_proj"]  # up_proj missing
    (tmp_path / CONFIG_NAME).write_text(json.dumps(raw))
    (tmp_path / WEIGHTS_NAME).write_bytes((peft_bd_adapter / WEIGHTS_NAME).read_bytes())
    with pytest.raises(BDLoraError, match="up_proj.*in neither use_bdlora.target_modules_bd_b"):
        load_adapter(tmp_path)


def test_layer_widths_are_checked_per_stack_of_layers():
    """A VLM's vision tower has its own hidden size: only modules of one stack of layers must agree."""
    from bdlora.adapter import AdapterFileError, check_layer_widths

    lm, vis = "base_model.model.language_model.layers.{}.self_attn.", "base_model.model.vision_tower.layers.{}.attn."
    dims = {lm.format(0) + "q_proj": (256, 256), lm.format(1) + "k_proj": (256, 128), lm.format(1) + "o_proj": (256, 256),
            vis.format(0) + "q_proj": (1152, 1152), vis.format(0) + "o_proj": (1152, 1152)}
    check_layer_widths(dims, "x")
    dims[lm.format(1) + "v_proj"] = (200, 128)
    with pytest.raises(AdapterFileError, match=r"layers.1.self_attn.v_proj input is 200 wide .* is 256"):
        check_layer_widths(dims, "x")
