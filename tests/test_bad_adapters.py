"""Nothing lost, nothing silent: bad adapters, unsupported PEFT features and dangerous output paths are
refused through the CLI with a message naming the problem and the file; nothing is half-written or deleted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from bdlora import BDLoraError, load_adapter
from bdlora.adapter import (CONFIG_NAME, WEIGHTS_NAME, AdapterFileError, OutputPathError, UnsupportedAdapterError,
                            atomic_output_dir, clean_stale_work_dirs)
from bdlora.cli import main

Q = "base_model.model.model.layers.0.self_attn.q_proj"
K = "base_model.model.model.layers.0.self_attn.k_proj"
O = "base_model.model.model.layers.0.self_attn.o_proj"


def _copy(src, dst, config=None, tensors=None):
    """A copy of adapter ``src`` at ``dst``; ``config(raw)`` / ``tensors(dict)`` edit the copy in place."""
    shutil.copytree(src, dst)
    if config is not None:
        raw = json.loads((dst / CONFIG_NAME).read_text())
        config(raw)
        (dst / CONFIG_NAME).write_text(json.dumps(raw))
    if tensors is not None:
        t = load_file(str(dst / WEIGHTS_NAME))
        tensors(t)
        save_file(t, str(dst / WEIGHTS_NAME))
    return dst


def _peft_adapter(model_dir, out, **lora_kwargs):
    """A dense adapter written by PEFT itself, with random non-zero factors (lora_B biases included)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], **lora_kwargs))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(str(out))
    return out


