"""The trainer on transformers' Trainer: every data format and model source, and bad input with clear messages.

Each bad-input case goes through the CLI (`bdlora train`) as a user would: exit code 2, a message naming the key or
file, never a traceback, never a silently saved adapter.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import yaml

from bdlora.train.config import ConfigError, TrainConfig
from bdlora.train.tasks import toy_chat_records, write_jsonl
from bdlora.train.trainer import list_checkpoints, run_training


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return str(write_jsonl(toy_chat_records(16, seed=3), tmp_path_factory.mktemp("inputs") / "d.jsonl"))


def _base(tiny_llama_dir, data_file, out, **kw) -> dict:
    d = dict(model=str(tiny_llama_dir), nblocks=2, r=8, train_file=data_file, eval_fraction=0.25, batch_size=2,
             max_steps=2, lr=1e-3, output_dir=str(out), progress=False, report_to=[])
    d.update(kw)
    return d


def _cli(tmp_path, raw, *extra, text=None):
    from bdlora.cli import main as bdlora_main

    job = tmp_path / "job.yaml"
    job.write_text(text if text is not None else yaml.safe_dump(raw))
    return bdlora_main(["train", "--config", str(job), *extra])


def _refused(capsys, rc, *needles):
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    return err


# ---------------------------------------------------------------------------------------------------- formats
FORMATS = {
    "alpaca": lambda i: {"instruction": f"Say {i}", "input": "", "output": f"number {i}"},
    "sharegpt": lambda i: {"conversations": [{"from": "human", "value": f"Say {i}"},
                                             {"from": "gpt", "value": f"number {i}"}]},
    "messages": lambda i: {"messages": [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": f"Say {i}"},
                                        {"role": "assistant", "content": f"number {i}"}]},
    "prompt_completion": lambda i: {"prompt": f"Say {i}:", "completion": f" number {i}"},
    "text": lambda i: {"text": f"one two three number {i} is here"},
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_every_format_and_file_type_trains(tiny_llama_dir, tmp_path, fmt, suffix):
    import datasets

    rows = [FORMATS[fmt](i) for i in range(12)]
    path = tmp_path / f"d.{suffix}"
    if suffix == "jsonl":
        write_jsonl(rows, path)
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    res = run_training(TrainConfig.from_dict(_base(tiny_llama_dir, str(path), tmp_path / "o", data_format=fmt)))
    assert res.step == 2 and res.adapter_dir is not None and res.train_loss == res.train_loss
    import bdlora

    assert bdlora.load_adapter(res.adapter_dir).config.nblocks == 2


# ---------------------------------------------------------------------------------------------------- models
def _fake_hub_model(hf_home, repo: str, source):
    """The layout `hf download` leaves in HF_HOME: snapshots/<rev>/ files + refs/main."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(source, root / "snapshots" / rev)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(rev)


def test_hub_id_from_local_cache_is_recorded_as_base(tiny_llama_dir, data_file, tmp_path, monkeypatch):
    from huggingface_hub import constants

    hf_home = tmp_path / "hf"
    _fake_hub_model(hf_home, "bdlora-test/tiny-llama", tiny_llama_dir)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "hub"))
    res = run_training(TrainConfig.from_dict(_base("bdlora-test/tiny-llama", data_file, tmp_path / "o")))
    cfg = json.loads((res.adapter_dir / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "bdlora-test/tiny-llama"  # the id the user gave, not a cache path
    card = (res.adapter_dir / "README.md").read_text()
    assert "base_model: bdlora-test/tiny-llama" in card
    assert "vllm serve bdlora-test/tiny-llama --enable-lora --enable-bdlora --tensor-parallel-size 2" in card
    assert "2 blocks, total rank 8 (4 per block)" in card


def test_missing_hub_id_and_bad_model_folder(tiny_llama_dir, data_file, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    rc = _cli(tmp_path, _base("nobody/not-cached", data_file, tmp_path / "o"))
    _refused(capsys, rc, "'nobody/not-cached' is not in the local Hugging Face cache",
             "`hf download nobody/not-cached`")
    (tmp_path / "empty-folder").mkdir()
    rc = _cli(tmp_path, _base(str(tmp_path / "empty-folder"), data_file, tmp_path / "o"))
    _refused(capsys, rc, "has no config.json")


def test_precision_bf16_loads_base_without_fp32_copy(tiny_llama_dir, data_file, tmp_path):
    res = run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / "o", precision="bf16")))
    base_dtypes = {p.dtype for n, p in res.model.named_parameters() if not p.requires_grad}
    assert base_dtypes == {torch.bfloat16}
    assert {p.dtype for p in res.model.parameters() if p.requires_grad} == {torch.float32}


