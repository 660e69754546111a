"""Checkpoint/resume exactness, the saved PEFT folder, metrics log."""

from __future__ import annotations

import json

import pytest
import torch

from bdlora.train.config import ConfigError, TrainConfig
from bdlora.train.tasks import toy_chat_records, write_jsonl
from bdlora.train.trainer import list_checkpoints, run_training


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return str(write_jsonl(toy_chat_records(24, seed=5), tmp_path_factory.mktemp("resume-data") / "d.jsonl"))


def _cfg(tiny_llama_dir, data_file, out, **kw):
    base = dict(model=str(tiny_llama_dir), nblocks=2, r=8, lora_alpha=16, lora_dropout=0.1, train_file=data_file,
                eval_fraction=0.2, eval_every=2, lr=3e-3, scheduler="cosine", warmup_steps=1, batch_size=3,
                grad_accum=2, max_steps=4, seed=11, output_dir=str(out), progress=False, report_to=[])
    base.update(kw)
    return TrainConfig.from_dict(base)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("backend", ["auto", "cublas"])
def test_resume_is_exact(tiny_llama_dir, data_file, tmp_path, backend):
    # 2k straight vs k + resume + k; dropout, grad accumulation, a warm-up + cosine schedule and epoch wrap-around
    # (4 steps x 6 examples > 19 training examples) all take part. "cublas": bdlora's kernel layer, whose dropout
    # masks come from seeds drawn from torch's CPU generator, which the checkpoint's RNG state restores.
    def cfg(out, **kw):
        return _cfg(tiny_llama_dir, data_file, out, lora_backend=backend, **kw)

    straight = run_training(cfg(tmp_path / "a"))
    assert straight.step == 4 and straight.adapter_dir is not None

    first = run_training(cfg(tmp_path / "b"), stop_after_steps=2)
    assert first.step == 2 and first.adapter_dir is None
    ckpts = list_checkpoints(tmp_path / "b")
    assert [p.name for p in ckpts] == ["checkpoint-2"]
    assert (ckpts[0] / "adapter_model.safetensors").is_file() and (ckpts[0] / "trainer_state.json").is_file()
    assert not [p for p in (tmp_path / "b").iterdir() if p.name.startswith(".staging")]  # atomic
    # transformers' FLOP count (6 x input tokens x non-embedding parameters), from a parameter count taken once
    flos = json.loads((ckpts[0] / "trainer_state.json").read_text())["total_flos"]
    per_token = 6 * first.model.num_parameters(exclude_embeddings=True)
    assert flos > 0 and flos % per_token == 0 and flos // per_token <= 2 * 6 * 4096

    resumed = run_training(cfg(tmp_path / "b", resume="auto"))
    assert resumed.step == 4
    a, b = _params(straight.model), _params(resumed.model)
    assert a.keys() == b.keys() and len(a) == 28
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert resumed.eval["eval_loss"] == straight.eval["eval_loss"]

    # Both logs have the same train losses and token counts step for step (the count read at logs and
    # checkpoints only: the checkpoint's state holds the tokens of its steps).
    def logged(d, key):
        recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r[key] for r in recs if "train_loss" in r}

    assert logged(tmp_path / "a", "train_loss") == logged(tmp_path / "b", "train_loss")
    tokens = logged(tmp_path / "a", "tokens_seen")
    assert tokens == logged(tmp_path / "b", "tokens_seen") and 0 < tokens[2] < tokens[4]
    assert json.loads((ckpts[0] / "trainer_state.json").read_text())["num_input_tokens_seen"] == tokens[2]

    # Changing the math of the job is refused, with the key named.
    with pytest.raises(ConfigError, match=r"lr: 0.003 -> 0.001"):
        run_training(cfg(tmp_path / "b", resume=str(ckpts[0]), lr=1e-3))


