"""examples/trl_sft.py: TRL's SFTTrainer with BDLoraSpec trains a genuine BD-LoRA adapter bdlora reads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("trl")


def test_trl_sft_example_trains_a_bd_adapter(tiny_llama_dir, tmp_path):
    from bdlora.adapter import load_adapter
    from bdlora.cli import inspect_text
    from bdlora.train.tasks import write_jsonl

    spec = importlib.util.spec_from_file_location("trl_sft", Path(__file__).parents[1] / "examples" / "trl_sft.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    data = write_jsonl([{"prompt": f"Say {i}:", "completion": f" number {i}"} for i in range(16)], tmp_path / "d.jsonl")
    folder = example.train(str(tiny_llama_dir), str(data), str(tmp_path / "out"), nblocks=2, r=8, max_steps=3,
                           lr=1e-2)
    ad = load_adapter(folder)
    assert ad.config.is_bd and ad.config.nblocks == 2 and ad.config.r == 8
    # packed factors: column modules' B is (d_out, r/N), row modules' A is (r, d_in/N)
    q = next(f for name, f in ad.modules.items() if name.endswith("q_proj"))
    o = next(f for name, f in ad.modules.items() if name.endswith("o_proj"))
    assert tuple(q.lora_B.shape) == (256, 4) and tuple(o.lora_A.shape) == (8, 128)
    assert any(float(f.lora_B.abs().max()) > 0 for f in ad.modules.values())  # trained: B left its zero init
    assert "BD-LoRA" in inspect_text(str(folder))
    import json

    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_llama_dir)
    source = (Path(__file__).parents[1] / "examples" / "trl_sft.py").read_text()
    assert "bdlora.train" not in source and "use_cpu" not in source  # public API only; any device


def test_prepare_bd_model_refuses_what_peft_built_otherwise(tiny_llama_dir):
    """prepare_bd_model names a module the spec did not ask for (PEFT's substring match) and re-initializes A."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from bdlora import BDLoraError, BDLoraSpec, prepare_bd_model

    spec = BDLoraSpec(nblocks=2, r=8, lora_alpha=16)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)), spec.to_peft_config())
    a = model.base_model.model.model.layers[0].self_attn.o_proj.lora_A["default"].weight
    before = a.detach().clone()
    torch.manual_seed(0)
    assert prepare_bd_model(model, spec) is model and not torch.equal(before, a)
    narrow = BDLoraSpec(nblocks=2, r=8, lora_alpha=16, column_modules=("q_proj",), row_modules=("o_proj",))
    with pytest.raises(BDLoraError, match="unexpected"):
        prepare_bd_model(model, narrow)