def test_gradient_checkpointing_gives_the_same_adapter(tiny_llama_dir, data_file, tmp_path):
    a = run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / "a")))
    b = run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / "b",
                                                 gradient_checkpointing=True)))
    pa = {n: p for n, p in a.model.named_parameters() if p.requires_grad}
    pb = {n: p for n, p in b.model.named_parameters() if p.requires_grad}
    assert pa.keys() == pb.keys()
    for n in pa:
        torch.testing.assert_close(pa[n], pb[n], rtol=1e-5, atol=1e-6, msg=n)


def test_unservable_nblocks_warns(tiny_llama_dir, data_file, tmp_path, capsys):
    # tiny Llama: 4 heads, 2 KV heads; N=8 splits every width but not the heads.
    res = run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / "o", nblocks=8, r=8)))
    assert res.adapter_dir is not None
    err = capsys.readouterr().err
    assert "nblocks=8: vLLM cannot serve this model at tensor-parallel size 8" in err


# ---------------------------------------------------------------------------------------------------- bad input
def test_numbers_as_pyyaml_reads_them(tiny_llama_dir, data_file, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_base(tiny_llama_dir, data_file, tmp_path / "o")) + "weight_decay: 1e-2\n")
    cfg = TrainConfig.from_yaml(job, {"lr": "2e-3"})  # `--set lr=2e-3` reaches us as this string
    assert cfg.lr == 2e-3 and cfg.weight_decay == 0.01


@pytest.mark.parametrize("kw, needle", [
    (dict(lr=float("inf")), "lr: must be a finite number"),
    (dict(lr=".inf"), "lr: must be a finite number"),
    (dict(lora_alpha=0), "lora_alpha: must be > 0"),
    (dict(lora_alpha=-4), "lora_alpha: must be > 0"),
    (dict(seed=-1), "seed: must be >= 0"),
    (dict(epochs=0, max_steps=None), "epochs: must be > 0"),
    (dict(max_steps=0), "max_steps: must be >= 1"),
    (dict(warmup_steps=-2), "warmup_steps: must be >= 0"),
    (dict(scheduler="stepwise"), "scheduler: 'stepwise' is not a transformers scheduler"),
    (dict(training_args={"optimm": "adamw_torch"}), "training_args.optimm: not a transformers TrainingArguments"),
    (dict(training_args={"learning_rate": 1.0}), "training_args.learning_rate: bdlora sets this from its own key 'lr'"),
    (dict(target_modules="q_projx"), "q_projx"),
])
def test_bad_values_through_cli(tiny_llama_dir, data_file, tmp_path, capsys, kw, needle):
    rc = _cli(tmp_path, _base(tiny_llama_dir, data_file, tmp_path / "o", **kw))
    _refused(capsys, rc, needle)
    assert not (tmp_path / "o" / "adapter").exists()


def test_yaml_problems(tiny_llama_dir, data_file, tmp_path, capsys):
    good = yaml.safe_dump(_base(tiny_llama_dir, data_file, tmp_path / "o"))
    _refused(capsys, _cli(tmp_path, None, text=good + "r: 16\n"), "key 'r' given twice", "remove one")
    _refused(capsys, _cli(tmp_path, None, text=good + "lr: [1e-3\n"), "YAML syntax error", "job.yaml:")
    _refused(capsys, _cli(tmp_path, None, text="- a\n- b\n"), "expected a YAML mapping")
    _refused(capsys, _cli(tmp_path, None, text=good + "per_device_train_batch_size: 4\n"),
             "bdlora's key for it is 'batch_size'")


def test_data_and_output_problems(tiny_llama_dir, data_file, tmp_path, capsys):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    _refused(capsys, _cli(tmp_path, _base(tiny_llama_dir, str(bad), tmp_path / "o")), "latin1.jsonl", "UTF-8")
    (tmp_path / "a-folder").mkdir()
    _refused(capsys, _cli(tmp_path, _base(tiny_llama_dir, str(tmp_path / "a-folder"), tmp_path / "o")),
             "a-folder is a directory")
    _refused(capsys, _cli(tmp_path, _base(tiny_llama_dir, data_file, tmp_path / "o", batch_size=64)),
             "batch_size: 64 is larger than the training set")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    _refused(capsys, _cli(tmp_path, _base(tiny_llama_dir, data_file, blocker / "out")),
             "output_dir: cannot write to")


