"""Job-file validation: every bad config fails with a clear message before any training step."""

from __future__ import annotations

import pytest

from bdlora.spec import BDLoraError
from bdlora.train.config import ConfigError, TrainConfig
from bdlora.train.tasks import toy_chat_records, write_jsonl


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return str(write_jsonl(toy_chat_records(12), tmp_path_factory.mktemp("cfgdata") / "d.jsonl"))


def _cfg(data_file, **kw):
    base = dict(model="tiny-random", train_file=data_file)
    base.update(kw)
    return TrainConfig.from_dict(base)


def test_unknown_key_lists_valid_keys(tmp_path, data_file):
    p = tmp_path / "job.yaml"
    p.write_text(f"train_file: {data_file}\nper_device_train_batch_size: 4\nnblock: 2\n")
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_yaml(p)
    msg = str(e.value)
    assert "'per_device_train_batch_size' (bdlora's key for it is 'batch_size')" in msg
    assert "'nblock'" in msg and "did you mean 'nblocks'" in msg
    for key in ("nblocks", "lr", "batch_size", "max_steps", "resume"):
        assert key in msg

    # a misspelt key of transformers' TrainingArguments: that key and bdlora's for it; a data key of another tool
    p.write_text(f"train_file: {data_file}\nlerning_rate: 1e-4\ndata: d.jsonl\n")
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_yaml(p)
    msg = str(e.value)
    assert "'lerning_rate' (did you mean 'learning_rate'? bdlora's key for it is 'lr')" in msg, msg
    assert "'data' (bdlora's key is 'train_file'" in msg, msg


@pytest.mark.parametrize("tool, text, hints", [
    ("axolotl", "base_model: x\nlora_r: 8\nmicro_batch_size: 2\nsequence_len: 512\nsample_packing: true\n"
     "datasets:\n  - path: d.jsonl\n    type: alpaca\nadapter: lora\n",
     {"base_model": "model", "lora_r": "r", "micro_batch_size": "batch_size", "sequence_len": "max_length",
      "sample_packing": "packing", "datasets": "bdlora's key is 'train_file'",
      "adapter": "bdlora always trains a BD-LoRA"}),
    ("LLaMA-Factory", "model_name_or_path: x\nfinetuning_type: lora\nlora_rank: 8\nlora_target: all\n"
     "cutoff_len: 512\nval_size: 0.1\n",
     {"model_name_or_path": "model", "finetuning_type": "bdlora always trains a BD-LoRA", "lora_rank": "r",
      "lora_target": "target_modules", "cutoff_len": "max_length", "val_size": "eval_fraction"}),
    ("PEFT and TRL", "use_rslora: true\ninit_lora_weights: gaussian\nmax_seq_length: 512\noptim: adamw_torch\n"
     "pad_to_multiple_of: 8\n",
     {"use_rslora": "bdlora always uses the rsLoRA scale", "init_lora_weights": "a_init",
      "max_seq_length": "max_length", "optim": "training_args.optim", "pad_to_multiple_of": "pad_multiple"}),
])
def test_keys_of_other_tools_name_bdloras_key(tmp_path, data_file, tool, text, hints):
    """A config written for another tool (axolotl, LLaMA-Factory, PEFT's LoraConfig, TRL's SFTConfig) is refused
    with, for each of its keys, bdlora's key for it or why it has none: never a loose "did you mean" guess such as
    'lora_r' -> 'lora_dropout'."""
    p = tmp_path / "job.yaml"
    p.write_text(f"train_file: {data_file}\n" + text)
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_yaml(p)
    msg = str(e.value)
    for key, hint in hints.items():
        named = f"'{key}' (bdlora's key for it is '{hint}')"
        assert named in msg or f"'{key}' ({hint}" in msg, (tool, key, msg)
    assert "did you mean" not in msg, msg


def test_yaml_roundtrip_and_overrides(tmp_path, data_file):
    p = tmp_path / "job.yaml"
    p.write_text(f"model: tiny-random\ntrain_file: {data_file}\nnblocks: 4\nr: 16\nlr: 1.0e-3\nscheduler: cosine\n"
                 "training_args: {dataloader_num_workers: 0}\n")
    cfg = TrainConfig.from_yaml(p, {"max_steps": 5, "training_args.optim": "adamw_torch_fused"})
    assert (cfg.nblocks, cfg.r, cfg.lr, cfg.scheduler, cfg.max_steps) == (4, 16, 1e-3, "cosine", 5)
    assert cfg.training_args == {"dataloader_num_workers": 0, "optim": "adamw_torch_fused"}  # dotted: one entry
    assert cfg.warmup_for(100) == 5 and cfg.spec("llama").scale == pytest.approx(16 * 2 / 4)
    with pytest.raises(ConfigError, match="dotted keys set one entry of training_args or early_exit"):
        TrainConfig.from_yaml(p, {"lr.x": 1})


