import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bdlora import BDLoraError, BDLoraSpec, matched_lora_rank
from bdlora.spec import PRESETS, preset_for


def test_rslora_scale_accounts_for_blocks():
    spec = BDLoraSpec(nblocks=4, r=16, lora_alpha=8)
    assert spec.block_rank == 4
    # N independent rank r/N rsLoRA adapters: alpha / sqrt(r/N)
    assert spec.scale == pytest.approx(8 / math.sqrt(4))
    # PEFT computes lora_alpha / sqrt(r): the stored alpha must make that equal
    cfg = spec.to_peft_config()
    assert cfg.use_rslora and cfg.r == 16
    assert cfg.lora_alpha / math.sqrt(cfg.r) == pytest.approx(spec.scale)
    assert cfg.use_bdlora.nblocks == 4
    assert set(cfg.use_bdlora.target_modules_bd_a) == {"o_proj", "down_proj"}
    assert set(cfg.use_bdlora.target_modules_bd_b) == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_presets_split_column_and_row(model_type):
    p = preset_for(model_type)
    assert "o_proj" in p["row"] and "down_proj" in p["row"] and "q_proj" in p["column"]
    assert not set(p["row"]) & set(p["column"])


def test_rank_not_divisible_names_fix():
    with pytest.raises(BDLoraError, match=r"r=10 is not divisible by nblocks=4.*r=12 or r=8"):
        BDLoraSpec(nblocks=4, r=10)


def test_bad_nblocks_and_overlap():
    with pytest.raises(BDLoraError, match="nblocks must be a positive integer"):
        BDLoraSpec(nblocks=0, r=8)
    with pytest.raises(BDLoraError, match="both column- and row-parallel"):
        BDLoraSpec(nblocks=2, r=8, column_modules=("q_proj",), row_modules=("q_proj",))


def test_unknown_preset_and_target_names():
    with pytest.raises(BDLoraError, match="no BD-LoRA preset for model_type='gpt2'"):
        BDLoraSpec.from_preset("gpt2", nblocks=2, r=8)
    with pytest.raises(BDLoraError, match=r"unknown target modules \['qproj'\]"):
        BDLoraSpec.from_preset("llama", nblocks=2, r=8, target_modules=["q_proj", "qproj"])
    spec = BDLoraSpec.from_preset("llama", nblocks=2, r=8, target_modules=["q_proj", "o_proj"])
    assert spec.column_modules == ("q_proj",) and spec.row_modules == ("o_proj",)


def _tiny(hidden=64, inter=96, heads=4, kv=2):
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv, num_hidden_layers=1, vocab_size=32)
    return LlamaForCausalLM(cfg)


def test_exact_name_matching_against_model():
    model = _tiny()
    found = BDLoraSpec(nblocks=2, r=4).matching_modules(model)
    assert found["model.layers.0.self_attn.q_proj"] == "column"
    assert found["model.layers.0.mlp.down_proj"] == "row"
    assert len(found) == 7
    # a substring of real names ("proj") would match everything in PEFT; here it is an error
    with pytest.raises(BDLoraError, match=r"\['proj'\] match no nn.Linear"):
        BDLoraSpec(nblocks=2, r=4, column_modules=("q_proj", "proj"), row_modules=()).matching_modules(model)


def test_dimension_not_divisible_by_nblocks():
    model = _tiny(hidden=60, inter=90, heads=3, kv=3)
    with pytest.raises(BDLoraError, match="not divisible by nblocks=4"):
        BDLoraSpec(nblocks=4, r=8).matching_modules(model)


def test_matched_rank_table1():
    # paper Table 1: equal parameters when r' = r (dH + dI) / (dH + dI/N); 8B shape, N=8
    assert matched_lora_rank(16, 4096, 14336, 8) == pytest.approx(16 * 18432 / (4096 + 1792))
    assert matched_lora_rank(16, 4096, 14336, 1) == 16


def test_all_presets_are_known_model_types():
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma"} <= set(PRESETS)
    torch.manual_seed(0)