def test_diverging_run_stops_at_its_next_log_and_saves_nothing(tiny_llama_dir, data_file, tmp_path, capsys):
    """Its parameters turn NaN at step 1: the run stops at the first log (step 2), not at the end of its 40 steps,
    whether the loss or the gradient norm shows it first; no adapter is written."""
    import json

    rc = _cli(tmp_path, _base(tiny_llama_dir, data_file, tmp_path / "o", lr=1e30, max_grad_norm=0, max_steps=40,
                              scheduler="constant", warmup_steps=0, log_every=2))
    _refused(capsys, rc, "step 2: the", "training diverged")
    assert not (tmp_path / "o" / "adapter").exists()
    recs = [json.loads(l) for l in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines() if l.strip()]
    assert [r["step"] for r in recs] == [2]  # the diverged step's record, then nothing
    assert not all(math.isfinite(recs[0].get(k, 0.0)) for k in ("train_loss", "grad_norm"))


# ---------------------------------------------------------------------------------------------------- resume
def test_unreadable_newest_checkpoint_falls_back_bit_identically(tiny_llama_dir, data_file, tmp_path, capsys):
    kw = dict(max_steps=4, save_every=1, save_total_limit=3, lora_dropout=0.1, eval_fraction=0.0,
              scheduler="cosine", warmup_steps=1)
    straight = run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / "a", **kw)))
    run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / "b", **kw)), stop_after_steps=3)
    assert [p.name for p in list_checkpoints(tmp_path / "b")] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    opt = tmp_path / "b" / "checkpoint-3" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[:100])  # a torn write (disk full, copy interrupted)
    resumed = run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / "b", resume="auto",
                                                       **kw)))
    err = capsys.readouterr().err
    assert "skipping unreadable checkpoint" in err and str(opt) in err
    for (n, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), n
    steps = [json.loads(l)["step"] for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
             if "train_loss" in json.loads(l)]
    assert steps == [1, 2, 3, 4]  # steps redone after the resume are logged once


def test_explicit_resume_of_a_bad_checkpoint_is_refused(tiny_llama_dir, data_file, tmp_path, capsys):
    run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / "o", save_every=1)),
                 stop_after_steps=1)
    ckpt = tmp_path / "o" / "checkpoint-1"
    (ckpt / "trainer_state.json").write_text("{")
    rc = _cli(tmp_path, _base(tiny_llama_dir, data_file, tmp_path / "o", save_every=1, resume=str(ckpt)))
    _refused(capsys, rc, "is not a usable checkpoint", "trainer_state.json")
    with pytest.raises(ConfigError, match="not a checkpoint folder"):
        run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / "o",
                                                 resume=str(tmp_path / "nope"))))


@pytest.mark.parametrize("row_tokens", [512, 1], ids=["one-row", "several-rows"])
def test_packing_gives_the_padded_batches_loss(tiny_llama_dir, data_file, tmp_path, monkeypatch, row_tokens):
    """packing: true (padding-free rows with restarting position ids) trains on the same targets: the first step's
    loss equals the padded batch's, and the adapters after a step are close; also when the examples fill several
    rows with padded tails (rows capped at the longest example)."""
    from bdlora.train.engine import packing

    monkeypatch.setattr(packing, "MIN_ROW_TOKENS", row_tokens)

    def first_loss(out, **kw):
        res = run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / out, max_steps=1,
                                                       eval_fraction=0.0, batch_size=4, **kw)))
        rec = [json.loads(l) for l in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        return next(r["train_loss"] for r in rec if "train_loss" in r), res

    padded, a = first_loss("padded")
    packed, b = first_loss("packed", packing=True)
    assert packed == pytest.approx(padded, rel=1e-4)
    def tokens_seen(out):
        return [json.loads(l).get("tokens_seen") for l in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]

    tokens, padded_tokens = tokens_seen("packed"), tokens_seen("padded")
    assert [t for t in tokens if t] == [t for t in padded_tokens if t] != []  # example tokens, padding not counted
    for (n, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        if pa.requires_grad:
            torch.testing.assert_close(pa, pb, rtol=1e-3, atol=1e-5, msg=n)


@pytest.mark.parametrize("packing", [False, True])
def test_tokens_seen_equal_transformers_count(tiny_llama_dir, data_file, tmp_path, packing):
    """The trainer counts tokens_seen itself (summed on the device, read at logs): the same numbers as transformers'
    per-step count ("non_padding"), which a user's training_args setting still selects instead."""
    def run(out, **kw):
        res = run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / out, max_steps=4,
                                                       log_every=1, eval_fraction=0.0, packing=packing, **kw)))
        rec = [json.loads(l) for l in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        return res, [(r["step"], r["tokens_seen"]) for r in rec if "train_loss" in r]

    from bdlora.train.trainer import training_arguments

    assert training_arguments(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / "x")), 4,
                              False).include_num_input_tokens_seen == "no"  # transformers' per-step read is off
    ours, counted = run("ours")
    theirs, reference = run("theirs", training_args={"include_num_input_tokens_seen": "non_padding"})
    assert counted == reference and [s for s, _ in counted] == [1, 2, 3, 4]
    assert ours.tokens_per_s and ours.tokens_per_s > 0