def test_model_is_required(tmp_path, data_file):
    """A job without model: is refused naming the key and what to give (never a silent random model)."""
    p = tmp_path / "job.yaml"
    p.write_text(f"train_file: {data_file}\nmax_steps: 1\n")
    with pytest.raises(ConfigError, match="job.yaml: model: is required: a hub id"):
        TrainConfig.from_yaml(p)


@pytest.mark.parametrize("name, ours", [("learning_rate", "lr"), ("base_model", "model"), ("rank", "r"),
                                        ("gradient_accumulation_steps", "grad_accum"), ("steps", "max_steps"),
                                        ("dtype", "precision")])
def test_other_tools_names_are_refused_with_ours(data_file, name, ours):
    """One rule: every name another tool (or bdlora's engine before) gives a bdlora key is refused naming ours."""
    with pytest.raises(ConfigError, match=f"'{name}' \\(bdlora's key for it is '{ours}'\\)"):
        _cfg(data_file, **{name: 1})


@pytest.mark.parametrize("kw, needle", [
    (dict(nblocks=3, r=8), "r: rank 8 is not divisible by nblocks=3"),
    (dict(nblocks=0), "nblocks"),
    (dict(scheduler="step"), "scheduler"),
    (dict(precision="fp8"), "precision"),
    (dict(lr=0), "lr"),
    (dict(r="eight"), "r: must be an integer"),
    (dict(batch_size=0), "batch_size"),
    (dict(pad_multiple=0), "pad_multiple: must be >= 1"),
    (dict(lora_dropout=1.0), "lora_dropout"),
    (dict(column_modules=["q_proj"]), "column_modules and row_modules go together"),
    (dict(train_file=None), "train_file"),
])
def test_bad_values(data_file, kw, needle):
    with pytest.raises(ConfigError, match=None) as e:
        _cfg(data_file, **kw)
    assert needle in str(e.value)


def test_unknown_preset_module(data_file):
    cfg = _cfg(data_file, target_modules=["q_proj", "qkv_proj"])
    with pytest.raises(BDLoraError, match=r"unknown target modules \['qkv_proj'\]"):
        cfg.spec("llama")


def _fails_before_training(cfg, tmp_path, match):
    from bdlora.train.trainer import run_training

    with pytest.raises(BDLoraError, match=match):
        run_training(cfg)
    assert not (tmp_path / "out" / "adapter").exists()
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_module_not_in_model(tiny_llama_dir, tmp_path, data_file):
    cfg = _cfg(data_file, model=str(tiny_llama_dir), column_modules=["q_proj", "qkv"], row_modules=["o_proj"],
               output_dir=str(tmp_path / "out"), progress=False, report_to=[])
    _fails_before_training(cfg, tmp_path, r"target modules \['qkv'\] match no nn.Linear")


def test_nblocks_not_dividing_dims(tiny_llama_dir, tmp_path, data_file):
    # tiny Llama: k/v projections are 128 wide, not divisible by 3.
    cfg = _cfg(data_file, model=str(tiny_llama_dir), nblocks=3, r=6, output_dir=str(tmp_path / "out"),
               progress=False, report_to=[])
    _fails_before_training(cfg, tmp_path, "not divisible by nblocks=3")


def test_cli_reports_errors(tmp_path, capsys, data_file):
    from bdlora.cli import main as bdlora_main

    p = tmp_path / "job.yaml"
    p.write_text(f"train_file: {data_file}\nr: 7\nnblocks: 2\n")
    assert bdlora_main(["train", "--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert "bdlora train: error:" in err and "not divisible by nblocks=2" in err
    assert bdlora_main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert bdlora_main(["train", "--print-config"]) == 0
    assert "nblocks:" in capsys.readouterr().out


def test_shipped_configs_parse():
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    for p in (root / "examples" / "quickstart.yaml", root / "examples" / "job.yaml"):
        raw = yaml.safe_load(p.read_text())
        TrainConfig.from_dict({**raw, "train_file": raw.get("train_file") or "x.jsonl"}, source=str(p))
