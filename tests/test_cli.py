"""`bdlora inspect` / `bdlora convert` on real adapter folders."""

import math
import subprocess
import sys

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
        torch.testing.assert_close(delta_weight(final.modules[p], 4, final.config.scale),
                                   delta_weight(f, 2, ad.config.scale))


def test_cli_errors_are_clear(peft_bd_adapter, tmp_path, capsys):
    assert main(["convert", "reblock", str(peft_bd_adapter), str(tmp_path / "x"), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "nblocks=2 to 3 blocks" in err and not (tmp_path / "x").exists()
    # the route that works, not the command that just failed
    assert f"bdlora convert to-dense {peft_bd_adapter} {tmp_path / 'x'}-dense" in err
    assert f"bdlora convert to-bd {tmp_path / 'x'}-dense {tmp_path / 'x'} --nblocks 3" in err
    assert "reblock --tp 3" not in err
    assert main(["convert", "to-bd", str(peft_bd_adapter), str(tmp_path / "y"), "--nblocks", "2"]) == 2
    assert "already has use_bdlora" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err


def test_console_script_installed(peft_bd_adapter):
    res = subprocess.run([sys.executable, "-m", "bdlora.cli", "inspect", str(peft_bd_adapter)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "nblocks:        2" in res.stdout