def _fails(argv, capsys, *needles):
    """Runs the CLI, expects exit 2 and a one-line `bdlora: error:` message containing every needle."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bdlora: error: ") and "Traceback" not in err, err
    for n in needles:
        assert str(n) in err, (n, err)
    return err


def _listing(folder):
    return sorted(p.name for p in folder.iterdir())


# --- 1. outputs: never replaced without --force; --force replaces only an adapter folder that is not an input --------

def test_existing_output_folder_is_refused_and_kept(peft_bd_adapter, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    for argv in (["to-dense", peft_bd_adapter, out], ["reblock", peft_bd_adapter, out, "--tp", "4"]):
        _fails(["convert", *argv], capsys, out, "already exists", "--force")
        assert (out / "precious.txt").read_text() == "keep me"
    # --force does not help: it is not an adapter folder
    _fails(["convert", "to-dense", peft_bd_adapter, out, "--force"], capsys, "not an adapter folder")
    assert _listing(out) == ["precious.txt"] and _listing(tmp_path) == ["out"]


def test_parent_of_input_is_never_replaced(peft_bd_adapter, tmp_path, capsys):
    parent = tmp_path / "adapters"
    inp = _copy(peft_bd_adapter, parent / "mine")
    (parent / "neighbour.txt").write_text("x")
    before = _listing(inp)
    _fails(["convert", "to-dense", inp, parent], capsys, "already exists")
    _fails(["convert", "to-dense", inp, parent, "--force"], capsys, "contains the input adapter")
    _fails(["convert", "to-dense", inp, inp, "--force"], capsys, "is the input adapter")
    assert _listing(inp) == before and (parent / "neighbour.txt").exists()
    assert _listing(parent) == ["mine", "neighbour.txt"]


def test_regular_file_output_is_refused_even_with_force(peft_bd_adapter, tmp_path, capsys):
    out = tmp_path / "out.bin"
    out.write_text("data")
    _fails(["convert", "to-dense", peft_bd_adapter, out], capsys, "already exists")
    _fails(["convert", "to-dense", peft_bd_adapter, out, "--force"], capsys, "is a file")
    assert out.read_text() == "data" and _listing(tmp_path) == ["out.bin"]  # no .old-PID file either


def test_current_directory_is_refused_and_nothing_left(peft_bd_adapter, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    inp = _copy(peft_bd_adapter, work / "in")
    monkeypatch.chdir(work)
    for out in (".", "./", str(work), ".."):
        _fails(["convert", "to-dense", inp, out], capsys, "already exists")
        _fails(["convert", "to-dense", inp, out, "--force"], capsys, "current directory")
    assert _listing(work) == ["in"] and _listing(tmp_path) == ["work"]
    # the writer itself refuses the cwd too, whatever its caller checked
    with pytest.raises(OutputPathError, match="current directory"):
        with atomic_output_dir("."):
            pass
    assert _listing(work) == ["in"]


def test_force_replaces_an_adapter_folder(peft_bd_adapter, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", "to-dense", str(peft_bd_adapter), str(out)]) == 0
    assert not load_adapter(out).config.is_bd
    _fails(["convert", "reblock", peft_bd_adapter, out, "--tp", "4"], capsys, "already exists")
    assert main(["convert", "reblock", str(peft_bd_adapter), str(out), "--tp", "4", "--force"]) == 0
    assert load_adapter(out).config.nblocks == 4
    assert _listing(tmp_path) == ["out"]
    # an adapter folder with subfolders is more than an adapter: not replaced
    (out / "checkpoint-1").mkdir()
    _fails(["convert", "to-dense", peft_bd_adapter, out, "--force"], capsys, "subfolders", "checkpoint-1")


def test_force_replaces_a_symlinked_adapter_folder_not_its_target(peft_bd_adapter, tmp_path):
    target = tmp_path / "real"
    assert main(["convert", "to-dense", str(peft_bd_adapter), str(target)]) == 0
    link = tmp_path / "link"
    link.symlink_to(target)
    assert main(["convert", "reblock", str(peft_bd_adapter), str(link), "--tp", "4", "--force"]) == 0
    assert not link.is_symlink() and load_adapter(link).config.nblocks == 4
    assert not load_adapter(target).config.is_bd  # the folder it pointed to is untouched
    assert _listing(tmp_path) == ["link", "real"]


def test_writer_keeps_overwrite_for_its_own_outputs_and_cleans_up(tmp_path):
    """The trainer and the model cache replace their own folders (default overwrite=True); an exception or an
    interrupt inside the block leaves neither a temporary folder nor a changed destination."""
    dest = tmp_path / "run"
    for i in range(2):
        with atomic_output_dir(dest) as tmp:
            (tmp / "f").write_text(str(i))
    assert (dest / "f").read_text() == "1"
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with atomic_output_dir(dest) as tmp:
                (tmp / "f").write_text("partial")
                raise exc
    assert (dest / "f").read_text() == "1" and _listing(tmp_path) == ["run"]
    with pytest.raises(OutputPathError, match="already exists"):
        with atomic_output_dir(dest, overwrite=False):
            pass
    assert _listing(tmp_path) == ["run"]


def test_stale_work_folders_of_dead_writers_are_removed_and_nothing_else(tmp_path):
    from bdlora.adapter import _host_tag

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = _host_tag()
    stale = [tmp_path / f".out.bdlora-tmp-{host}-{dead.pid}-0a1b2c3d", tmp_path / f".out.bdlora-old-{host}-{dead.pid}-ff"]
    keep = [tmp_path / f".out.bdlora-tmp-{host}-{os.getppid()}-0a1b2c3d",  # a live writer
            tmp_path / f".out.bdlora-tmp-00000000-{dead.pid}-0a1b2c3d",  # another host's writer
            tmp_path / f".other.bdlora-tmp-{host}-{dead.pid}-0a1b2c3d",  # another destination's
            tmp_path / ".out.tmp-abcd1234", tmp_path / "notes"]  # not ours
    for d in stale + keep:
        d.mkdir()
        (d / "x").write_text("x")
    with atomic_output_dir(tmp_path / "out") as tmp:
        (tmp / "f").write_text("new")
    assert not any(d.exists() for d in stale)
    assert all((d / "x").exists() for d in keep)
    assert clean_stale_work_dirs(tmp_path / "out") == []


# --- 2. block counts must divide every dimension they split; zero-sized factors are refused ------------------------

def test_reblock_to_a_tp_the_layers_cannot_split_is_refused(peft_bd_adapter, tmp_path, capsys):
    out = tmp_path / "tp256"
    _fails(["convert", "reblock", peft_bd_adapter, out, "--tp", "256"], capsys,
           "k_proj", "d_out (outputs)=128", "cannot be split into 256 blocks")
    assert not out.exists() and _listing(tmp_path) == []
    dense = tmp_path / "dense"
    assert main(["convert", "to-dense", str(peft_bd_adapter), str(dense)]) == 0
    _fails(["convert", "to-bd", dense, out, "--nblocks", "256"], capsys, "cannot be split into 256 blocks")
    assert not out.exists()


def test_zero_sized_factor_is_refused(peft_bd_adapter, tmp_path, capsys):
    bad = _copy(peft_bd_adapter, tmp_path / "bad", tensors=lambda t: t.update({K + ".lora_B.weight": torch.zeros(0, 4)}))
    _fails(["inspect", bad], capsys, "k_proj", "(0, 4)", "non-empty")


# --- 3. the strict reader ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_inf_factors_are_refused(peft_bd_adapter, tmp_path, capsys, value):
    def poison(t):
        t[Q + ".lora_A.weight"][0, 3] = value

    bad = _copy(peft_bd_adapter, tmp_path / "bad", tensors=poison)
    _fails(["inspect", bad], capsys, WEIGHTS_NAME, Q + ".lora_A.weight", "NaN/Inf")
    # SVD truncation of a NaN adapter never runs: the reader refuses first
    dense = tmp_path / "dense"
    bd_to_dense_src = _copy(peft_bd_adapter, tmp_path / "ok")
    assert main(["convert", "to-dense", str(bd_to_dense_src), str(dense)]) == 0
    t = load_file(str(dense / WEIGHTS_NAME))
    t[Q + ".lora_B.weight"][1, 1] = value
    save_file(t, str(dense / WEIGHTS_NAME))
    _fails(["convert", "to-bd", dense, tmp_path / "svd", "--nblocks", "2", "--rank", "4"], capsys, "NaN/Inf")
    assert not (tmp_path / "svd").exists()


def test_integer_factors_are_refused(peft_bd_adapter, tmp_path, capsys):
    def quantize(t):
        t[O + ".lora_B.weight"] = (t[O + ".lora_B.weight"] * 100).to(torch.int8)

    bad = _copy(peft_bd_adapter, tmp_path / "bad", tensors=quantize)
    _fails(["inspect", bad], capsys, O + ".lora_B.weight", "torch.int8", "floating point")


def test_input_widths_that_disagree_are_refused(peft_bd_adapter, tmp_path, capsys):
    # q_proj reads the hidden states (256 wide) like k/v/gate/up: a 200-wide lora_A is from another model
    bad = _copy(peft_bd_adapter, tmp_path / "q", tensors=lambda t: t.update({Q + ".lora_A.weight": torch.randn(8, 200)}))
    _fails(["inspect", bad], capsys, Q + " input is 200 wide", "hidden size")
    # o_proj's packed lora_A (r, d_in/N) must give d_in = q_proj's output width: 2 x 100 != 256
    bad = _copy(peft_bd_adapter, tmp_path / "o", tensors=lambda t: t.update({O + ".lora_A.weight": torch.randn(8, 100)}))
    _fails(["inspect", bad], capsys, Q, "256 outputs", O, "reads 200 inputs")


def test_extra_tensor_is_refused_by_name(peft_bd_adapter, tmp_path, capsys):
    bad = _copy(peft_bd_adapter, tmp_path / "bad",
                tensors=lambda t: t.update({"base_model.model.lm_head.weight": torch.randn(512, 256)}))
    _fails(["convert", "to-dense", bad, tmp_path / "out"], capsys, "base_model.model.lm_head.weight",
           "not a lora_A/lora_B factor")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("feature,kwargs,needle", [
    ("alpha_pattern", {"alpha_pattern": {"q_proj": 32}}, "alpha_pattern"),
    ("lora_bias", {"lora_bias": True}, "lora_bias"),
    ("modules_to_save", {"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_peft_features_bdlora_cannot_reproduce_are_refused(tiny_llama_dir, tmp_path, capsys, feature, kwargs, needle):
    """Without the refusal: reblock changed logits by 1.30 (alpha_pattern), conversions dropped lora_B.bias (2.91),
    or kept modules_to_save in the config without its tensor (PEFT could not load the result)."""
    src = _peft_adapter(tiny_llama_dir, tmp_path / feature, **kwargs)
    capsys.readouterr()  # the model loader's progress bar
    out = tmp_path / "out"
    _fails(["convert", "to-bd", src, out, "--nblocks", "2"], capsys, CONFIG_NAME, needle, "does not support")
    _fails(["inspect", src], capsys, needle)
    assert not out.exists()
    with pytest.raises(UnsupportedAdapterError):
        load_adapter(src)


def test_empty_patterns_are_fine(tiny_llama_dir, tmp_path):
    src = _peft_adapter(tiny_llama_dir, tmp_path / "plain")
    raw = json.loads((src / CONFIG_NAME).read_text())
    assert raw["rank_pattern"] == {} and raw["alpha_pattern"] == {}
    assert load_adapter(src).config.r == 4


# --- 6. unreadable files and bad numbers: one clear message naming the file, never a traceback -------------------

@pytest.mark.parametrize("kind", ["empty", "truncated", "garbage"])
def test_broken_safetensors(peft_bd_adapter, tmp_path, capsys, kind):
    bad = _copy(peft_bd_adapter, tmp_path / "bad")
    data = (bad / WEIGHTS_NAME).read_bytes()
    (bad / WEIGHTS_NAME).write_bytes({"empty": b"", "truncated": data[: len(data) // 2],
                                      "garbage": b"\x00garbage" * 100}[kind])
    _fails(["inspect", bad], capsys, bad / WEIGHTS_NAME, "truncated or corrupt")
    _fails(["convert", "to-dense", bad, tmp_path / "out"], capsys, bad / WEIGHTS_NAME)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text,needle", [
    ('{"r": 8, "lora_al', "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ("\xff\xfe", "not valid JSON"),
])
def test_broken_config(peft_bd_adapter, tmp_path, capsys, text, needle):
    bad = _copy(peft_bd_adapter, tmp_path / "bad")
    (bad / CONFIG_NAME).write_bytes(text.encode("latin-1"))
    _fails(["inspect", bad], capsys, bad / CONFIG_NAME, needle)


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c.update(r="eight"), "'r' (the LoRA rank) must be a positive integer, got 'eight'"),
    (lambda c: c.update(r=0), "must be a positive integer, got 0"),
    (lambda c: c.update(lora_alpha="big"), "'lora_alpha' must be a finite number"),
    (lambda c: c["use_bdlora"].update(nblocks=0), "use_bdlora.nblocks (the number of blocks) must be a positive integer"),
    (lambda c: c["use_bdlora"].update(nblocks=-2), "got -2"),
    (lambda c: c.update(use_bdlora=[2]), "'use_bdlora' must be an object"),
    (lambda c: c.update(target_modules=[1, 2]), "'target_modules' must be a list of module names"),
])
def test_bad_config_values(peft_bd_adapter, tmp_path, capsys, edit, needle):
    bad = _copy(peft_bd_adapter, tmp_path / "bad", config=edit)
    _fails(["inspect", bad], capsys, bad / CONFIG_NAME, needle)
    with pytest.raises(AdapterFileError):
        load_adapter(bad)


@pytest.mark.parametrize("argv,needle", [
    (["reblock", "--tp", "0"], "--tp) must be a positive integer, got 0"),
    (["reblock", "--tp", "-2"], "got -2"),
    (["to-bd", "--nblocks", "0"], "nblocks (--nblocks) must be a positive integer, got 0"),
    (["to-bd", "--nblocks", "-2"], "got -2"),
    (["to-bd", "--nblocks", "2", "--rank", "0"], "target rank (--rank) must be a positive integer, got 0"),
])
def test_bad_numbers_on_the_command_line(peft_bd_adapter, tmp_path, capsys, argv, needle):
    src = peft_bd_adapter
    if argv[0] == "to-bd":
        src = tmp_path / "dense"
        assert main(["convert", "to-dense", str(peft_bd_adapter), str(src)]) == 0
        capsys.readouterr()
    _fails(["convert", argv[0], src, tmp_path / "out", *argv[1:]], capsys, needle)
    assert not (tmp_path / "out").exists()


def test_errors_are_bdlora_errors():
    for cls in (AdapterFileError, UnsupportedAdapterError, OutputPathError):
        assert issubclass(cls, BDLoraError)


def test_expert_lora_is_read_and_refused_where_not_served(tmp_path, capsys):
    """A PEFT expert LoRA (``target_parameters`` on a MoE model's fused expert tensors) is read as such (the expert
    factors beside the dense modules' and reported by inspect); target parameters bdlora does not know are refused
    by name; BD-mode serving refuses an expert LoRA on one of the two expert tensors with the way to serve it,
    vLLM's own LoRA (the plugin's stock mode) lets it through to vLLM."""
    import json
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from bdlora.vllm_plugin.validate import validate_adapter

    cfg = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, vocab_size=64)
    model = get_peft_model(Qwen3MoeForCausalLM(cfg), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]))
    src = tmp_path / "experts"
    model.save_pretrained(str(src))
    ad = load_adapter(src)
    assert list(ad.experts) == ["base_model.model.model.layers.0.mlp.experts.gate_up_proj"]
    f = ad.experts["base_model.model.model.layers.0.mlp.experts.gate_up_proj"]
    assert f.lora_A.shape == (4, 4, 32) and f.lora_B.shape == (4, 32, 4) and f.nblocks == 1
    assert len(ad.modules) == 1
    from bdlora.cli import main as cli_main

    assert cli_main(["inspect", str(src)]) == 0
    assert "MoE experts:    LoRA on gate_up_proj of 1 layer(s) x [4] experts" in capsys.readouterr().out
    odd = tmp_path / "odd"
    __import__("shutil").copytree(src, odd)
    raw = json.loads((odd / "adapter_config.json").read_text())
    raw["target_parameters"] = ["mlp.experts.gate_up_proj", "self_attn.q_proj.weight"]
    (odd / "adapter_config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedAdapterError, match=r"target_parameters=.*self_attn.q_proj.weight.*fused expert "
                                                      r"tensors"):
        load_adapter(odd)
    _fails(["inspect", odd], capsys, "target_parameters", "expert")

    def engine(bd):
        return SimpleNamespace(
            additional_config={"bdlora": True} if bd else {}, parallel_config=SimpleNamespace(tensor_parallel_size=1),
            lora_config=SimpleNamespace(max_lora_rank=16, max_loras=1),
            model_config=SimpleNamespace(model=str(tmp_path / "no-model"), hf_config=cfg, hf_text_config=cfg))

    with pytest.raises(BDLoraError, match=r"on both fused expert tensors .* only; this PEFT expert LoRA is for "
                                          r"vLLM's own MoE LoRA "
                                          r"\(start without --enable-bdlora; .*is_3d_lora_weight: true\)"):
        validate_adapter(str(src), engine(bd=True), name="experts")
    assert validate_adapter(str(src), engine(bd=False), name="experts").raw["target_parameters"]


@pytest.mark.parametrize("exc,reason", [
    (OSError(28, "No space left on device"), "no space left on device"),
    (PermissionError(13, "Permission denied"), "permission denied"),
    (OSError(30, "Read-only file system"), "read-only file system"),
    (RuntimeError("Error while serializing: I/O error: Disk quota exceeded (os error 122)"), "disk quota exceeded"),
    (RuntimeError("ProcessRaisedException: ... OSError: [Errno 28] No space left on device"), "no space left"),
    (RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"), "a file write failed"),
    (FileNotFoundError(2, "No such file or directory"), None),
    (ValueError("not a write"), None),
])
def test_disk_write_error_names_what_the_user_fixes(tmp_path, exc, reason):
    """A write that failed for space or permission is a message with the free space of the (nearest existing)
    folder; any other error is not one (the caller re-raises it)."""
    from bdlora.adapter import disk_write_error

    message = disk_write_error(exc, tmp_path / "not" / "yet")
    if reason is None:
        assert message is None
    else:
        assert message.startswith(f"could not write under {tmp_path / 'not' / 'yet'}: {reason}")
        assert message.endswith("GiB free there)")
