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
    assert "--enable-bdlora --tensor-parallel-size 2" in (folder / "README.md").read_text()
