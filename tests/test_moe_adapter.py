"""The BD expert adapter folder: BD-LoRA on MoE expert tensors saved with PEFT's expert-LoRA key names and
flattening (packed blocks, ``use_bdlora`` naming the expert tensors), read back exactly, reported by ``inspect``,
converted by ``bdlora convert to-dense`` into a PEFT expert LoRA that PEFT loads and that gives the BD model's
outputs; a PEFT-written expert LoRA round-trips through bdlora's reader and writer."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from bdlora.adapter import AdapterFileError, load_adapter, save_adapter
from bdlora.cli import main as cli_main
from bdlora.convert import ConversionError, reblock
from bdlora.adapter import expert_adapter
from bdlora.moe import BDLoraExperts, EXPERT_TENSORS

N, R, ALPHA = 2, 4, 8.0
PREFIX = "base_model.model.model.layers.{}.mlp.experts"


def _moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, vocab_size=64)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).eval()


def _trained_bd(model) -> dict[str, BDLoraExperts]:
    out = {}
    for i, layer in enumerate(model.model.layers):
        bd = BDLoraExperts(layer.mlp.experts, nblocks=N, r=R, lora_alpha=ALPHA)
        g = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for p in bd.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        out[PREFIX.format(i)] = bd
    return out


@pytest.fixture
def bd_folder(tmp_path):
    model = _moe()
    bds = _trained_bd(model)
    folder = save_adapter(expert_adapter(bds, "tiny-qwen3-moe"), tmp_path / "bd")
    return model, bds, folder


def test_bd_expert_folder_is_packed_and_reads_back_exactly(bd_folder):
    model, bds, folder = bd_folder
    raw = json.loads((folder / "adapter_config.json").read_text())
    assert raw["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert raw["use_bdlora"]["nblocks"] == N and raw["use_bdlora"]["target_modules_bd_b"] == ["gate_up_proj"]
    assert raw["lora_alpha"] == pytest.approx(ALPHA * math.sqrt(N)) and raw["use_rslora"] is True
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    e, h, i = 4, 32, 16
    # PEFT's names (gate_up wrapped innermost) and flattening (R x E rows of A, B's columns by rank then expert)
    assert shapes[PREFIX.format(0) + ".base_layer.lora_A.weight"] == (R * e, h)
    assert shapes[PREFIX.format(0) + ".base_layer.lora_B.weight"] == (2 * i, R // N * e)  # packed: r/N per block
    assert shapes[PREFIX.format(0) + ".lora_A.weight"] == (R * e, i // N)  # packed
    assert shapes[PREFIX.format(0) + ".lora_B.weight"] == (h, R * e)
    ad = load_adapter(folder)
    assert ad.config.nblocks == N and not ad.modules and len(ad.experts) == 4
    for path, bd in bds.items():
        for name in EXPERT_TENSORS:
            f = ad.experts[f"{path}.{name}"]
            a, b = bd.factors(name)
            assert torch.equal(f.lora_A, a) and torch.equal(f.lora_B, b) and f.scale == pytest.approx(bd.scale)
    assert ad.num_parameters() == sum(p.numel() for bd in bds.values() for p in bd.parameters() if p.requires_grad)
    assert ad.num_parameters() < ad.dense_num_parameters()


def test_to_dense_is_a_peft_expert_lora_with_the_bd_outputs(bd_folder, tmp_path, capsys):
    from peft import PeftModel

    model, bds, folder = bd_folder
    assert cli_main(["inspect", str(folder)]) == 0
    text = capsys.readouterr().out
    assert "MoE experts:    LoRA on down_proj, gate_up_proj of 2 layer(s) x [4] experts" in text
    assert "1/N of every expert's adapter" in text
    dense = tmp_path / "dense"
    assert cli_main(["convert", "to-dense", str(folder), str(dense)]) == 0
    raw = json.loads((dense / "adapter_config.json").read_text())
    assert raw["use_bdlora"] is None and raw["target_parameters"] == ["mlp.experts.gate_up_proj",
                                                                      "mlp.experts.down_proj"]
    # plain LoRA scaling with the same scale: vLLM 0.26's per-expert packing ignores use_rslora
    assert raw["use_rslora"] is False and raw["lora_alpha"] / raw["r"] == pytest.approx(ALPHA * math.sqrt(N / R))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(copy.deepcopy(model), str(dense)).eval()(input_ids=ids).logits
        base_logits = model(input_ids=ids).logits
        for i, layer in enumerate(model.model.layers):
            layer.mlp.experts = bds[PREFIX.format(i)]
        bd_logits = model(input_ids=ids).logits
    torch.testing.assert_close(peft_logits, bd_logits, rtol=1e-4, atol=1e-5)
    assert (bd_logits - base_logits).abs().max() > 1e-3  # the adapter matters
    ad = load_adapter(dense)
    assert ad.config.nblocks is None and all(f.nblocks == 1 for f in ad.experts.values())


def test_peft_written_expert_lora_round_trips(tmp_path):
    """A PEFT expert LoRA on both tensors plus attention projections: bdlora reads and rewrites it, and PEFT loads
    the rewritten folder to the same outputs."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model = _moe()
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=R, lora_alpha=ALPHA, use_rslora=True, target_modules=["q_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    src, dst = tmp_path / "peft", tmp_path / "rewritten"
    peft_model.save_pretrained(str(src))
    ad = load_adapter(src)
    assert len(ad.modules) == 4 and len(ad.experts) == 4 and ad.config.nblocks is None
    # PEFT saves target_parameters from a set (its order varies by process); the nesting follows the model's order
    raw = json.loads((src / "adapter_config.json").read_text())
    raw["target_parameters"] = raw["target_parameters"][::-1]
    (src / "adapter_config.json").write_text(json.dumps(raw))
    again = load_adapter(src)
    assert all(torch.equal(again.experts[k].lora_B, f.lora_B) for k, f in ad.experts.items())
    save_adapter(ad, dst)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = peft_model.eval()(input_ids=ids).logits
        got = PeftModel.from_pretrained(copy.deepcopy(model), str(dst)).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_damaged_or_unsupported_expert_adapters_are_refused(bd_folder, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    model, bds, folder = bd_folder
    with pytest.raises(ConversionError, match="not available for LoRA on MoE expert tensors"):
        reblock(load_adapter(folder), 4)
    bad = tmp_path / "bad"
    __import__("shutil").copytree(folder, bad)
    t = load_file(str(bad / "adapter_model.safetensors"))
    key = PREFIX.format(1) + ".base_layer.lora_B.weight"
    t[key] = t[key][:, :-1].contiguous()  # one column short
    save_file(t, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterFileError, match=r"layers.1.mlp.experts.gate_up_proj: lora_B \(32, 7\) should have 2 x 4"):
        load_adapter(bad)
    t = load_file(str(folder / "adapter_model.safetensors"))
    t[PREFIX.format(0) + ".lora_A.weight"][0, 0] = float("nan")
    save_file(t, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterFileError, match=r"layers.0.mlp.experts.down_proj.lora_A' has 1 NaN/Inf"):
        load_adapter(bad)
    assert cli_main(["convert", "reblock", str(folder), str(tmp_path / "rb"), "--tp", "4"]) != 0
    assert "not available for LoRA on MoE expert tensors" in capsys.readouterr().err