def test_pad_multiple_trains_the_same_adapter(tiny_llama_dir, data_file, tmp_path):
    """pad_multiple: 64 rounds every batch up to 64 tokens of masked padding: the same losses, the same token count
    (padding is not counted) and the same adapter as batches padded to their longest example."""
    def run(out, **kw):
        res = run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / out, max_steps=2,
                                                       eval_fraction=0.0, batch_size=4, **kw)))
        rec = [json.loads(l) for l in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        return [(r["train_loss"], r["tokens_seen"]) for r in rec if "train_loss" in r], res

    plain, a = run("plain")
    rounded, b = run("rounded", pad_multiple=64)
    assert [t for _, t in rounded] == [t for _, t in plain] != []
    assert [loss for loss, _ in rounded] == pytest.approx([loss for loss, _ in plain], rel=1e-5)
    for (n, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        if pa.requires_grad:
            torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6, msg=n)


def test_sdpa_runs_without_cudnn_attention_unless_asked(tiny_llama_dir, data_file, tmp_path, sdpa_backend_flags):
    """Every sdpa call of a training run sees cuDNN attention off (flash, memory-efficient and math as they were),
    and the setting is the run's only: restored afterwards; `cudnn_attention: true` leaves it on."""
    assert torch.backends.cuda.cudnn_sdp_enabled()  # torch's default: the test shows the run turning it off
    for out, kw, flags in (("off", {}, (False, True, True, True)), ("on", {"cudnn_attention": True}, (True,) * 4)):
        sdpa_backend_flags.clear()
        run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / out, attn_implementation="sdpa",
                                                 max_steps=1, **kw)))  # the final evaluation's calls too
        assert sdpa_backend_flags and set(sdpa_backend_flags) == {flags}, out
        assert torch.backends.cuda.cudnn_sdp_enabled() is True


def test_checkpointing_every_other_layer_gives_the_same_adapter(tiny_llama_dir, data_file, tmp_path):
    """gradient_checkpointing_every_n_layers: 2 recomputes only layer 0 of the tiny Llama's two (transformers'
    every_n_layers; the trained model keeps the flags the Trainer set) and trains the same adapter as checkpointing
    none; without gradient_checkpointing the key is refused, named."""
    a = run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / "a")))
    b = run_training(TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / "b",
                                                 gradient_checkpointing=True,
                                                 gradient_checkpointing_every_n_layers=2)))
    layers = b.model.get_base_model().model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    pa = {n: p for n, p in a.model.named_parameters() if p.requires_grad}
    pb = {n: p for n, p in b.model.named_parameters() if p.requires_grad}
    assert pa.keys() == pb.keys()
    for n in pa:
        torch.testing.assert_close(pa[n], pb[n], rtol=1e-5, atol=1e-6, msg=n)
    with pytest.raises(ConfigError, match="gradient_checkpointing_every_n_layers: takes effect with "
                                          "gradient_checkpointing: true"):
        TrainConfig.from_dict(_base(tiny_llama_dir, data_file, tmp_path / "d",
                                    gradient_checkpointing_every_n_layers=2))
