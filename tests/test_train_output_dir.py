"""A trained adapter is never replaced unasked: a second, different job with the same output_dir is refused (the
first job's adapter and checkpoints untouched), the same job continues only with resume, and overwrite_output_dir
replaces the old job's work; `--output-dir` on the command line sets the folder."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from bdlora.train.config import ConfigError, TrainConfig
from bdlora.train.tasks import toy_chat_records, write_jsonl
from bdlora.train.trainer import list_checkpoints, run_training


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return str(write_jsonl(toy_chat_records(16, seed=2), tmp_path_factory.mktemp("outdir") / "d.jsonl"))


def _cfg(model, data, out, **kw):
    base = dict(model=str(model), train_file=data, nblocks=2, r=4, max_steps=2, batch_size=4, eval_fraction=0.0,
                save_every=1, output_dir=str(out), progress=False, report_to=[])
    base.update(kw)
    return TrainConfig(**base)


def _bytes(out):
    return (out / "adapter" / "adapter_model.safetensors").read_bytes()


def test_a_trained_adapter_is_never_replaced_unasked(tiny_llama_dir, data_file, tmp_path):
    out = tmp_path / "run"
    run_training(_cfg(tiny_llama_dir, data_file, out, lr=1e-3))
    first, ckpts = _bytes(out), [p.name for p in list_checkpoints(out)]
    with pytest.raises(ConfigError, match=r"holds a trained adapter \(adapter/\) of another job \(it differs in lr, "
                                          r"max_steps\).*overwrite_output_dir: true"):
        run_training(_cfg(tiny_llama_dir, data_file, out, lr=3e-3, max_steps=3))
    with pytest.raises(ConfigError, match="holds a trained adapter .* of this same job; set resume: auto"):
        run_training(_cfg(tiny_llama_dir, data_file, out, lr=1e-3))
    assert _bytes(out) == first and [p.name for p in list_checkpoints(out)] == ckpts
    again = run_training(_cfg(tiny_llama_dir, data_file, out, lr=1e-3, resume="auto"))  # the same job, finished
    assert again.step == 2 and _bytes(out) == first
    other = run_training(_cfg(tiny_llama_dir, data_file, out, lr=3e-3, max_steps=3, overwrite_output_dir=True))
    assert other.step == 3 and _bytes(out) != first
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]  # the new job's only


def test_output_dir_flag_and_the_refusal_on_the_command_line(tiny_llama_dir, data_file, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(dict(model=str(tiny_llama_dir), train_file=data_file, nblocks=2, r=4, max_steps=1,
                                       batch_size=4, eval_fraction=0.0, progress=False, report_to=[])))
    cmd = [sys.executable, "-m", "bdlora.train", "--config", str(job), "--output-dir", str(tmp_path / "cli")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "cli" / "adapter" / "adapter_config.json").is_file()
    r = subprocess.run(cmd + ["--set", "lr=0.01"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("bdlora train: error: output_dir:")


def test_one_process_trains_on_one_gpu(monkeypatch):
    """A run not launched data parallel narrows CUDA_VISIBLE_DEVICES to its first GPU before CUDA starts (else
    transformers' DataParallel would multiply its batch over every GPU); launched runs are left alone; a process
    whose CUDA already started with several GPUs is refused with what to do. (The GPU machines run the real thing:
    tests/test_train_fsdp.py on 2 and 4 GPUs.)"""
    import torch

    from bdlora.train.trainer import use_one_gpu_unless_launched

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    for k in ("WORLD_SIZE", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,7")
    note = use_one_gpu_unless_launched()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    assert "4 GPUs visible; this one process trains on GPU 2" in note and "accelerate launch --num_processes 4" in note
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert use_one_gpu_unless_launched() is None and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigError, match="CUDA is already started; bdlora trains one process on one GPU"):
        use_one_gpu_unless_launched()


def _full_disk_after_checkpoints(tensors, filename, *args, **kwargs):
    """safetensors' save_file on a disk that filled up after the checkpoints: the adapter's write fails."""
    import safetensors
    from safetensors.torch import save_file

    if "checkpoint-" in str(filename):
        return save_file(tensors, filename, *args, **kwargs)
    raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_is_a_message_and_the_run_resumes(tiny_llama_dir, data_file, tmp_path, monkeypatch, capsys):
    """The adapter's write fails for lack of space (safetensors' error, as on a full disk): exit 2 with the reason,
    the free space and what to do; no adapter folder, no temp folder left. With a checkpoint the message says resume,
    and the same command with resume=auto then writes the adapter; without one it says so."""
    import peft.peft_model

    from bdlora.train.trainer import main

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(dict(model=str(tiny_llama_dir), train_file=data_file, nblocks=2, r=4, max_steps=2,
                                       batch_size=4, eval_fraction=0.0, save_every=1, progress=False, report_to=[])))
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(peft.peft_model, "safe_save_file", _full_disk_after_checkpoints)
        assert main(["--config", str(job), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"bdlora train: error: could not write under {out}: no space left on device (" in err
    assert "GiB free there); make room, then run the same command with --set resume=auto: it continues from " \
           "checkpoint-2" in err and "Traceback" not in err
    # the checkpoints and the run's records; no adapter folder, no temp folder of the failed write
    assert {p.name for p in out.iterdir()} == {"checkpoint-1", "checkpoint-2", "metrics.jsonl", "train_config.yaml"}
    assert main(["--config", str(job), "--output-dir", str(out), "--set", "resume=auto"]) == 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    no_ckpt = tmp_path / "no-ckpt"
    with monkeypatch.context() as m:
        m.setattr(peft.peft_model, "safe_save_file", _full_disk_after_checkpoints)
        assert main(["--config", str(job), "--output-dir", str(no_ckpt), "--set", "save_every=0"]) == 2
    assert "no checkpoint was written (save_every: 0)" in capsys.readouterr().err