def test_saved_folder_loads_in_peft_with_identical_outputs(tiny_llama_dir, data_file, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import bdlora

    res = run_training(_cfg(tiny_llama_dir, data_file, tmp_path / "c", max_steps=2, eval_every=0,
                            report_to=["tensorboard"], lora_dropout=0.0))
    folder = res.adapter_dir
    ad = bdlora.load_adapter(folder)
    assert ad.config.is_bd and ad.config.nblocks == 2 and ad.config.r == 8
    assert ad.config.scale == pytest.approx(res.spec.scale)  # alpha*sqrt(N)/sqrt(r), as trained

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(folder)).eval()
    ids = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = res.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        with loaded.disable_adapter():
            base_out = loaded(input_ids=ids).logits
    assert torch.equal(want, got)
    assert (want - base_out).abs().max() > 1e-4  # the adapter does something

    recs = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "train_loss" in r] == [1, 2]
    assert any("eval_loss" in r and "eval_ppl" in r for r in recs)
    assert list((tmp_path / "c" / "runs").rglob("events.*"))  # transformers' TensorBoardCallback
    assert (tmp_path / "c" / "loss.png").stat().st_size > 1000  # the loss plot written at the end
    card = (folder / "README.md").read_text()
    assert f"vllm serve {tiny_llama_dir} --enable-lora --enable-bdlora --tensor-parallel-size 2" in card
    assert "base_model:" not in card  # a local folder is no hub id: no metadata pointing the hub at a path
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_llama_dir)


def test_bf16_autocast_and_epochs(tiny_llama_dir, data_file, tmp_path):
    # precision: bf16 runs the base model under CPU autocast; adapter weights stay fp32. epochs sets the length.
    res = run_training(_cfg(tiny_llama_dir, data_file, tmp_path / "d", precision="bf16", max_steps=None,
                            epochs=0.5, batch_size=4, grad_accum=1, eval_every=0, save_every=1))
    assert res.total_steps == 3 and res.step == 3  # ceil(0.5 * 19 / 4)
    assert all(p.dtype == torch.float32 for p in res.model.parameters() if p.requires_grad)
    assert res.train_loss is not None and res.train_loss == res.train_loss  # finite, not NaN
    assert [p.name for p in list_checkpoints(tmp_path / "d")] == ["checkpoint-2", "checkpoint-3"]  # limit 2
    # Re-running the finished job with resume: auto trains nothing more and rewrites the same adapter.
    again = run_training(_cfg(tiny_llama_dir, data_file, tmp_path / "d", precision="bf16", max_steps=None,
                              epochs=0.5, batch_size=4, grad_accum=1, eval_every=0, save_every=1, resume="auto"))
    assert again.step == 3
    for (n, a), (_, b) in zip(res.model.named_parameters(), again.model.named_parameters()):
        assert torch.equal(a, b), n


def _adapter_tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["inside-a-checkpoint-write", "between-steps"])
def test_kill_9_then_resume_is_bit_identical(tiny_llama_dir, data_file, tmp_path, moment):
    """SIGKILL the `bdlora train` process (a checkpoint half-written, or mid-training), then run the same command
    again with resume: auto: the final adapter equals an uninterrupted run's tensor for tensor."""
    import os
    import subprocess
    import sys

    import yaml
    from killing import sigkill_when

    def job(out):
        p = tmp_path / f"{out}.yaml"
        p.write_text(yaml.safe_dump(dict(
            model=str(tiny_llama_dir), nblocks=2, r=8, lora_dropout=0.1, train_file=data_file, eval_fraction=0.0,
            lr=3e-3, scheduler="cosine", warmup_steps=1, batch_size=3, grad_accum=2, max_steps=6, seed=11,
            save_every=1, save_total_limit=2, output_dir=str(tmp_path / out), progress=False, report_to=[],
            resume="auto")))
        return [sys.executable, "-m", "bdlora.train", "--config", str(p)]

    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    subprocess.run(job("straight"), env=env, check=True, capture_output=True, timeout=300)
    out = tmp_path / "killed"
    proc = subprocess.Popen(job("killed"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if moment == "inside-a-checkpoint-write":  # the trainer renames its staging folder while we list it: a race
        due = lambda: out.is_dir() and bool(list(out.glob(".staging-checkpoint-*/*")))  # noqa: E731
    else:
        due = lambda: (out / "checkpoint-3").is_dir()  # noqa: E731
    assert sigkill_when(proc, due, timeout_s=240), "the run ended before the kill moment came"
    assert not (out / "adapter").exists()
    resumed = subprocess.run(job("killed"), env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout or moment == "inside-a-checkpoint-write"
    want, got = _adapter_tensors(tmp_path / "straight" / "adapter"), _adapter_tensors(out / "adapter")
    assert want.keys() == got.keys() and len(want) == 28
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert not list(out.glob(".staging-*"))  # the interrupted write's staging folder was cleaned up
